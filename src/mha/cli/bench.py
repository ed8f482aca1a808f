"""``mha bench``: not written yet."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="(not available yet)")
    p.set_defaults(func=run)


def run(args) -> int:
    print("mha bench: not available in this version")
    return 2
