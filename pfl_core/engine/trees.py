"""Pytrees of tensors (nested dicts, lists, tuples) as the engine stacks and splits them."""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten


def stack_trees(trees: list[Any]) -> tuple[Any, Any]:
    """Stack same-shaped pytrees along a new leading axis.

    Returns ``(stacked, in_dims)``: a leaf that is the *same tensor object* in every tree (the
    server's parameters, shared by all clients of a round) is passed once with ``in_dims`` None
    (broadcast by ``vmap``, not copied); every other leaf is stacked with ``in_dims`` 0.
    """
    flat, spec = zip(*(tree_flatten(t) for t in trees))
    if any(s != spec[0] for s in spec[1:]):
        raise ValueError("cannot stack client states of different structures")
    leaves, dims = [], []
    for column in zip(*flat):
        if all(leaf is column[0] for leaf in column[1:]):
            leaves.append(column[0])
            dims.append(None)
        else:
            leaves.append(torch.stack(column))
            dims.append(0)
    return tree_unflatten(leaves, spec[0]), tree_unflatten(dims, spec[0])


def unstack_tree(tree: Any, count: int) -> list[Any]:
    """The ``count`` slices of a stacked pytree along its leading axis."""
    return [tree_map(lambda leaf: leaf[i], tree) for i in range(count)]


def tree_where(condition: torch.Tensor, new: Any, old: Any) -> Any:
    """``new`` where ``condition`` (a 0-d bool tensor) holds, else ``old``, leaf by leaf (a None
    leaf, e.g. the absent BN state of a model without one, stays None)."""
    return tree_map(lambda n, o: None if n is None else torch.where(condition, n, o), new, old)
