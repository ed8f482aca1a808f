"""The child side of the tests that run their checks in one subprocess with a kernel forced
(tests/test_kernel_paths.py, test_amx_paths.py, test_flash_bwd_amx.py): run every check, turn
each outcome into a string and print them as one JSON line for the parent test to read.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable


def run_checks(selected: str, checks: dict[str, Callable[[], str]], *,
               timings: bool = False) -> None:
    """Print ``{"selected": selected, check: "ok" | "failed: ..." | "error: ..."}``. The checks
    run only when the selection is "ok" (a check on the wrong kernel proves nothing); otherwise
    each reports the selection's verdict. ``timings``: each check's seconds on stderr."""
    results = {"selected": selected}
    for name, check in checks.items():
        if selected != "ok":
            results[name] = selected
            continue
        start = time.perf_counter()
        try:
            results[name] = check()
        except AssertionError as e:
            results[name] = f"failed: {e}"
        except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the test
            results[name] = f"error: {type(e).__name__}: {e}"
        if timings:
            print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    print(json.dumps(results))
