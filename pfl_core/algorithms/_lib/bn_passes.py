"""Running BatchNorm statistics of train-mode passes that ran inside a client program.

A BatchNorm layer in train mode moves its running statistics toward the batch statistics of every
forward pass: r <- (1 - m) r + m s (``torch.nn.BatchNorm2d``, momentum m = 0.1, unbiased batch
variance). When clients of one round share one model and run one after another (MetaVers'
``trainer_novel_class.py``: ``model.train()`` once per round, then ``meta_update_frl`` and
``triplet_update_frl`` per client), the statistics after the round are that update applied to every
pass in client order. A client program under ``vmap`` cannot update a shared buffer, so it returns
the batch statistics of its pass (:func:`pass_statistics`) and the server replays the updates in
the sampled order (:func:`replay_passes`): the same numbers as the sequential code.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from pfl_core.models.kld_bn import Buffers, bn_layers, buffer_key


def pass_statistics(model: nn.Module) -> Buffers:
    """The (mean, unbiased variance) batch statistics of the last train-mode pass of ``model``'s
    stateful BN layers, keyed like their ``running_mean``/``running_var``; cleared after reading."""
    stats = {}
    for name, layer in bn_layers(model):
        if layer.batch_stats is None:
            raise ValueError(f"BN layer {name!r} has no train-mode pass to read")
        mean, var = layer.batch_stats
        layer.batch_stats = None
        stats[buffer_key(name, "running_mean")], stats[buffer_key(name, "running_var")] = mean, var
    return stats


def replay_passes(model: nn.Module, buffers: Mapping[str, torch.Tensor], stats: Mapping[str, torch.Tensor],
                  passes: int) -> Buffers:
    """``buffers`` after ``passes`` train-mode passes whose batch statistics were ``stats``
    (the update of ``torch.nn.BatchNorm2d``; ``num_batches_tracked`` counts the passes)."""
    new = dict(buffers)
    for name, layer in bn_layers(model):
        for _ in range(passes):
            for key in ("running_mean", "running_var"):
                k = buffer_key(name, key)
                new[k] = (1 - layer.momentum) * new[k] + layer.momentum * stats[k]
        counter = buffer_key(name, "num_batches_tracked")
        if counter in new:
            new[counter] = new[counter] + passes
    return new
