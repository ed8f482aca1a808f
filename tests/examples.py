"""How many hypothesis examples a test with its own count draws: that count, times ten under
``MHA_HYPOTHESIS_PROFILE=thorough`` (as the profiles in conftest.py scale the others)."""

from __future__ import annotations

import os

FACTOR = 10 if os.environ.get("MHA_HYPOTHESIS_PROFILE") == "thorough" else 1


def examples(n: int) -> int:
    return n * FACTOR
