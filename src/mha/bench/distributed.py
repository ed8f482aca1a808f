"""The distributed strategies measured on loopback, and an α-β model that predicts them at scale.

``python -m mha.bench.distributed [--quick] [--ranks 2 4] [--out benchmarks/results]``

Shape legend: W ranks, T sequence length, h / h_kv heads, d head dim, B = 1.

1. **Measured** (gloo, W processes on this machine, one thread each): per strategy
   (context parallel, ring, Ulysses; zig-zag layout, causal) one forward and one
   forward+backward step; every collective mha issues is wrapped while the step runs
   (``torch.distributed`` functions, and the ``wait`` of the asynchronous ones), so the step's
   bytes sent and the time spent in communication are measured, compute = step − communication.
2. **Fitted**: the link by a ping-pong sweep between ranks 0 and 1 (message sizes 4 KiB …
   16 MiB; least squares ``t = α + bytes / β``), and the kernel rate by timing
   ``mha.attention`` forward and forward+backward on one process (FLOP/s).
3. **Predicted** per rank: time per step and memory for W = 8 … 1,024 and T = 32k … 1M on
   stated interconnects (25 and 100 GB/s, α = 5 µs), from the FLOPs and bytes each strategy
   moves (formulas in :func:`predict`), and the same formulas at the measured points
   (``fit_check``: predicted / measured).

Writes ``distributed-<cpu kind>.json`` and ``.png`` (the predictions, with the loopback
measurements on them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from mha.threads import num_threads

STRATEGIES = ("context", "ring", "ulysses")
LINKS = {"25 GB/s": (5e-6, 25e9), "100 GB/s": (5e-6, 100e9)}  # (α seconds, β bytes/s)
PRED_RANKS = (8, 32, 128, 512, 1024)
PRED_T = (32_768, 131_072, 1_048_576)
H, H_KV, HD = 8, 8, 64  # heads of the measured and predicted problem (Ulysses needs h % W == 0)
ELEM = 4  # fp32 bytes


# ----------------------------------------------------------------------------- the model
def attention_flops(T: int, causal: bool = True, backward: bool = False) -> float:
    """Multiply-adds x 2 of attention over the full sequence (B = 1): QK^T and PV, halved by
    causal; the backward does 2.5x the forward's products (five products against two)."""
    f = 4.0 * H * T * T * HD * (0.5 if causal else 1.0)
    return f * (3.5 if backward else 1.0)


def comm_bytes(strategy: str, W: int, T: int, backward: bool = False) -> float:
    """Bytes of K/V, Q, outputs and gradients one rank sends per step (the arguments'
    agreement exchange, 152 bytes per peer, not counted)."""
    kv = 2 * T * H_KV * HD * ELEM  # the whole K and V
    if strategy == "context":  # all-gather K/V (ring algorithm: (W-1)/W of it); backward
        fwd = (W - 1) / W * kv  # all-reduces the full K/V gradients (2 (W-1)/W of them)
        return fwd + (2 * (W - 1) / W * kv if backward else 0.0)
    if strategy == "ring":  # W - 1 K/V shards forward; backward: W - 1 shards + W dK/dV
        fwd = (W - 1) * kv / W
        return fwd + ((W - 1) * kv / W + W * kv / W if backward else 0.0)
    if strategy == "ulysses":  # all-to-all q, k, v and out: (W-1)/W of each shard
        shard = T / W * HD * ELEM * (2 * H + 2 * H_KV)
        return (W - 1) / W * shard * (2 if backward else 1)
    raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")


def messages(strategy: str, W: int, backward: bool = False) -> int:
    """Latency-bound messages one rank sends per step (each pays α), the arguments' agreement
    exchange included (one small all-gather)."""
    n = (W - 1) + {"context": 2 * (W - 1), "ring": 2 * (W - 1), "ulysses": 4 * (W - 1)}[strategy]
    if backward:
        n += {"context": 4 * (W - 1), "ring": 2 * (W - 1) + 2 * W, "ulysses": 4 * (W - 1)}[strategy]
    return n


def memory_bytes(strategy: str, W: int, T: int) -> float:
    """Attention's activations one rank holds (q, k, v, out of its part; flash: O(T d))."""
    local = T / W * HD * ELEM * (2 * H + 2 * H_KV)  # q, out, k, v of the shard
    if strategy == "context":
        return local + 2 * T * H_KV * HD * ELEM  # + the gathered K/V
    if strategy == "ring":
        return local + 2 * 2 * T / W * H_KV * HD * ELEM  # + the shard in flight (two buffers)
    return local + T * HD * ELEM * (2 * H + 2 * H_KV) / W  # whole sequence of h/W heads


def predict(strategy: str, W: int, T: int, alpha: float, beta: float, rate: float,
            backward: bool = False) -> dict:
    """Time per step (s) and memory per rank (bytes). Compute is the full problem's FLOPs
    over W ranks (balanced: zig-zag layout, or heads); the ring overlaps its sends with
    compute, step by step; the others wait for their collectives."""
    compute = attention_flops(T, backward=backward) / W / rate
    comm = messages(strategy, W, backward) * alpha + comm_bytes(strategy, W, T, backward) / beta
    if strategy == "ring":
        total = max(compute, comm) + comm / max(W - 1, 1)  # the first shard is not overlapped
    else:
        total = compute + comm
    return {"seconds": total, "compute": compute, "comm": comm,
            "memory": memory_bytes(strategy, W, T)}


def fit_link(sizes: list[int], seconds: list[float]) -> tuple[float, float]:
    """Least squares ``t = α + bytes / β``: (α seconds, β bytes/s)."""
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(seconds) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, seconds, strict=True)) / sxx
    if slope <= 0:  # time did not grow with size: the bandwidth is not resolved by the sweep
        return my, math.inf
    return max(my - slope * mx, 0.0), 1.0 / slope


# ----------------------------------------------------------------------------- measuring
class _CommMeter:
    """Wraps torch.distributed's functions that mha calls: bytes sent and seconds inside."""

    NAMES = ("all_gather", "all_reduce", "all_to_all_single", "isend", "irecv", "send", "recv")

    def __init__(self, world: int):
        self.world, self.bytes, self.seconds, self.saved = world, 0, 0.0, {}

    def __enter__(self):
        import torch.distributed as dist

        for name in self.NAMES:
            self.saved[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name, self.saved[name]))
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        for name, fn in self.saved.items():
            setattr(dist, name, fn)

    def _sent(self, name, args) -> int:
        t = args[1] if name in ("all_gather", "all_to_all_single") else args[0]
        n = t.numel() * t.element_size()
        if name == "all_gather" or name == "all_reduce":
            return n * (self.world - 1) // (1 if name == "all_gather" else self.world) * (
                1 if name == "all_gather" else 2)
        if name == "all_to_all_single":
            return n * (self.world - 1) // self.world
        return n if name in ("isend", "send") else 0

    def _wrap(self, name, fn):
        meter = self

        def wrapped(*args, **kwargs):
            meter.bytes += meter._sent(name, args)
            t0 = time.perf_counter()
            work = fn(*args, **kwargs)
            meter.seconds += time.perf_counter() - t0
            if work is None or not hasattr(work, "wait"):
                return work
            return _TimedWork(work, meter)

        return wrapped


class _TimedWork:
    def __init__(self, work, meter):
        self.work, self.meter = work, meter

    def wait(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.work.wait(*args, **kwargs)
        self.meter.seconds += time.perf_counter() - t0
        return out


def _strategy_fn(name: str):
    from mha import distributed as D

    return {"context": D.context_parallel_attention, "ring": D.ring_attention,
            "ulysses": D.ulysses_attention}[name]


def _measure_step(name: str, W: int, rank: int, T: int, backward: bool, reps: int) -> dict:
    from mha import distributed as D

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, T, HD, generator=g) for _ in range(3))
    local = [D.shard(t, W, rank, layout="zigzag").contiguous() for t in (q, k, v)]
    fn = _strategy_fn(name)
    rows = []
    for i in range(reps + 1):  # the first is a warm-up
        ins = [t.clone().requires_grad_(backward) for t in local]
        torch.distributed.barrier()
        with _CommMeter(W) as meter:
            t0 = time.perf_counter()
            out = fn(*ins, causal=True, layout="zigzag")
            if backward:
                out.sum().backward()
            seconds = time.perf_counter() - t0
        if i:
            rows.append((seconds, meter.seconds, meter.bytes))
    s = statistics.median(r[0] for r in rows)
    c = statistics.median(r[1] for r in rows)
    return {"strategy": name, "W": W, "T": T, "backward": backward, "seconds": s,
            "comm_seconds": c, "compute_seconds": max(s - c, 0.0), "bytes_sent": rows[0][2]}


def _pingpong(rank: int, sizes: list[int], reps: int) -> list[float]:
    import torch.distributed as dist

    out = []
    for n in sizes:
        buf = torch.zeros(n // 4)
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            times.append((time.perf_counter() - t0) / 2)  # one way
        out.append(statistics.median(times))
    return out


def _worker(rank: int, W: int, init_file: str, out_file: str, quick: bool) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=W)
    try:
        lengths = (64 * W,) if quick else (1024, 4096)
        reps = 2 if quick else 3
        rows = [_measure_step(s, W, rank, T, bw, reps)
                for T in lengths for s in STRATEGIES for bw in (False, True)]
        sizes = [1 << p for p in (range(12, 23, 2) if quick else range(12, 25, 2))]
        link = _pingpong(rank, sizes, 3 if quick else 5)
        if rank == 0:
            Path(out_file).write_text(json.dumps({"rows": rows, "sizes": sizes, "link": link}))
    finally:
        dist.destroy_process_group()


def _kernel_rate(quick: bool) -> dict:
    """FLOP/s of mha.attention forward and forward+backward, one thread (as each rank runs)."""
    import mha

    T = 256 if quick else 2048
    with num_threads(1):
        q, k, v = (torch.randn(1, H, T, HD, requires_grad=True) for _ in range(3))
        rates = {}
        for backward in (False, True):
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                out = mha.attention(q, k, v, causal=True)
                if backward:
                    out.sum().backward()
                times.append(time.perf_counter() - t0)
            rates["fwd+bwd" if backward else "fwd"] = attention_flops(T, backward=backward) / min(times)
        return rates


def run(ranks=(2,), quick: bool = False) -> dict:
    """Measure on loopback, fit, predict; returns the report (JSON-ready)."""
    import torch.multiprocessing as mp

    from mha.bench import cpu

    measured, link_points = [], []
    for W in ranks:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rank0.json")
            mp.spawn(_worker, args=(W, os.path.join(tmp, "rendezvous"), out, quick), nprocs=W,
                     join=True)
            data = json.loads(Path(out).read_text())
        measured += data["rows"]
        link_points += list(zip(data["sizes"], data["link"], strict=True))
    alpha, beta = fit_link([s for s, _ in link_points], [t for _, t in link_points])
    rate = _kernel_rate(quick)
    fit_check = []
    for row in measured:
        p = predict(row["strategy"], row["W"], row["T"], alpha, beta,
                    rate["fwd+bwd" if row["backward"] else "fwd"], row["backward"])
        fit_check.append({**{k: row[k] for k in ("strategy", "W", "T", "backward")},
                          "measured": row["seconds"], "predicted": p["seconds"],
                          "ratio": p["seconds"] / row["seconds"],
                          "bytes_measured": row["bytes_sent"],
                          "bytes_model": comm_bytes(row["strategy"], row["W"], row["T"],
                                                    row["backward"])})
    predictions = []
    for link, (a, b) in LINKS.items():
        for s in STRATEGIES:
            for W in PRED_RANKS:
                for T in PRED_T:
                    if s == "ulysses" and H % W:
                        predictions.append({"link": link, "strategy": s, "W": W, "T": T,
                                            "seconds": None, "note": f"needs h % W == 0 (h={H})"})
                        continue
                    p = predict(s, W, T, a, b, rate["fwd+bwd"], backward=True)
                    predictions.append({"link": link, "strategy": s, "W": W, "T": T, **p})
    return {"cpu": cpu.record(with_native=False), "problem": {"h": H, "h_kv": H_KV, "d": HD,
                                                              "dtype": "fp32", "causal": True,
                                                              "layout": "zigzag"},
            "quick": quick, "measured": measured, "link": {"alpha": alpha, "beta": beta,
                                                           "points": link_points},
            "kernel_rate": rate, "fit_check": fit_check, "links": LINKS,
            "predictions": predictions}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for ax, link in zip(axes[:2], LINKS, strict=True):
        for s, style in zip(STRATEGIES, ("-", "--", ":"), strict=True):
            for T, color in zip(PRED_T, ("C0", "C1", "C2"), strict=True):
                pts = [(p["W"], p["seconds"]) for p in report["predictions"]
                       if p["link"] == link and p["strategy"] == s and p["T"] == T and p["seconds"]]
                if pts:
                    ax.plot(*zip(*pts, strict=True), style, color=color, label=f"{s}, T={T:,}")
        ax.set(xscale="log", yscale="log", xlabel="ranks W", ylabel="s per training step",
               title=f"predicted, {link} (α = {LINKS[link][0] * 1e6:.0f} µs)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6, ncol=3)
    ax = axes[2]
    for s, marker in zip(STRATEGIES, ("o", "s", "^"), strict=True):
        pts = [(r["measured"], r["predicted"]) for r in report["fit_check"] if r["strategy"] == s]
        ax.scatter(*zip(*pts, strict=True), marker=marker, label=s)
    lo = min(min(r["measured"], r["predicted"]) for r in report["fit_check"])
    hi = max(max(r["measured"], r["predicted"]) for r in report["fit_check"])
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="predicted = measured")
    ax.set(xscale="log", yscale="log", xlabel="measured s (loopback)", ylabel="model s",
           title=f"loopback: α = {report['link']['alpha'] * 1e6:.0f} µs, "
                 f"β = {report['link']['beta'] / 1e9:.2f} GB/s")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.suptitle("mha.distributed: measured on loopback, α-β model at scale "
                 f"(h={H}, d={HD}, fp32, causal, zig-zag)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _table(report: dict) -> str:
    lines = ["strategy  W     T  backward  measured s  comm s  bytes sent  model s  model/measured"]
    for r, f in zip(report["measured"], report["fit_check"], strict=True):
        lines.append(f"{r['strategy']:8s} {r['W']:2d} {r['T']:6d}  {str(r['backward']):8s} "
                     f"{r['seconds']:10.4f} {r['comm_seconds']:7.4f} {r['bytes_sent']:11,d} "
                     f"{f['predicted']:8.4f} {f['ratio']:8.2f}")
    lk = report["link"]
    lines.append(f"link (loopback): α = {lk['alpha'] * 1e6:.1f} µs, β = {lk['beta'] / 1e9:.2f} GB/s; "
                 f"kernel rate: fwd {report['kernel_rate']['fwd'] / 1e9:.1f}, fwd+bwd "
                 f"{report['kernel_rate']['fwd+bwd'] / 1e9:.1f} GFLOP/s (1 thread)")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mha.bench.distributed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny sizes (a test of the harness)")
    p.add_argument("--ranks", type=int, nargs="+", default=[2], help="world sizes to measure "
                   "(each a set of gloo processes on this machine; default 2)")
    p.add_argument("--out", default="benchmarks/results", help="directory for "
                   "distributed-<cpu kind>.json / .png ('' to save nothing)")
    args = p.parse_args(argv)
    if any(w < 2 or w > 8 for w in args.ranks):
        p.error("--ranks: each world size must lie in [2, 8] (processes on this machine)")
    report = run(tuple(args.ranks), quick=args.quick)
    print(_table(report))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        kind = report["cpu"]["kind"]
        (out / f"distributed-{kind}.json").write_text(json.dumps(report, indent=1))
        plot(report, out / f"distributed-{kind}.png")
        print(f"wrote {out / f'distributed-{kind}.json'} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
