"""Office-Caltech-10 and DomainNet from FedBN's pre-processed files (fedl2p.md, "Office-Caltech-10",
"DomainNet").

On disk (FedBN, github.com/med-air/FedBN, ``data/``): per dataset folder one pickle per domain and
split, ``<domain>_train.pkl`` / ``<domain>_test.pkl``, each ``(paths, text_labels)`` (two lists), and
the images under the same folder. A path starts with the dataset folder's own name (FedBN joins it
with ``../data``); like the FedL2P code, the loader drops that first component and reads the rest
under the dataset folder (``<data dir>/office_caltech_10/amazon/back_pack/frame_0001.jpg``).

Preprocessing, as the FedL2P code builds its client files (``office_dataset.py``,
``domainnet_dataset.py``):

1. every image opened with PIL; one whose band count is not 3 becomes 3-channel grayscale
   (``Grayscale(num_output_channels=3)``); then ``Resize([256, 256])`` (no crop, aspect not kept);
2. ``equal_samples``: each domain's train list is subsampled to the smallest domain's train size
   with ``default_rng(split_seed).choice(n, m, replace=False)`` (a fresh generator per domain, rows
   in the order drawn);
3. ``train_test_split(test_size=0.2, stratify=labels, shuffle=True, random_state=split_seed)``
   cuts each domain's train into train / ``val``; ``test`` is FedBN's test list, in order.

Images stay uint8 (N, 3, S, S); ``groups`` is the domain index, ``group_names`` the domains (the
client meta ``group`` is the domain's name, as CIFAR-10-C's is the corruption's).
Normalisation (ImageNet mean/std): DomainNet's loaders normalise on every path; Office's only in
meta-training (``normalize``), its evaluation loaders see [0, 1] inputs unless
``normalize_everywhere`` (:attr:`ArrayDataset.evaluation_normalized`). Clients come from ``lda``
with ``data.partition_per_group`` (one client per domain for Office, 25 per domain for DomainNet).
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pfl_core.fields import Fraction, NonNegativeInt, PositiveInt
from pfl_core.data.datasets import DATASETS, DatasetNotFoundError
from pfl_core.data.federated import ArrayDataset

IMAGENET_MEAN_STD = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
"""The ``transforms.Normalize`` constants of both FedL2P loaders."""


@dataclass(frozen=True)
class DomainSet:
    """One of FedBN's multi-domain datasets: its folder, domains and classes (label order)."""

    title: str
    folder: str
    domains: tuple[str, ...]
    classes: tuple[str, ...]


OFFICE = DomainSet(
    "Office-Caltech-10", "office_caltech_10", ("amazon", "caltech", "dslr", "webcam"),
    ("back_pack", "bike", "calculator", "headphones", "keyboard", "laptop_computer", "monitor", "mouse", "mug",
     "projector"))
DOMAINNET = DomainSet(
    "DomainNet", "DomainNet", ("clipart", "infograph", "painting", "quickdraw", "real", "sketch"),
    ("bird", "feather", "headphones", "ice_cream", "teapot", "tiger", "whale", "windmill", "wine_glass", "zebra"))


def _read_list(spec: DomainSet, root: Path, domain: str, part: str) -> tuple[list[str], np.ndarray]:
    """(image paths, labels) of FedBN's ``<domain>_<part>.pkl``."""
    path = root / f"{domain}_{part}.pkl"
    if not path.is_file():
        raise DatasetNotFoundError(
            f"{spec.title} not found under {root.parent} (expected {path}, FedBN's pre-processed "
            f"<domain>_train.pkl / <domain>_test.pkl lists with the images beside them); download FedBN's "
            f"{spec.folder} data (github.com/med-air/FedBN, README 'Dataset'), unpack it as {root}, or set "
            "PFL_DATA_DIR / --data-dir")
    with open(path, "rb") as f:
        paths, text_labels = pickle.load(f)
    unknown = sorted(set(text_labels) - set(spec.classes))
    if unknown or len(paths) != len(text_labels):
        raise DatasetNotFoundError(f"{path}: expected ({len(paths)} paths, as many labels of {list(spec.classes)}); "
                                   f"got {len(text_labels)} labels, unknown {unknown[:3]}")
    return [str(p) for p in paths], np.asarray([spec.classes.index(t) for t in text_labels], dtype=np.int64)


def read_image(path: Path, size: int) -> np.ndarray:
    """The code's image: non-3-band images to 3-channel grayscale, then ``Resize([size, size])``;
    uint8 (3, size, size)."""
    from PIL import Image
    from torchvision.transforms import functional as TF  # lazy, see datasets._torchvision_datasets

    if not path.is_file():
        raise DatasetNotFoundError(f"image {path} listed in FedBN's pickle is missing; unpack the whole archive")
    with Image.open(path) as image:
        if len(image.split()) != 3:
            image = TF.to_grayscale(image, num_output_channels=3)
        image = TF.resize(image, [size, size])
        return np.asarray(image, dtype=np.uint8).transpose(2, 0, 1).copy()


def _read_images(root: Path, paths: list[str], size: int) -> np.ndarray:
    files = [root / Path(*Path(p).parts[1:]) for p in paths]
    return np.stack([read_image(f, size) for f in files]) if files else np.zeros((0, 3, size, size), np.uint8)


def domain_splits(spec: DomainSet, root: Path, equal_samples: bool, val_fraction: float,
                  split_seed: int) -> dict[str, dict[str, tuple[list[str], np.ndarray]]]:
    """Per domain, (paths, labels) of ``train``, ``val`` and ``test`` (module docstring, steps 2-3)."""
    from sklearn.model_selection import train_test_split

    lists = {d: {p: _read_list(spec, root, d, p) for p in ("train", "test")} for d in spec.domains}
    smallest = min(len(lists[d]["train"][1]) for d in spec.domains)
    out = {}
    for domain in spec.domains:
        paths, labels = lists[domain]["train"]
        if equal_samples and len(labels) > smallest:
            keep = np.random.default_rng(split_seed).choice(len(labels), size=smallest, replace=False)
            paths, labels = [paths[i] for i in keep], labels[keep]
        train, val = train_test_split(np.arange(len(labels)), test_size=val_fraction, stratify=labels,
                                      shuffle=True, random_state=split_seed)
        out[domain] = {"train": ([paths[i] for i in train], labels[train]),
                       "val": ([paths[i] for i in val], labels[val]),
                       "test": lists[domain]["test"]}
    return out


def load_domains(name: str, spec: DomainSet, data_dir: Path, split: str, *, equal_samples: bool,
                 val_fraction: float, split_seed: int, image_size: int, normalize: bool,
                 normalize_everywhere: bool) -> ArrayDataset:
    """``split`` (``train``/``val``/``test``, ``all`` = the three in that order) of every domain, in
    domain order within a split; ``groups`` = domain index."""
    root = data_dir / spec.folder
    per_domain = domain_splits(spec, root, equal_samples, val_fraction, split_seed)
    xs, ys, gs = [], [], []
    for part in (("train", "val", "test") if split == "all" else (split,)):
        for g, domain in enumerate(spec.domains):
            paths, labels = per_domain[domain][part]
            xs.append(_read_images(root, paths, image_size))
            ys.append(labels)
            gs.append(np.full(len(labels), g, dtype=np.int64))
    equalised = "train equalised to the smallest domain, " if equal_samples else ""
    stats = dict(zip(("mean", "std"), IMAGENET_MEAN_STD)) if normalize else {}
    return ArrayDataset(
        name=name, x=torch.from_numpy(np.concatenate(xs)), y=torch.from_numpy(np.concatenate(ys)),
        num_classes=len(spec.classes), groups=torch.from_numpy(np.concatenate(gs)), group_names=spec.domains,
        **stats,
        evaluation_normalized=normalize_everywhere or not normalize,
        description=(f"{spec.title} {split} split (FedBN files under {root}; {image_size}x{image_size}, "
                     f"{equalised}{val_fraction:g} stratified val, seed {split_seed}; domains "
                     f"{', '.join(spec.domains)})"),
    )


@DATASETS.register("office_caltech10")
def office_caltech10(data_dir: Path, split: str, download: bool, equal_samples: bool = True,
                     val_fraction: Fraction = 0.2, split_seed: NonNegativeInt = 1, image_size: PositiveInt = 256,
                     normalize: bool = True, normalize_everywhere: bool = False) -> ArrayDataset:
    """Office-Caltech-10 (4 domains x 10 classes), uint8 (N, 3, 256, 256); never downloaded.

    ``equal_samples`` (on), ``val_fraction`` (0.2) and ``split_seed`` (the code's fixed seed 1)
    as in the module docstring; ``image_size`` is 256 (smaller only for smoke runs).
    ``normalize``: ImageNet Normalize on training batches (``office_fedl2p.yaml``: true; the FT
    baselines' ``office.yaml`` has none: false). ``normalize_everywhere`` (fedl2p.md, "Office",
    Normalization): false (default) reproduces the code, whose evaluation loaders never pass
    ``normalize`` (``office_dataset.py`` L242-251), so evaluation fine-tuning, test and the
    evaluation-time meta-net inputs see un-normalised [0, 1] images; true normalises them too."""
    return load_domains("office_caltech10", OFFICE, data_dir, split, equal_samples=equal_samples,
                        val_fraction=val_fraction, split_seed=split_seed, image_size=image_size,
                        normalize=normalize, normalize_everywhere=normalize_everywhere)


@DATASETS.register("domainnet")
def domainnet(data_dir: Path, split: str, download: bool, equal_samples: bool = True,
              val_fraction: Fraction = 0.2, split_seed: NonNegativeInt = 1,
              image_size: PositiveInt = 256, normalize: bool = True) -> ArrayDataset:
    """FedBN's DomainNet subset (6 domains x 10 classes), uint8 (N, 3, 256, 256); never downloaded.
    Parameters as for :func:`office_caltech10`. ``normalize``: ImageNet Normalize on every path,
    training and evaluation (``domainnet_dataset.py`` L42 (default false), L52-54, L253-262: every loader);
    the code sets it only in ``domainnet_fedl2p.yaml`` (L1-3), so its FT baselines
    (``domainnet.yaml``, no ``normalize``) see [0, 1] images: false."""
    return load_domains("domainnet", DOMAINNET, data_dir, split, equal_samples=equal_samples,
                        val_fraction=val_fraction, split_seed=split_seed, image_size=image_size,
                        normalize=normalize, normalize_everywhere=True)


office_caltech10.splits = domainnet.splits = ("train", "val", "test", "all")
