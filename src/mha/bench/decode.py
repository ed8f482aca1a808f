"""The ``decode`` suite: one decoding step against a long K/V cache, and whole-model generation.

Shape legend: B batch, h / h_kv query / key-value heads, Tk cached tokens, d head dim,
P prompt length, N new tokens.

* ``step B1 h32 d128 Tk… fp32|bf16``: one query token (Tq = 1) against Tk cached tokens, in GB/s
  of K/V read (``2 * B * h_kv * Tk * d`` elements per step). Implementations, all on the same
  cached tensors (the storage of one :class:`mha.KVCache`, filled to capacity so the views are
  contiguous for SDPA's sake):

  - ``mha`` — ``mha.attention(q, cache.keys(), cache.values())``, i.e. dispatch → the
    ``flash_decode`` kernel (Python overhead included);
  - ``torch sdpa`` — ``F.scaled_dot_product_attention`` on the same tensors (the ratio
    column's baseline);
  - ``torch.cat + sdpa`` — the textbook loop's step: grow K and V by one token with
    ``torch.cat`` (copying the history), then SDPA;
  - ``onnxruntime GQA`` — ONNX Runtime's ``com.microsoft.GroupQueryAttention`` step with a
    past K/V cache appended in place (:func:`mha.bench.peers.ort_gqa_decode`), the peer the
    issue names as the best; fp16 in the bf16 rows (ORT has no bf16 CPU kernel), said in the
    row's note. Skipped with the reason when onnxruntime is not installed;
  - ``read K+V (torch.sum)`` and ``read K+V (AVX-512 stream)`` — ``torch.sum`` and a native
    four-accumulator AVX-512 read loop (``csrc/bench/stream_read.cpp``, one contiguous part per
    thread) over exactly the K/V bytes (viewed as fp32): the machine's streaming read
    bandwidth measured in the same interleaved rounds. The "% peak" column of every row of
    the case is its GB/s relative to the faster of the two.

* ``step B1 h32 d128 Tk… int8 vs bf16`` (and ``h9/3 d64``, SmolLM2's heads): the int8 K/V
  cache against the bf16 one, bf16 queries in both, in GB/s of the bytes each step actually
  reads (``bytes``: the bf16 K/V; the int8 row's own ``bytes``: int8 values plus the two fp32
  scales per token and K/V head). Implementations:

  - ``mha int8 K/V`` — :meth:`mha.KVCache.attend` on a ``kv_dtype="int8"`` cache: the decode
    kernel dequantizing in its loops (checked against SDPA on the dequantized K/V);
  - ``mha bf16 K/V`` — ``mha.attention`` on the bf16 cache's views (the ratio column's
    baseline: the int8 row's ratio is its speed over the bf16 step);
  - ``onnxruntime GQA`` — as above (fp16, no bf16 CPU kernel), and the two read rows over the
    bf16 K/V bytes, for "% peak".

* ``generate …``: greedy :meth:`mha.models.TinyDecoder.generate` (seeded random weights) in
  tokens/s: ``mha cache`` (preallocated, in place) against ``torch.cat + sdpa`` (the baseline:
  cache grown by concatenation, attention forced to SDPA) and ``torch.cat`` (same growth, mha's
  kernels: isolates the cost of copying the history). In fp32 all must produce the same
  tokens (else an error row); in bf16 the check column gives the share of equal tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mha.bench.core import Case, Context, Impl, Row, Skip

TITLE = "decoding: one step against a long K/V cache (GB/s) and whole-model generation (tokens/s)"
READ_SUM = "read K+V (torch.sum)"
READ_NATIVE = "read K+V (AVX-512 stream)"
READS = (READ_SUM, READ_NATIVE)



def _sum_read(storage):
    """A timed read of the K/V storage's bytes with ``torch.sum`` (``storage()`` -> (k, v))."""
    k, v = storage()
    kf, vf = k.view(torch.float32), v.view(torch.float32)  # the same bytes
    return lambda: (kf.sum(), vf.sum())


def _native_read(storage):
    """The same bytes read by the native AVX-512 stream loop (skipped when it cannot build)."""
    from mha.ops import build

    try:
        build.load("mha_stream_read", ("bench/stream_read.cpp",))
    except build.BuildError as e:
        raise Skip(f"native read probe not built: {e}") from e
    k, v = storage()
    kf, vf = k.view(torch.float32), v.view(torch.float32)  # the same bytes
    op = torch.ops.mha.stream_read
    return lambda: (op(kf), op(vf))

def _step_case(Tk: int, dtype: torch.dtype, ctx: Context, B: int = 1, h: int = 32,
               h_kv: int = 32, d: int = 128) -> Case:
    elt = torch.finfo(dtype).bits // 8
    kv_bytes = 2 * B * h_kv * Tk * d * elt
    shared: dict = {}

    def inputs():
        if "cache" not in shared:
            import mha

            # the cache, its storage, plus one transient copy for torch.cat
            if 2 * kv_bytes > ctx.mem_budget:
                raise Skip(f"would need {2 * kv_bytes / 2**30:.1f} GiB (budget "
                           f"{ctx.mem_budget / 2**30:.1f} GiB)")
            g = torch.Generator().manual_seed(0)
            cache = mha.KVCache(B, h_kv, Tk, d, dtype=dtype)
            for t in (cache.k, cache.v):  # fill in slices: no full-size fp32 temporary
                for i in range(0, Tk, 4096):
                    t[:, :, i:i + 4096] = torch.randn(B, h_kv, min(4096, Tk - i), d,
                                                      generator=g).to(dtype)
            cache.lengths.fill_(Tk)
            q = torch.randn(B, h, 1, d, generator=g).to(dtype)  # (B, h, 1, d)
            with torch.no_grad():
                k, v = cache.keys(), cache.values()  # (B, h_kv, Tk, d) views
                ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                     enable_gqa=h_kv != h)
            shared.update(cache=cache, q=q, ref=ref)
        return shared["cache"], shared["q"], shared["ref"]

    def checked(fn, ref):
        out = fn()
        out = fn.result() if hasattr(fn, "result") else out
        err = (out.float() - ref).abs().max().item()
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        if not err <= tol:
            raise RuntimeError(f"output differs from SDPA fp32: max error {err:.2e} > {tol}")
        fn.check = f"max |out - SDPA fp32| = {err:.1e}"
        return fn

    def make_mha():
        import mha

        cache, q, ref = inputs()
        k, v = cache.keys(), cache.values()
        chosen = mha.explain(q, k, v).chosen
        if chosen != "flash_decode":
            why = {vd.backend: vd.reasons for vd in mha.explain(q, k, v)}["flash_decode"]
            raise Skip(f"flash_decode not chosen ({chosen} is): {'; '.join(why)}")
        return checked(lambda: mha.attention(q, k, v), ref)

    def make_sdpa():
        cache, q, ref = inputs()
        k, v = cache.keys(), cache.values()
        return checked(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=h_kv != h),
                       ref)

    def make_cat():
        cache, q, ref = inputs()
        k_hist, v_hist = cache.k[:, :, :Tk - 1], cache.v[:, :, :Tk - 1]  # (B, h_kv, Tk-1, d)
        k_new, v_new = cache.k[:, :, Tk - 1:], cache.v[:, :, Tk - 1:]  # (B, h_kv, 1, d)

        def step():
            k = torch.cat([k_hist, k_new], dim=2)  # (B, h_kv, Tk, d): copies the history
            v = torch.cat([v_hist, v_new], dim=2)
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=h_kv != h)

        return checked(step, ref)

    def make_ort():
        from mha.bench import peers

        cache, q, ref = inputs()
        if 3 * kv_bytes > ctx.mem_budget:  # the cache, the cat copy, and ORT's own copy
            raise Skip(f"would need {3 * kv_bytes / 2**30:.1f} GiB (budget "
                       f"{ctx.mem_budget / 2**30:.1f} GiB)")
        fn = checked(peers.ort_gqa_decode(q, cache.keys(), cache.values()), ref)
        if dtype == torch.bfloat16:
            fn.note = ("ORT's fp16 step (no bf16 CPU kernel) — the issue's bf16 target is "
                       "stated against it")
        return fn

    def storage():
        cache = inputs()[0]
        return cache.k, cache.v

    def make_read():
        return _sum_read(storage)

    def make_native_read():
        return _native_read(storage)

    name = f"step B{B} h{h} d{d} Tk{Tk} {str(dtype).replace('torch.', '')}"
    if h_kv != h:
        name = name.replace(f"h{h}", f"h{h}/{h_kv}")
    return Case(name=name, impls=[Impl("mha", make_mha), Impl("torch sdpa", make_sdpa),
                                  Impl("torch.cat + sdpa", make_cat),
                                  Impl("onnxruntime GQA", make_ort), Impl(READ_SUM, make_read),
                                  Impl(READ_NATIVE, make_native_read)],
                bytes=kv_bytes, metric="gbs", baseline="torch sdpa",
                params=dict(B=B, h=h, h_kv=h_kv, Tq=1, Tk=Tk, d=d, dtype=str(dtype)),
                note="% peak = GB/s relative to the faster read row", teardown=shared.clear)


INT8 = "mha int8 K/V"
BF16 = "mha bf16 K/V"


def _int8_case(Tk: int, ctx: Context, B: int = 1, h: int = 32, h_kv: int = 32,
               d: int = 128) -> Case:
    """int8 vs bf16 K/V (bf16 queries), bytes per row: see the module docstring."""
    bf16_bytes = 2 * B * h_kv * Tk * d * 2
    int8_bytes = 2 * B * h_kv * Tk * (d + 4)  # int8 K and V, fp32 k_scale and v_scale
    shared: dict = {}

    def inputs():
        if "bf16" not in shared:
            import mha

            if 2 * bf16_bytes + int8_bytes > ctx.mem_budget:  # both caches, ORT's copy
                raise Skip(f"would need {(2 * bf16_bytes + int8_bytes) / 2**30:.1f} GiB (budget "
                           f"{ctx.mem_budget / 2**30:.1f} GiB)")
            g = torch.Generator().manual_seed(0)
            c16 = mha.KVCache(B, h_kv, Tk, d, dtype=torch.bfloat16)
            c8 = mha.KVCache(B, h_kv, Tk, d, dtype=torch.bfloat16, kv_dtype="int8")
            with torch.no_grad():
                for i in range(0, Tk, 4096):  # in slices: no full-size fp32 temporary
                    n = min(4096, Tk - i)
                    k, v = (torch.randn(B, h_kv, n, d, generator=g).bfloat16() for _ in range(2))
                    c16.append(k, v)  # (B, h_kv, n, d) each
                    c8.append(k, v)
            q = torch.randn(B, h, 1, d, generator=g).bfloat16()  # (B, h, 1, d)
            shared.update(bf16=c16, int8=c8, q=q)
        return shared["bf16"], shared["int8"], shared["q"]

    def checked(fn, k, v, what):
        _, _, q = inputs()
        out = fn()
        out = fn.result() if hasattr(fn, "result") else out
        with torch.no_grad():
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                 enable_gqa=h_kv != h)
        err = (out.float() - ref).abs().max().item()
        if not err <= 3e-2:
            raise RuntimeError(f"output differs from SDPA fp32 on {what}: max error {err:.2e}")
        fn.check = f"max |out - SDPA fp32 on {what}| = {err:.1e}"
        return fn

    def make_int8():
        _, c8, q = inputs()

        def step():
            with torch.no_grad():
                return c8.attend(q)
        return checked(step, c8.keys(), c8.values(), "the dequantized K/V")

    def make_bf16():
        import mha

        c16, _, q = inputs()
        k, v = c16.keys(), c16.values()  # (B, h_kv, Tk, d) views
        return checked(lambda: mha.attention(q, k, v), k, v, "the bf16 K/V")

    def make_ort():
        from mha.bench import peers

        c16, _, q = inputs()
        fn = peers.ort_gqa_decode(q, c16.keys(), c16.values())
        fn = checked(fn, c16.keys(), c16.values(), "the bf16 K/V")
        fn.note = "ORT's fp16 step (no bf16 CPU kernel), reading the bf16 row's bytes"
        return fn

    def storage():
        c16 = inputs()[0]
        return c16.k, c16.v

    def make_read():
        return _sum_read(storage)

    def make_native_read():
        return _native_read(storage)

    heads = f"h{h}" if h_kv == h else f"h{h}/{h_kv}"
    return Case(name=f"step B{B} {heads} d{d} Tk{Tk} int8 vs bf16",
                impls=[Impl(INT8, make_int8), Impl(BF16, make_bf16),
                       Impl("onnxruntime GQA", make_ort), Impl(READ_SUM, make_read),
                       Impl(READ_NATIVE, make_native_read)],
                bytes=bf16_bytes, metric="gbs", baseline=BF16,
                params=dict(B=B, h=h, h_kv=h_kv, Tq=1, Tk=Tk, d=d, dtype="bfloat16",
                            kv="int8 vs bf16", int8_bytes=int8_bytes),
                note="GB/s of the bytes each row reads (int8: values + scales); "
                     "% peak = GB/s relative to the faster read row", teardown=shared.clear)


def int8_bytes_read(rows: list[Row]) -> None:
    """The int8 rows read their own bytes (int8 values + scales), not the case's bf16 bytes."""
    for r in rows:
        if r.impl == INT8 and "int8_bytes" in r.params:
            r.bytes = r.params["int8_bytes"]


def _generate_case(label: str, cfg: dict, B: int, P: int, N: int,
                   dtype: torch.dtype = torch.float32) -> Case:
    shared: dict = {}

    def model_and_prompt():
        if "model" not in shared:
            from mha.models import TinyDecoder

            m = TinyDecoder(**cfg, max_len=P + N, seed=0, dtype=dtype).eval()
            idx = torch.randint(0, cfg["vocab_size"], (B, P),
                                generator=torch.Generator().manual_seed(1))
            shared.update(model=m, idx=idx)
        return shared["model"], shared["idx"]

    def make(cache: str, backend: str | None):
        def mk():
            m, idx = model_and_prompt()

            def run():
                return m.generate(idx, N, cache=cache, backend=backend)

            out = run()
            if "tokens" not in shared:
                shared["tokens"] = out
                run.check = "reference tokens for the other rows"
                return run
            same = (out[:, P:] == shared["tokens"][:, P:]).float().mean().item()
            if dtype == torch.float32 and same < 1.0:
                raise RuntimeError(f"greedy tokens differ from mha cache's ({100 * same:.0f}% "
                                   "equal)")
            # bf16: different kernels round differently, so near-ties may flip a greedy pick
            run.check = f"{100 * same:.0f}% of new tokens equal to mha cache's"
            return run
        return mk

    impls = [Impl("mha cache", make("mha", None)),
             Impl("torch.cat + sdpa", make("concat", "sdpa")),
             Impl("torch.cat", make("concat", None))]
    return Case(name=f"generate {label} B{B} P{P}+{N} {str(dtype).replace('torch.', '')}",
                impls=impls, items=B * N, item_unit="tokens", metric="items",
                baseline="torch.cat + sdpa", params=dict(model=label, B=B, prompt=P,
                                                         new_tokens=N, **cfg),
                note="TinyDecoder, random seeded weights, greedy", teardown=shared.clear)


def all_cases(ctx: Context) -> list[Case]:
    """Every case of the suite (quick: a small grid)."""
    lengths = (512, 4096) if ctx.quick else (512, 1024, 2048, 4096, 8192, 16384, 32768)
    out = [_step_case(Tk, dt, ctx) for dt in (torch.float32, torch.bfloat16) for Tk in lengths]
    if ctx.quick:
        out.append(_step_case(4096, torch.bfloat16, ctx, h_kv=8))
        out.append(_int8_case(4096, ctx))
        small = dict(vocab_size=512, d_model=128, n_layers=2, num_heads=4)
        out.append(_generate_case("2x128", small, B=1, P=64, N=16))
    else:
        out.append(_step_case(4096, torch.float32, ctx, h_kv=8))
        out.append(_step_case(4096, torch.bfloat16, ctx, h_kv=8))
        out += [_int8_case(Tk, ctx) for Tk in (4096, 8192, 16384, 32768)]
        out.append(_int8_case(8192, ctx, h=9, h_kv=3, d=64))  # SmolLM2-135M's attention
        mid = dict(vocab_size=1024, d_model=512, n_layers=4, num_heads=8)
        wide = dict(vocab_size=1024, d_model=1024, n_layers=2, num_heads=16)
        out += [_generate_case("4x512", mid, B=1, P=512, N=64),
                _generate_case("2x1024", wide, B=1, P=2048, N=32),
                _generate_case("2x1024", wide, B=1, P=2048, N=32, dtype=torch.bfloat16)]
    return out


def relative_to_read(rows: list[Row]) -> None:
    """Set ``pct_peak`` of every row of a step case to its GB/s over the faster read row's
    (the streaming read of the same bytes, timed in the same rounds)."""
    by_case: dict[str, list[Row]] = {}
    for r in rows:
        by_case.setdefault(r.case, []).append(r)
    for rs in by_case.values():
        reads = [r for r in rs if r.impl in READS and r.ok and r.gbs]
        if not reads:
            continue
        best = max(reads, key=lambda r: r.gbs)
        for r in rs:
            if r.ok and r.gbs:
                r.peak = f"{best.impl} in this case"
                r.pct_peak = 100.0 * r.gbs / best.gbs


def run(ctx: Context) -> list[Row]:
    """Measure every selected case; step rows get % of the read bandwidth measured beside them."""
    rows: list[Row] = []
    for case in all_cases(ctx):
        if not ctx.selected(case.name):
            continue
        got = ctx.measure(case, suite="decode")
        if case.metric == "gbs":
            int8_bytes_read(got)
            relative_to_read(got)
        rows += got
        if ctx.on_row is not None:
            for r in got:
                ctx.on_row(r)
    return rows


__all__ = ["TITLE", "READS", "all_cases", "int8_bytes_read", "run", "relative_to_read"]
