"""The autograd graph behind a tensor, by node type name (which backward a call recorded)."""

from __future__ import annotations

import torch


def node_names(y: torch.Tensor) -> set[str]:
    """The type names of the autograd nodes behind ``y``."""
    seen, todo = set(), [y.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and type(node).__name__ not in seen:
            seen.add(type(node).__name__)
            todo.extend(n for n, _ in node.next_functions)
    return seen
