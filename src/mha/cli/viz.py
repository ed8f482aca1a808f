"""``mha viz``: not written yet."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("viz", help="(not available yet)")
    p.set_defaults(func=run)


def run(args) -> int:
    print("mha viz: not available in this version")
    return 2
