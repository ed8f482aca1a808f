"""The distributed benchmark's harness (mha.bench.distributed) at its smallest size: two gloo
processes, every strategy forward and forward+backward, the link fit, the predictions."""

from __future__ import annotations

import math

import pytest

from mha.bench import distributed as bd


@pytest.fixture(scope="module")
def report():
    return bd.run((2,), quick=True)


def test_the_byte_model_is_the_bytes_mha_sends(report):
    """Every collective mha issued during a step was counted; the model's formula gives the
    same bytes, up to the arguments' agreement exchange (19 float64 per peer)."""
    assert {(r["strategy"], r["backward"]) for r in report["fit_check"]} == {
        (s, b) for s in bd.STRATEGIES for b in (False, True)}
    for r in report["fit_check"]:
        extra = r["bytes_measured"] - r["bytes_model"]
        assert 0 <= extra <= 19 * 8 * (r["W"] - 1) * 2, r


def test_report_structure_and_fit(report):
    assert report["link"]["alpha"] >= 0 and report["link"]["beta"] > 0
    assert report["kernel_rate"]["fwd"] > 0 and report["kernel_rate"]["fwd+bwd"] > 0
    for r in report["measured"]:
        assert 0 <= r["comm_seconds"] <= r["seconds"] and r["compute_seconds"] >= 0
    for r in report["fit_check"]:
        assert r["predicted"] > 0 and math.isfinite(r["ratio"])
    preds = [p for p in report["predictions"] if p["seconds"] is not None]
    assert {p["link"] for p in preds} == set(bd.LINKS)
    assert {p["W"] for p in preds} == set(bd.PRED_RANKS)


def test_predictions_follow_the_formulas():
    a, b, rate = 5e-6, 25e9, 1e12
    for s in bd.STRATEGIES:  # longer sequences cost more; more ranks cost less compute each
        t = [bd.predict(s, 8, T, a, b, rate, backward=True)["seconds"] for T in bd.PRED_T]
        assert t == sorted(t)
        assert (bd.predict(s, 64, 2**20, a, b, rate)["compute"]
                < bd.predict(s, 8, 2**20, a, b, rate)["compute"])
    # the ring holds two shards, context parallel the whole K/V: at scale the ring needs less
    assert bd.memory_bytes("ring", 512, 2**20) < bd.memory_bytes("context", 512, 2**20)
    assert bd.fit_link([1000, 2000, 3000], [2e-6 + 1000 / 1e9, 2e-6 + 2000 / 1e9,
                                            2e-6 + 3000 / 1e9]) == pytest.approx((2e-6, 1e9))


def test_the_command_refuses_bad_ranks(capsys):
    with pytest.raises(SystemExit):
        bd.main(["--ranks", "1"])
    assert "--ranks" in capsys.readouterr().err
