"""``mha shapes``: the seed-004 flow table for any configuration, recorded from a real run."""

from __future__ import annotations

from mha.cli.options import UsageError, check_fits, positive_int


def add_parser(sub) -> None:
    p = sub.add_parser("shapes", help="print the shape of every step, recorded from a real run")
    p.add_argument("--batch", "-B", type=positive_int, default=32, help="B (default 32)")
    p.add_argument("--seq", "-T", type=positive_int, default=20,
                   help="Tq, the query length (default 20)")
    p.add_argument("--kv-seq", type=positive_int, default=None,
                   help="Tk, the key length for cross-attention (default: self-attention)")
    p.add_argument("--d-model", type=positive_int, default=512, help="d_model (default 512)")
    p.add_argument("--heads", type=positive_int, default=8, help="h (default 8)")
    p.add_argument("--kv-heads", type=positive_int, default=None,
                   help="h_kv for GQA/MQA, must divide h (default h)")
    p.add_argument("--d-k", type=positive_int, default=None, help="d_k (default d_model / h)")
    p.add_argument("--d-v", type=positive_int, default=None, help="d_v (default d_k)")
    p.add_argument("--causal", action="store_true", help="bottom-right causal mask")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def check(args) -> None:
    """Refuse, before building anything, a configuration the module cannot take or whose
    tensors cannot fit in memory."""
    D, H = args.d_model, args.heads
    if args.d_k is None and D % H:
        raise UsageError(f"--heads must divide --d-model, or give --d-k: d_model={D} must be "
                         f"divisible by num_heads={H}")
    kv = H if args.kv_heads is None else args.kv_heads
    if H % kv:
        raise UsageError(f"--kv-heads must divide --heads: num_heads={H} must be a multiple of "
                         f"num_kv_heads={kv}")
    d_k = D // H if args.d_k is None else args.d_k
    d_v = d_k if args.d_v is None else args.d_v
    B, Tq = args.batch, args.seq
    Tk = Tq if args.kv_seq is None else args.kv_seq
    params = D * (H * d_k + kv * d_k + kv * d_v) + H * d_v * D  # W^Q, W^K, W^V, W_O
    inputs = B * Tq * D + (0 if args.kv_seq is None else B * Tk * D)  # x (and the K/V input)
    check_fits(4 * (params + inputs + B * H * Tq * Tk),  # + the recorded weights (B, h, Tq, Tk)
               f"B={B}, Tq={Tq}, Tk={Tk}, d_model={D}, h={H}, h_kv={kv}, d_k={d_k}, d_v={d_v}")


def record(args):
    """Build the module the arguments describe, run it once, return its Trace."""
    import torch

    import mha

    torch.manual_seed(0)
    m = mha.MultiHeadAttention(args.d_model, args.heads, num_kv_heads=args.kv_heads,
                               head_dim=args.d_k, v_head_dim=args.d_v)
    x = torch.randn(args.batch, args.seq, args.d_model)
    kv = None if args.kv_seq is None else torch.randn(args.batch, args.kv_seq, args.d_model)
    return mha.trace(m, x, kv, kv, causal=args.causal)


def run(args) -> int:
    check(args)
    from rich.console import Console

    tr = record(args)
    if args.json:
        print(tr.to_json())
    else:
        Console().print(tr.table())
        print(f"attention backend used for the trace: {tr.backend} (a trace records the "
              f"weights, so only backends that return them qualify)")
    return 0
