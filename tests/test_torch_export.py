"""torch.export of mha modules with a dynamic batch and sequence length (mha.programs).

Shape legend: B batch, T / Tq / Tk lengths, P cached positions, d_model width.
Each program is traced at one size with B in [1, 64] and T in [1, 4096], and must keep that
whole range (torch narrows it when dispatch guards on a size threshold), hold mha's native
op, and equal the eager module (float32, 1e-5) at sizes not used for tracing: small (T = 1,
5, 16, 17: either side of the decode kernel's Tq <= 16) and long (T >= 600: past the
portable loops' Tk >= 512 threshold).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import zipfile

import pytest
import torch
from torch.export import Dim, export

import mha
import mha.models
from mha import programs
from mha.export import CrossAttention, DecodeStep, SelfAttention

T_MAX = 4096
FLASH = "mha.flash_attention_fwd.default"
LINEAR = "mha.linear.default"  # the projections on mha's tiles, where measured faster here


def _dims():
    return Dim("B", min=1, max=64), Dim("T", min=1, max=T_MAX)


def _mha_ops(ep) -> set[str]:
    """The mha ops the program calls (strict export wraps the projections' autograd function
    in submodules)."""
    return {str(n.target) for _, g in ep.graph_module.named_modules() if hasattr(g, "graph")
            for n in g.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("mha.")}


def _native(ep) -> bool:
    """The program's attention is mha's flash op (no SDPA); its projections are mha's tiles or
    torch's GEMM, as measured on this CPU (test_projections_follow_the_measured_side)."""
    ops = _mha_ops(ep)
    return FLASH in ops and ops <= {FLASH, LINEAR} and not _aten_sdpa(ep)


def _aten_sdpa(ep) -> bool:
    return any("scaled_dot_product" in str(n.target) for n in ep.graph.nodes)


def _range(ep, arg: int, dim: int) -> tuple[int, int]:
    """The range the program accepts for size ``dim`` of user input ``arg``."""
    inputs = [n for n in ep.graph.nodes if n.op == "placeholder"
              and n.name in ep.graph_signature.user_inputs]
    size = inputs[arg].meta["val"].shape[dim]
    vr = ep.range_constraints[size.node.expr]
    return int(vr.lower), int(vr.upper)


def _close(model, ep, args, what):
    with torch.no_grad():
        want, got = model(*args), ep.module()(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


def _keep(B, T, seed):
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(B, T, generator=g) > 0.3
    keep[:, 0] = True  # (B, T): at least one real key per row
    return keep


@pytest.mark.parametrize("causal", [False, True])
def test_self_attention_gqa_key_padding(causal):
    torch.manual_seed(0)
    m = mha.MultiHeadAttention(64, 4, num_kv_heads=2, v_head_dim=24).eval()  # d_v != d_k
    model = SelfAttention(m, causal=causal, key_padding=True)
    B, T = _dims()
    ep = export(model, (torch.randn(2, 33, 64), _keep(2, 33, 0)),
                dynamic_shapes=({0: B, 1: T}, {0: B, 1: T}))
    assert _range(ep, 0, 1) == (1, T_MAX) and _range(ep, 0, 0) == (1, 64)
    assert _native(ep)
    for b, t in ((1, 1), (3, 5), (2, 16), (2, 17), (1, 600)):
        _close(model, ep, (torch.randn(b, t, 64), _keep(b, t, t)), f"causal={causal} B={b} T={t}")


def test_cross_attention_tq_differs_from_tk():
    torch.manual_seed(1)
    m = mha.MultiHeadAttention(64, 4, v_head_dim=32, kdim=48, vdim=40).eval()
    model = CrossAttention(m, key_padding=True)
    B, Tq = _dims()
    Tk = Dim("Tk", min=1, max=T_MAX)
    ep = export(model, (torch.randn(2, 9, 64), torch.randn(2, 33, 48), torch.randn(2, 33, 40),
                        _keep(2, 33, 0)),
                dynamic_shapes=({0: B, 1: Tq}, {0: B, 1: Tk}, {0: B, 1: Tk}, {0: B, 1: Tk}))
    assert _range(ep, 0, 1) == (1, T_MAX) and _range(ep, 1, 1) == (1, T_MAX)
    assert _native(ep)
    for b, tq, tk in ((1, 1, 5), (2, 650, 3), (2, 20, 900)):
        args = (torch.randn(b, tq, 64), torch.randn(b, tk, 48), torch.randn(b, tk, 40),
                _keep(b, tk, tk))
        _close(model, ep, args, f"Tq={tq} Tk={tk}")


@pytest.mark.parametrize("strict", [False, True])  # strict: traced by dynamo
def test_alibi_sinks_and_window(strict):
    torch.manual_seed(2)
    m = mha.MultiHeadAttention(64, 4, alibi=True, sinks=True).eval()
    with torch.no_grad():
        m.sinks.normal_()

    class Windowed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m(x, causal=True, window=24)  # (B, T, d_model)

    model = Windowed()
    B, T = _dims()
    ep = export(model, (torch.randn(2, 33, 64),), dynamic_shapes=({0: B, 1: T},), strict=strict)
    assert _range(ep, 0, 1) == (1, T_MAX) and _native(ep)
    for b, t in ((1, 1), (2, 7), (2, 30), (1, 640)):  # window past T and within it
        _close(model, ep, (torch.randn(b, t, 64),), f"T={t}")


def test_bfloat16():
    """bf16: the flash op in bf16, the projections on mha's bf16 tiles where measured faster
    (mha.linear_bf16); compared with eager at bf16's rounding."""
    torch.manual_seed(5)
    m = mha.MultiHeadAttention(64, 4, num_kv_heads=2).eval().to(torch.bfloat16)
    model = SelfAttention(m, causal=True)
    B, T = _dims()
    ep = export(model, (torch.randn(2, 33, 64, dtype=torch.bfloat16),),
                dynamic_shapes=({0: B, 1: T},))
    assert _range(ep, 0, 1) == (1, T_MAX)
    assert FLASH in _mha_ops(ep) and _mha_ops(ep) <= {FLASH, "mha.linear_bf16.default"}
    for b, t in ((1, 1), (2, 9), (1, 700)):
        x = torch.randn(b, t, 64, dtype=torch.bfloat16)  # (B, T, d_model)
        with torch.no_grad():
            torch.testing.assert_close(ep.module()(x), model(x), rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("strict", [False, True])
def test_tiny_decoder(strict):
    d = mha.models.TinyDecoder(97, 64, 2, 4, num_kv_heads=2, max_len=T_MAX).eval()
    B, T = _dims()
    ep = export(d, (torch.randint(0, 97, (2, 33)),), dynamic_shapes=({0: B, 1: T},),
                strict=strict)
    assert _range(ep, 0, 1) == (1, T_MAX) and _native(ep)
    assert sum(str(n.target) == FLASH for n in ep.graph.nodes) == 2  # one per layer
    for b, t in ((1, 1), (3, 12), (2, 600)):
        _close(d, ep, (torch.randint(0, 97, (b, t)),), f"B={b} T={t}")


def test_decode_step_keeps_the_decode_kernel_under_no_grad():
    """One new token (static) against a dynamic past: exported for inference (no_grad), the
    program holds the decode kernel; traced with gradients on, the flash forward."""
    torch.manual_seed(3)
    model = DecodeStep(mha.MultiHeadAttention(64, 4, num_kv_heads=2).eval())
    B, P = Dim("B", min=1, max=8), Dim("P", min=1, max=T_MAX - 1)
    args = (torch.randn(2, 1, 64), torch.randn(2, 2, 20, 16), torch.randn(2, 2, 20, 16))
    shapes = ({0: B}, {0: B, 2: P}, {0: B, 2: P})
    with torch.no_grad():
        ep = export(model, args, dynamic_shapes=shapes)
    assert _mha_ops(ep) - {LINEAR} == {"mha.flash_decode.default"}
    assert _range(ep, 1, 2) == (1, T_MAX - 1)
    assert _native(export(model, args, dynamic_shapes=shapes))
    for p in (1, 900):
        step = (torch.randn(3, 1, 64), torch.randn(3, 2, p, 16), torch.randn(3, 2, p, 16))
        with torch.no_grad():
            for got, want in zip(ep.module()(*step), model(*step), strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_portable_cpu_keeps_the_native_op_over_the_whole_range(monkeypatch):
    """Where the kernel runs its portable loops (no AVX-512), eager dispatch leaves Tk >= 512
    to sdpa; an exported range across 512 keeps the native op rather than narrowing."""
    import mha.backends.flash_cpu as flash_cpu

    monkeypatch.setattr(flash_cpu, "_portable", lambda dtype: True)
    x = torch.randn(1, 600, 64)  # (B, T, d_model)
    q = torch.randn(1, 4, 600, 16)  # (B, h, T, d)
    assert mha.explain(q, q, q).chosen == "sdpa"  # eager: deferred
    model = SelfAttention(mha.MultiHeadAttention(64, 4).eval())
    B, T = _dims()
    ep = export(model, (torch.randn(2, 33, 64),), dynamic_shapes=({0: B, 1: T},))
    assert _range(ep, 0, 1) == (1, T_MAX) and _native(ep)
    _close(model, ep, (x,), "T=600 (eager: sdpa)")


@pytest.mark.parametrize("side", ["native", "torch"])
def test_projections_follow_the_measured_side(monkeypatch, side):
    """The projections' GEMM is chosen as in eager code (MHA_LINEAR or the measurement, taken
    at MIN_ROWS rows for a dynamic range): mha's tiles are mha.linear in the program."""
    from mha.ops import linear_choice

    monkeypatch.setattr(linear_choice, "forced", lambda: side)
    model = SelfAttention(mha.MultiHeadAttention(64, 4).eval(), causal=True)
    B, T = _dims()
    for strict in (False, True):
        ep = export(model, (torch.randn(2, 33, 64),), dynamic_shapes=({0: B, 1: T},),
                    strict=strict)
        assert _mha_ops(ep) == ({FLASH, LINEAR} if side == "native" else {FLASH}), strict
        for b, t in ((1, 1), (2, 600)):
            _close(model, ep, (torch.randn(b, t, 64),), f"{side} strict={strict} T={t}")


@pytest.mark.parametrize("strict", [False, True])
def test_a_first_measurement_during_export_times_real_gemms(tmp_path, monkeypatch, strict):
    """A projection class this machine never measured is measured while the program is traced:
    on real tensors, with no tracer mode active (timing the tracer's fake GEMMs would store a
    meaningless choice in the cache file)."""
    from torch._subclasses.fake_tensor import FakeTensor

    from mha.ops import linear_choice

    seen = []

    def measure(shape):
        t = torch.ones(2)
        seen.append((shape, isinstance(t, FakeTensor), torch._C._is_torch_function_mode_enabled()))
        return 1e-3, 2e-3, (2.0, 2.0)  # native twice as fast

    monkeypatch.setattr(linear_choice, "path", lambda: tmp_path / "choice.json")
    monkeypatch.setattr(linear_choice, "forced", lambda: None)
    monkeypatch.setattr(linear_choice, "_memo", {})
    monkeypatch.setattr(linear_choice, "measure", measure)
    model = SelfAttention(mha.MultiHeadAttention(64, 4).eval())
    B, T = _dims()
    ep = export(model, (torch.randn(2, 33, 64),), dynamic_shapes=({0: B, 1: T},), strict=strict)
    assert LINEAR in _mha_ops(ep)
    assert seen and all(shape[0] == linear_choice.MIN_ROWS for shape, _, _ in seen)
    assert not any(fake or mode for _, fake, mode in seen), seen


def test_compile_still_chooses_by_size():
    """Outside export the size rules are unchanged: a 5-query call goes to the decode
    kernel, a 40-query call to the flash forward."""
    q5, q40 = torch.randn(1, 4, 5, 32), torch.randn(1, 4, 40, 32)  # (B, h, Tq, d)
    k = torch.randn(1, 4, 40, 32)  # (B, h, Tk, d)
    assert mha.explain(q5, k, k).chosen == "flash_decode"
    assert mha.explain(q40, k, k).chosen == "flash_cpu"


# ----------------------------------------------------------------------------- save / load
def _saved(tmp_path):
    torch.manual_seed(4)
    m = mha.MultiHeadAttention(64, 4, alibi=True).eval()
    model = SelfAttention(m, causal=True)
    B, T = _dims()
    ep = export(model, (torch.randn(2, 33, 64),), dynamic_shapes=({0: B, 1: T},))
    return model, programs.save(ep, tmp_path / "sa.pt2")


def test_save_load_round_trip(tmp_path):
    model, path = _saved(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["sa.pt2"]  # no temporary file left
    ep = programs.load(path)
    assert _native(ep) and _range(ep, 0, 1) == (1, T_MAX)
    for b, t in ((1, 1), (2, 700)):
        _close(model, ep, (torch.randn(b, t, 64),), f"loaded, T={t}")


def test_load_in_a_fresh_process(tmp_path):
    """A new process has not loaded mha's ops: programs.load does it before torch looks the
    op up by name (torch.export.load alone fails there)."""
    model, path = _saved(tmp_path)
    x = torch.randn(2, 650, 64)  # (B, T, d_model)
    with torch.no_grad():
        torch.save({"x": x, "y": model(x)}, tmp_path / "ref.pt")
    code = ("import sys, torch\nfrom mha import programs\n"
            "ep = programs.load(sys.argv[1])\nr = torch.load(sys.argv[2])\n"
            "with torch.no_grad():\n"
            "    torch.testing.assert_close(ep.module()(r['x']), r['y'], rtol=1e-5, atol=1e-5)\n"
            "print('same')\n")
    run = subprocess.run([sys.executable, "-c", code, str(path), str(tmp_path / "ref.pt")],
                         capture_output=True, text=True, timeout=120, env=os.environ.copy())
    assert run.returncode == 0 and run.stdout.strip() == "same", run.stderr[-2000:]


_UNPICKLED = []


def _mark():
    _UNPICKLED.append(True)
    return {}


class _Payload:
    def __reduce__(self):
        return (_mark, ())


def _rewrite(path, out, change):
    """Copy the zip at ``path`` to ``out`` with ``change(relative name, bytes) -> bytes``."""
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            rel = info.filename.split("/", 1)[1]
            dst.writestr(info, change(rel, src.read(info.filename)))
    return out


def test_load_refuses_what_torch_would_unpickle(tmp_path):
    _, path = _saved(tmp_path)
    evil = pickle.dumps((_Payload(),), protocol=2)

    def inputs(rel, data):
        return evil if rel.startswith("data/sample_inputs/") else data

    with pytest.raises(ValueError, match="sample_inputs.*weights_only=True"):
        programs.load(_rewrite(path, tmp_path / "inputs.pt2", inputs))

    def pickled_weight(rel, data):
        if rel == "data/weights/model_weights_config.json":
            cfg = json.loads(data)
            next(iter(cfg["config"].values()))["use_pickle"] = True
            return json.dumps(cfg).encode()
        return data

    with pytest.raises(ValueError, match="as a pickle"):
        programs.load(_rewrite(path, tmp_path / "weights.pt2", pickled_weight))
    with zipfile.ZipFile(_rewrite(path, tmp_path / "obj.pt2", lambda r, d: d), "a") as z:
        z.writestr(z.namelist()[0].split("/")[0] + "/data/constants/custom_obj_0", evil)
    with pytest.raises(ValueError, match="custom_obj_0.*not loaded"):
        programs.load(tmp_path / "obj.pt2")
    assert _UNPICKLED == []  # nothing of the files was run
    (tmp_path / "text.pt2").write_text("not a zip")
    with pytest.raises(ValueError, match="not a torch.export archive"):
        programs.load(tmp_path / "text.pt2")
    with pytest.raises(ValueError, match="is a directory"):
        programs.save(programs.load(path), tmp_path)
    with pytest.raises(TypeError, match="program must be a torch.export.ExportedProgram"):
        programs.save(object(), tmp_path / "x.pt2")


def test_torch_load_would_have_unpickled_it(tmp_path):
    """The refusal above is needed: torch.export.load itself falls back to full unpickling
    of sample inputs that weights_only refuses (this test fails once torch stops doing so)."""
    _, path = _saved(tmp_path)
    evil = pickle.dumps((_Payload(),), protocol=2)
    bad = _rewrite(path, tmp_path / "inputs.pt2",
                   lambda rel, d: evil if rel.startswith("data/sample_inputs/") else d)
    try:
        torch.export.load(io.BytesIO(bad.read_bytes()))
    except Exception:
        pass
    assert _UNPICKLED, "torch.export.load no longer unpickles refused sample inputs"
    _UNPICKLED.clear()


# ----------------------------------------------------------------------------- refusals
class _Call(torch.nn.Module):
    def __init__(self, m, **kw):
        super().__init__()
        self.m, self.kw = m, kw

    def forward(self, x):
        return self.m(x, **self.kw)


def test_refusals_name_the_argument_and_change_nothing():
    m = mha.MultiHeadAttention(64, 4).eval()
    x = torch.randn(2, 33, 64)  # (B, T, d_model)
    B, T = _dims()
    dyn = ({0: B, 1: T},)
    cache = m.new_cache(2, 64)
    with torch.no_grad(), pytest.raises(ValueError, match="cache: torch.export cannot carry"):
        export(_Call(m, cache=cache), (torch.randn(2, 1, 64),))
    assert cache.lengths.tolist() == [0, 0]  # nothing appended
    for name, kw in (("mask_mod", dict(mask_mod=mha.mods.causal)),
                     ("score_mod", dict(score_mod=lambda s, b, h, q, k: s * 0.5))):
        with pytest.raises(ValueError, match=f"{name}: torch.export cannot carry"):
            export(_Call(m, **kw), (x,), dynamic_shapes=dyn)

    class Packed(torch.nn.Module):
        def forward(self, x, cu):
            return m(x, cu_seqlens=cu, causal=True)

    with pytest.raises(ValueError, match="cu_seqlens: torch.export cannot carry"):
        export(Packed(), (torch.randn(1, 30, 64), torch.tensor([0, 10, 30])))
    with torch.no_grad(), pytest.raises(mha.BackendError,
                                        match=r"Tq \(a range under torch.export\) may exceed 16"):
        export(_Call(m, backend="flash_decode"), (x,), dynamic_shapes=dyn)
    torch.testing.assert_close(m(x), m(x))  # the module still runs eagerly


def test_strict_export_refuses_with_the_message():
    """Under strict=True dynamo wraps an error raised while tracing in its own Unsupported;
    mha's message is carried in it."""
    m = mha.MultiHeadAttention(64, 4).eval()
    B, T = _dims()
    for kw, words in ((dict(mask_mod=mha.mods.causal), "mask_mod: torch.export cannot carry"),
                      (dict(backend="flash_decode"), r"backend='flash_decode' cannot serve")):
        with pytest.raises(Exception, match=words):
            export(_Call(m, **kw), (torch.randn(2, 33, 64),), dynamic_shapes=({0: B, 1: T},),
                   strict=True)
