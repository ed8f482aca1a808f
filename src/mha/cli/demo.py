"""``mha demo``: the seeds' configuration (seed 004: B=32, T=20, d_model=512, h=8) end to end.

Prints the flow with shapes recorded from the run, checks that the seed-000 per-head loop, the
fused module and torch.nn.MultiheadAttention agree, and times the backends side by side.
"""

from __future__ import annotations

import argparse

from mha.cli.options import UsageError, check_fits, int_between, positive_int

MAX_REPEAT = 10_000  #: timed calls per backend at most (10^9 ran for ever)


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="the seeds' configuration end to end: shapes, agreement, timing")
    p.add_argument("--batch", "-B", type=positive_int, default=32, help="B (default 32)")
    p.add_argument("--seq", "-T", type=positive_int, default=20, help="T (default 20)")
    p.add_argument("--d-model", type=positive_int, default=512, help="d_model (default 512)")
    p.add_argument("--heads", type=positive_int, default=8,
                   help="h, must divide d_model (default 8)")
    p.add_argument("--repeat", type=int_between(1, MAX_REPEAT), default=20,
                   help=f"timed calls per backend (default 20, at most {MAX_REPEAT:,})")
    p.set_defaults(func=run)


def check(args: argparse.Namespace) -> None:
    """Refuse, before any work, what the demo cannot run."""
    B, T, D, H = args.batch, args.seq, args.d_model, args.heads
    if D % H:
        raise UsageError(f"--heads must divide --d-model ({D}), got {H}")
    # Lower bound, fp32: the weights (4 D^2), x and the module's output (B T D each), q, k, v
    # of the timing (3 B T D), and the per-head loop's weights, kept for every head in fp64.
    check_fits(4 * (4 * D * D + 5 * B * T * D) + 8 * B * H * T * T,
               f"B={B}, T={T}, d_model={D}, h={H}")


def run(args: argparse.Namespace) -> int:
    check(args)
    import time

    import torch
    from rich.console import Console
    from rich.table import Table

    import mha
    from mha.backends import all_backends
    from mha.cli.shapes import record

    con = Console()
    B, T, D, H = args.batch, args.seq, args.d_model, args.heads
    con.print(f"[bold]mha demo[/bold]: B={B}, T={T}, d_model={D}, h={H}, d_k=d_v={D // H}")
    ns = argparse.Namespace(batch=B, seq=T, kv_seq=None, d_model=D, heads=H, kv_heads=None,
                            d_k=None, d_v=None, causal=False)
    con.print(record(ns).table())

    torch.manual_seed(0)
    m = mha.MultiHeadAttention(D, H).eval()
    x = torch.randn(B, T, D)
    with torch.no_grad():
        fused = m(x)
        w = m.per_head_weights()
        ref, _ = mha.reference.multi_head_attention(x, x, upcast=True, **w)
        tm = m.to_torch()
        theirs = tm(x, x, x, need_weights=False)[0]
    agree = Table(title="Agreement (max |difference| in fp32, against the fp64 per-head loop)")
    agree.add_column("path")
    agree.add_column("max |Δ| vs seed-000 loop (fp64)")
    rows = [("fused module (mha.MultiHeadAttention)", fused),
            ("torch.nn.MultiheadAttention (same weights)", theirs)]
    ok = True
    for name, y in rows:
        err = (y.double() - ref.double()).abs().max().item()
        ok &= err < 1e-4
        agree.add_row(name, f"{err:.2e}")
    con.print(agree)

    q = torch.randn(B, H, T, D // H)
    k, v = torch.randn_like(q), torch.randn_like(q)
    timing = Table(title=f"attention core, q/k/v ({B}, {H}, {T}, {D // H}) fp32, "
                   f"median of {args.repeat} calls")
    for col in ("backend", "ms", "vs fastest"):
        timing.add_column(col)
    results = {}
    with torch.no_grad():
        for b in all_backends():
            call = mha.functional.make_call(q, k, v)
            if b.not_supported_reasons(call):
                continue
            b.forward(call)  # warm-up
            ts = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                b.forward(call)
                ts.append(time.perf_counter() - t0)
            results[b.name] = sorted(ts)[len(ts) // 2] * 1e3
    best = min(results.values())
    for name, ms in sorted(results.items(), key=lambda kv: kv[1]):
        timing.add_row(name, f"{ms:.3f}", f"{ms / best:.2f}x")
    con.print(timing)
    con.print(_module_timing(m, tm, x, args.repeat))
    con.print("[green]all paths agree[/green]" if ok else "[red]paths DISAGREE[/red]")
    return 0 if ok else 1


def _module_timing(m, tm, x, repeat: int):
    """The whole module (projections, attention, W_O) against torch.nn.MultiheadAttention with
    the same weights: calls interleaved, medians."""
    import time

    import torch
    from rich.table import Table

    from mha.linear import why_not_native

    calls = {"mha.MultiHeadAttention": lambda: m(x),
             "torch.nn.MultiheadAttention": lambda: tm(x, x, x, need_weights=False)}
    times: dict[str, list[float]] = {name: [] for name in calls}
    with torch.no_grad():
        for f in calls.values():
            f()  # warm-up
        for _ in range(repeat):
            for name, f in calls.items():
                t0 = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - t0)
        reason = why_not_native(x, m.in_proj.weight, m.in_proj.bias)
    B, T, D = x.shape
    table = Table(title=f"whole module, x ({B}, {T}, {D}) fp32, median of {repeat} calls "
                        f"(projections: {'mha.linear' if reason is None else 'F.linear: ' + reason})")
    for col in ("module", "ms", "vs fastest"):
        table.add_column(col)
    med = {name: sorted(ts)[len(ts) // 2] * 1e3 for name, ts in times.items()}
    best = min(med.values())
    for name, ms in sorted(med.items(), key=lambda kv: kv[1]):
        table.add_row(name, f"{ms:.3f}", f"{ms / best:.2f}x")
    return table
