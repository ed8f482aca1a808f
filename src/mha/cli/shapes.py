"""``mha shapes``: the seed-004 flow table for any configuration, recorded from a real run."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("shapes", help="print the shape of every step, recorded from a real run")
    p.add_argument("--batch", "-B", type=int, default=32, help="B (default 32)")
    p.add_argument("--seq", "-T", type=int, default=20, help="Tq, the query length (default 20)")
    p.add_argument("--kv-seq", type=int, default=None,
                   help="Tk, the key length for cross-attention (default: self-attention)")
    p.add_argument("--d-model", type=int, default=512, help="d_model (default 512)")
    p.add_argument("--heads", type=int, default=8, help="h (default 8)")
    p.add_argument("--kv-heads", type=int, default=None, help="h_kv for GQA/MQA (default h)")
    p.add_argument("--d-k", type=int, default=None, help="d_k (default d_model / h)")
    p.add_argument("--d-v", type=int, default=None, help="d_v (default d_k)")
    p.add_argument("--causal", action="store_true", help="bottom-right causal mask")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


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
    import sys

    from rich.console import Console

    for flag, value in (("--batch", args.batch), ("--seq", args.seq), ("--kv-seq", args.kv_seq)):
        if value is not None and value < 1:
            print(f"mha shapes: {flag} must be a positive int, got {value}", file=sys.stderr)
            return 2
    try:
        tr = record(args)
    except ValueError as e:  # an impossible configuration: the module's message says why
        print(f"mha shapes: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(tr.to_json())
    else:
        Console().print(tr.table())
        print(f"attention backend used for the trace: {tr.backend} (a trace records the "
              f"weights, so only backends that return them qualify)")
    return 0
