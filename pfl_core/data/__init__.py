"""Data layer: datasets, partitioners, per-client splits and the federated-data builder."""
from pfl_core.data.builder import build_federated
from pfl_core.data.datasets import (
    DATASETS,
    DatasetNotFoundError,
    load_dataset,
    load_sources,
    resolve_data_dir,
)
from pfl_core.data.federated import ArrayDataset, Client, FederatedData
from pfl_core.data.idx import DatasetFileError
from pfl_core.data.offline import digits28, synthetic
from pfl_core.data.partitions import (
    PARTITIONERS,
    assign_classes,
    partition,
    partitioner_params,
    rotation_group_of,
    split_by_assignment,
)
from pfl_core.data.splits import split_indices, split_seen_unseen
from pfl_core.registry import import_package_modules

import_package_modules(__name__, __path__)  # each dataset module registers its loaders

__all__ = [
    "ArrayDataset",
    "Client",
    "DATASETS",
    "DatasetFileError",
    "DatasetNotFoundError",
    "FederatedData",
    "PARTITIONERS",
    "assign_classes",
    "build_federated",
    "digits28",
    "load_dataset",
    "load_sources",
    "partition",
    "partitioner_params",
    "resolve_data_dir",
    "rotation_group_of",
    "split_by_assignment",
    "split_indices",
    "split_seen_unseen",
    "synthetic",
]
