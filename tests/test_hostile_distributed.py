"""``mha.distributed`` handed the wrong things: a mesh or group of the wrong kind, a module
tensor parallelism cannot split, and the conversions (``to_torch``, ``mha.io.save``) of a module
that holds only this rank's heads. Each is refused at the boundary naming the argument, and a
refused split leaves the module as it was.

Two gloo processes (``mp.spawn``) where a split needs them, one (world size 1) otherwise.
Shape legend: B batch, T length, d_model width, h heads.
"""

from __future__ import annotations

import datetime
import json

import pytest
import torch
import torch.multiprocessing as mp

import mha

W = 2


def _init(rank: int, world: int, init_file: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))


def _outcome(fn) -> str:
    """``"ok"`` or ``"<exception type>: <message>"``."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 -- the test compares what was raised
        return f"{type(e).__name__}: {e}"
    return "ok"


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from mha import distributed as D
    from mha import io

    _init(rank, W, init_file)
    got = {}
    try:
        mesh = init_device_mesh("cpu", (W,))
        for option in ("sinks", "alibi"):
            torch.manual_seed(0)
            m = mha.MultiHeadAttention(32, 4, **{option: True})
            before = {k: v.clone() for k, v in m.state_dict().items()}
            got[f"split {option}"] = _outcome(lambda m=m: D.tensor_parallel(m, mesh))
            got[f"unchanged {option}"] = (m.tensor_parallel == 1 and m.num_heads == 4 and all(
                type(v) is torch.Tensor and torch.equal(v, before[k])
                for k, v in m.state_dict().items()))
        torch.manual_seed(0)
        m = D.tensor_parallel(mha.MultiHeadAttention(32, 4, head_dim=16), mesh)
        got["to_torch"] = _outcome(m.to_torch)
        got["io.save"] = _outcome(lambda: io.save(m, f"{out_dir}/rank{rank}.safetensors"))
    finally:
        dist.destroy_process_group()
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(got, f)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    mp.spawn(_worker, args=(str(out / "rendezvous"), str(out)), nprocs=W, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(W)], out


@pytest.mark.parametrize("option", ["sinks", "alibi"])
def test_a_split_of_a_module_it_cannot_serve_is_refused_unchanged(two_ranks, option):
    """Split, such a module refused every call afterwards; now the split itself is refused,
    before the weights are reordered or become DTensors."""
    views, _ = two_ranks
    for got in views:
        assert got[f"split {option}"].startswith(f"ValueError: module has {option}"), got
        assert got[f"unchanged {option}"] is True


def test_a_split_module_is_not_converted_or_saved_as_a_whole(two_ranks):
    views, out = two_ranks
    for got in views:
        assert got["to_torch"].startswith("ValueError: to_torch: the module is split over 2 "
                                          "ranks"), got
        assert got["io.save"].startswith("ValueError: m is split over 2 ranks"), got
    assert not list(out.glob("*.safetensors"))


def _one_rank(init_file: str, fn) -> str:
    import torch.distributed as dist

    _init(0, 1, init_file)
    try:
        return _outcome(fn)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mesh", [None, 2, "cpu"])
def test_device_mesh_of_the_wrong_kind_is_named(tmp_path, mesh):
    from mha import distributed as D

    m = mha.MultiHeadAttention(32, 4)
    got = _one_rank(str(tmp_path / "rdv"), lambda: D.tensor_parallel(m, mesh))
    assert got.startswith("TypeError: device_mesh must be a torch.distributed.device_mesh"
                          ".DeviceMesh"), got


@pytest.mark.parametrize("fn", ["ring_attention", "context_parallel_attention",
                                "ulysses_attention"])
def test_group_of_the_wrong_kind_is_named(tmp_path, fn):
    from mha import distributed as D

    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    got = _one_rank(str(tmp_path / "rdv"), lambda: getattr(D, fn)(q, k, v, group="world"))
    assert got.startswith("TypeError: group must be None"), got


@pytest.mark.parametrize("fn", ["ring_attention", "context_parallel_attention",
                                "ulysses_attention"])
def test_world_size_one_is_plain_attention(tmp_path, fn):
    from mha import distributed as D

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g),
               torch.randn(2, 2, 6, 8, generator=g))  # (B, h, T, d), (B, h_kv, T, d)
    got = {}
    _one_rank(str(tmp_path / "rdv"), lambda: got.update(
        out=getattr(D, fn)(q, k, v, causal=True, window=3)))
    torch.testing.assert_close(got["out"], mha.attention(q, k, v, causal=True, window=3),
                               rtol=1e-5, atol=1e-5)
