"""Federated data held as resident tensors plus per-client index tensors (docs/data.md).

A dataset is loaded once. Images stay ``uint8`` until a batch is drawn; :meth:`ArrayDataset.batch`
converts only the rows it returns, or gathers them from the normalised copy of the whole dataset
that it makes on first use when that copy fits the input cache (``PFL_INPUT_CACHE_MB``, default
1024; 0 turns it off): the same values, computed once instead of once per batch. A client is a set of named index tensors into the dataset (one
per split: ``train``/``val``/``test`` or ``pers``/``eval``) plus metadata (group, writer, domain).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import torch


@dataclass
class ArrayDataset:
    """A whole dataset as tensors.

    Attributes:
        name: registry name of the dataset (e.g. ``"mnist"``).
        x: inputs. ``uint8`` images of shape (N, C, H, W) or ``float32`` features (N, D).
        y: ``int64`` labels of shape (N,).
        num_classes: number of classes of the label space.
        groups: optional ``int64`` natural group id per sample (writer, rotation group, domain),
            used by the natural partitioner.
        mean, std: optional normalisation applied after scaling to [0, 1]: per channel (tuples)
            or per input element (tensors of the input shape; see :func:`standardize`).
        offline: True when the data was generated or ships inside an installed package, i.e. it is
            *not* the real benchmark dataset. Reports say so.
        description: one line for logs and reports (source, split, preprocessing).
        provenance: "" for the official files; else one line saying which copy was loaded instead
            (the CIFAR-10 reconstruction, a copy accepted by ``PFL_ACCEPT_MD5_MISMATCH``). Runs
            record it (``data_provenance``) and reports print it beside their tables.
        source, sources: for a dataset joined from several of its splits
            (:func:`~pfl_core.data.datasets.load_sources`), ``sources[source[i]]`` is the split row
            i came from (e.g. ``("train", "val", "test")``); None and () for one split.
        group_names: the name of each group id, when the groups have names.
        evaluation_normalized: False when the evaluation paths (fine-tuning and test of the
            evaluation protocol, the evaluation-time meta-net inputs) see the inputs in [0, 1]
            although training batches are normalised by ``mean``/``std``: the FedL2P Office code's
            behaviour (fedl2p.md, "Office-Caltech-10", Normalization). Protocols draw evaluation
            batches from :meth:`for_evaluation`.
        inputs: optional map from stored rows (after scaling and ``mean``/``std``) to model inputs,
            applied by :meth:`batch` (Speech Commands: the fbank image of each stored clip,
            :func:`pfl_core.data.audio.speech_features`). Augmentation of such rows goes between
            :meth:`raw_batch` and :meth:`to_inputs`.
        extras: loader tensors beside the rows (Speech Commands: ``noise``, ``noise_lengths``, the
            background-noise waveforms its augmentation cuts from).
        unseen_groups: the dataset's own held-out clients: clients whose ``group`` is listed are
            the run's unseen clients (Speech Commands: the unseen speaker pool); ``data.unseen_fraction``
            must then be 0.
    """

    name: str
    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    groups: torch.Tensor | None = None
    mean: tuple[float, ...] | torch.Tensor | None = None
    std: tuple[float, ...] | torch.Tensor | None = None
    offline: bool = False
    description: str = ""
    provenance: str = ""
    source: torch.Tensor | None = None
    sources: tuple[str, ...] = ()
    group_names: tuple[str, ...] = ()
    """Optional name of each group id (``group_names[g]``: a corruption, a domain); () for none."""
    evaluation_normalized: bool = True
    inputs: Callable[[torch.Tensor], torch.Tensor] | None = None
    extras: dict = field(default_factory=dict)
    unseen_groups: tuple[int, ...] = ()
    _normalized: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    """Every row scaled and normalised (:meth:`normalized_rows`); not copied by ``replace``."""

    def __post_init__(self) -> None:
        if self.x.shape[0] != self.y.shape[0]:
            raise ValueError(f"{self.name}: {self.x.shape[0]} inputs but {self.y.shape[0]} labels")
        self.y = self.y.long()

    def __len__(self) -> int:
        return int(self.y.shape[0])

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The shape of one model input (of a stored row mapped by ``inputs`` when set)."""
        if self.inputs is None or not len(self):
            return tuple(self.x.shape[1:])
        first = self.raw_batch(torch.zeros(1, dtype=torch.int64, device=self.x.device))[0]
        return tuple(self.to_inputs(self.normalize(first)).shape[1:])

    def to(self, device: torch.device | str) -> "ArrayDataset":
        """A copy whose resident tensors live on ``device`` (done once per run; no-op if there)."""
        moved = {k: v.to(device) for k, v in (("mean", self.mean), ("std", self.std), ("groups", self.groups),
                                               ("source", self.source))
                 if isinstance(v, torch.Tensor)}
        extras = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.extras.items()}
        return replace(self, x=self.x.to(device), y=self.y.to(device), extras=extras, **moved)

    def subset(self, index: torch.Tensor) -> "ArrayDataset":
        """The rows ``index`` as a new dataset (same classes, normalisation and provenance)."""
        groups = None if self.groups is None else self.groups[index]
        source = None if self.source is None else self.source[index]
        note = f"; subset of {len(index)} of {len(self)} samples"
        return replace(self, x=self.x[index], y=self.y[index], groups=groups, source=source,
                       description=self.description + note)

    def source_rows(self, split: str) -> np.ndarray:
        """The rows that came from source split ``split`` (every row when the dataset is one split)."""
        if self.source is None:
            return np.arange(len(self))
        if split not in self.sources:
            raise ValueError(f"dataset {self.name!r} holds the splits {list(self.sources)}, not {split!r}")
        return np.flatnonzero(self.source.cpu().numpy() == self.sources.index(split))

    def batch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``index`` as (float inputs, int64 labels); uint8 images are scaled to [0, 1]."""
        rows = self.normalized_rows()
        if rows is not None:
            return self.to_inputs(rows[index]), self.y[index]
        x, y = self.raw_batch(index)
        return self.to_inputs(self.normalize(x)), y

    def normalized_rows(self) -> torch.Tensor | None:
        """All rows scaled to [0, 1] and normalised, as :meth:`batch` computes them row by row (the
        same elementwise operations, so the same bits), made on first use and kept; None when the
        float copy would exceed the input cache (``PFL_INPUT_CACHE_MB``, default 1024 MiB, a harness
        choice; 0: never). Small-model runs spend most of a round converting and normalising their
        batches otherwise (``benchmarks.timing.speed``)."""
        if self._normalized is None and self.x.dtype == torch.float32 and self.mean is None:
            self._normalized = self.x  # float rows without mean/std are their own inputs
        if self._normalized is None and len(self) and self._cache_fits():
            out = torch.empty((len(self), *self.x.shape[1:]), dtype=torch.float32, device=self.x.device)
            for start in range(0, len(self), 8192):
                chunk = torch.arange(start, min(start + 8192, len(self)), device=self.x.device)
                out[start:start + len(chunk)] = self.normalize(self.raw_batch(chunk)[0])
            self._normalized = out
        return self._normalized

    def _cache_fits(self) -> bool:
        if self.x.dtype not in (torch.uint8, torch.float32):
            return False
        budget = float(os.environ.get("PFL_INPUT_CACHE_MB", "1024")) * 2 ** 20
        return self.x[:1].numel() * len(self) * 4 <= budget

    def raw_batch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``index`` scaled to [0, 1] but not normalised: the input of an augmentation that
        normalises after cropping (``pfl_core.data.augment.crop_flip``; the FedL2P code's ToTensor batches)."""
        x = self.x[index]
        if x.dtype == torch.uint8:
            x = x.float().div_(255.0)
        return x, self.y[index]

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (in [0, 1]) with this dataset's ``mean`` / ``std`` applied, if it has them."""
        if isinstance(self.mean, torch.Tensor):
            return (x - self.mean) / self.std
        if self.mean is not None:
            shape = (1, -1) + (1,) * (x.dim() - 2)
            mean = torch.tensor(self.mean, device=x.device).view(shape)
            std = torch.tensor(self.std, device=x.device).view(shape)
            return (x - mean) / std
        return x

    def to_inputs(self, x: torch.Tensor) -> torch.Tensor:
        """Model inputs of (possibly augmented, normalised) rows: ``inputs(x)``, or ``x`` itself."""
        return x if self.inputs is None else self.inputs(x)

    def for_evaluation(self) -> "ArrayDataset":
        """The dataset as the evaluation paths see it: without ``mean``/``std`` when
        ``evaluation_normalized`` is False, else itself."""
        return self if self.evaluation_normalized else replace(self, mean=None, std=None, evaluation_normalized=True)

    def labels_numpy(self) -> np.ndarray:
        return self.y.cpu().numpy()


NORMALIZATIONS = ("none", "pixel", "half")


def standardize(dataset: ArrayDataset, mode: str, eps: float = 0.001,
                rows: torch.Tensor | None = None) -> ArrayDataset:
    """Input normalisation chosen by a run's ``data.normalize``:

    * ``none``: the loader's own (inputs in [0, 1], or the dataset's published mean/std);
    * ``pixel``: per-element standardisation, (x - mean) / (std + eps), the statistics taken over
      the whole loaded dataset (the pFedMe code's MNIST preprocessing, docs/papers/cgpfl.md)
      or over ``rows`` only (a tuning run's training samples, ``data.normalize_stats``);
    * ``half``: (x - 0.5) / 0.5 per channel, i.e. ToTensor + Normalize(0.5, 0.5) (pFedMe's CIFAR-10).
    """
    if mode not in NORMALIZATIONS:
        raise ValueError(f"data.normalize must be one of {NORMALIZATIONS}, got {mode!r}")
    if mode == "none":
        return dataset
    if mode == "half":
        channels = dataset.x.shape[1]
        return replace(dataset, mean=(0.5,) * channels, std=(0.5,) * channels)
    x = dataset.x if rows is None else dataset.x[rows.to(dataset.x.device)]
    x = x.float() / 255.0 if x.dtype == torch.uint8 else x.float()
    return replace(dataset, mean=x.mean(0), std=x.std(0, unbiased=False) + eps)


@dataclass
class Client:
    """One client: named index tensors into the dataset and free-form metadata."""

    cid: int
    splits: dict[str, torch.Tensor]
    meta: dict = field(default_factory=dict)

    def size(self, split: str) -> int:
        return int(self.splits[split].numel())


@dataclass
class FederatedData:
    """A dataset, its clients, and which clients train (seen), are held out for testing (unseen)
    or are held out for tuning (validation)."""

    dataset: ArrayDataset
    clients: list[Client]
    train_clients: list[int]
    unseen_clients: list[int] = field(default_factory=list)
    validation_clients: list[int] = field(default_factory=list)
    partition_draws: int = 1
    """Partitions drawn before this one was kept (``build_federated``'s ``min_train_size``)."""
    pools: dict[str, torch.Tensor] = field(default_factory=dict)
    """Whole source splits outside the clients (``data.pool_splits``): split name -> its rows, for
    protocols that draw from a split rather than from clients (the MetaVers novel-class protocol's
    validation and test classes)."""

    def __post_init__(self) -> None:
        groups = [("training", self.train_clients), ("unseen", self.unseen_clients),
                  ("validation", self.validation_clients)]
        for i, (name_a, a) in enumerate(groups):
            for name_b, b in groups[i + 1:]:
                overlap = set(a) & set(b)
                if overlap:
                    raise ValueError(f"clients {sorted(overlap)[:5]} are both {name_a} and {name_b} clients")

    def to(self, device: torch.device | str) -> "FederatedData":
        """A copy with the dataset and every client's index tensors on ``device``."""
        clients = [
            replace(c, splits={k: v.to(device) for k, v in c.splits.items()}) for c in self.clients
        ]
        pools = {k: v.to(device) for k, v in self.pools.items()}
        return replace(self, dataset=self.dataset.to(device), clients=clients, pools=pools)
