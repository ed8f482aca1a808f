"""``mha build``: not written yet."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("build", help="(not available yet)")
    p.set_defaults(func=run)


def run(args) -> int:
    print("mha build: not available in this version")
    return 2
