"""Processes started together, for the tests of a measurement that two processes must not both
take (``mha.ops.linear_choice`` / ``flash_choice``: the file lock around measuring).

Each process runs ``script`` with its own arguments followed by two paths, ``ready`` and ``go``:
the script touches ``ready`` when it is set up and waits until ``go`` exists, so every process
is past its imports before any of them starts, then prints its answer on stdout.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import mha

SRC = str(Path(mha.__file__).parent.parent)


def race(tmp_path: Path, script: str, argvs: list[list[str]], timeout: float = 120) -> list[str]:
    """Run ``script`` once per argument list in ``argvs``, all released at once; each
    process's stdout, stripped, in order. A process that fails fails the test with its
    stderr."""
    go = tmp_path / "go"
    procs = []
    for i, argv in enumerate(argvs):
        ready = tmp_path / f"ready{i}"
        procs.append((ready, subprocess.Popen(
            [sys.executable, "-c", script, *argv, str(ready), str(go)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"})))
    for ready, p in procs:
        while not ready.exists():  # (a short sleep leaves the cores to the racers)
            assert p.poll() is None, p.communicate()[1]
            time.sleep(0.005)
    go.touch()
    outs = []
    for _, p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err
        outs.append(out.strip())
    return outs
