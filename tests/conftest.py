"""Shared test settings: hypothesis profiles sized for a 2-core machine."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile("default", max_examples=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=400, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
# CI draws the same examples on every run (a red CI names a commit, not a lucky draw); local runs
# keep exploring new ones and remember failures in .hypothesis/.
settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
IN_CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
settings.load_profile(os.environ.get("MHA_HYPOTHESIS_PROFILE", "ci" if IN_CI else "default"))
torch.set_num_threads(min(2, os.cpu_count() or 1))


# In CI every optional piece is installed (make test installs the extras and Chromium), so a
# skip for a missing dependency there means a broken install step: report it as a failure.
_missing_dependency_skips: list[str] = []


def _note_skip(report) -> None:
    if report.skipped and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2])
        if "not installed" in reason:
            _missing_dependency_skips.append(f"{report.nodeid}: {reason}")


def pytest_runtest_logreport(report):
    _note_skip(report)


def pytest_collectreport(report):
    _note_skip(report)


def pytest_sessionfinish(session, exitstatus):
    if IN_CI and _missing_dependency_skips:
        print("\nCI: tests skipped for a missing dependency (an install step is broken):")
        for line in _missing_dependency_skips:
            print("  " + line)
        session.exitstatus = 1


@pytest.fixture
def spy(monkeypatch):
    """Record the keyword arguments (and q/k shapes) of every mha.attention call that the
    Hugging Face integration makes, while still running it."""
    import mha.integrations.transformers as hf

    calls: list[dict] = []
    real = hf.attention

    def recording(q, k, v, **kw):
        calls.append(dict(kw, q=tuple(q.shape), k=tuple(k.shape)))
        return real(q, k, v, **kw)

    monkeypatch.setattr(hf, "attention", recording)
    return calls


@pytest.fixture
def native_linear(monkeypatch):
    """``mha.linear`` forced onto its native op (as ``MHA_LINEAR=native``), whatever the
    measured choice on this CPU (where it lacks AVX-512: the portable loops, same packing and
    blocking), so the op is tested everywhere it builds."""
    from mha.ops import linear, linear_choice

    reason = linear.load()
    if reason is not None:
        pytest.skip(f"the native projections did not build: {reason}")
    monkeypatch.setattr(linear_choice, "forced", lambda: "native")
