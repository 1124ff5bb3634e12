"""Data shipped with scikit-learn, split across federated clients, and a small model for each.

* ``digits``: 1,797 8×8 images of 10 digits; softmax regression 64 → 10.
* ``breast_cancer``: 569 records of 30 tabular features, 2 classes; logistic regression 30 → 2.

Features are standardized with the training records' mean and std (a simulation shortcut: a real
federation would agree on public scaling constants). Linear models: with ~1,400 records of which
70% may hold ε = 0.1, DP noise swamps anything larger (an MLP 64-16-10 loses 20-30 points).

A stratified 80/20 train/test split is made once; the training records are partitioned across
clients and the test set stays with the server (centralized evaluation of the global model).
Splits: ``iid`` (a random partition into near-equal parts), ``label`` (pathological non-IID of
McMahan et al. 2017: records sorted by label, cut into 2·M shards, two random shards per client,
so most clients see about two labels) and ``dirichlet`` (per class, client shares drawn from
Dirichlet(α), α = ``dirichlet_alpha``).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .._checks import check_int, check_positive

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class FederatedData:
    """Training records split across clients, plus the server's test set.

    Attributes:
        name: the dataset ("digits" or "breast_cancer").
        x_train: (N, d) float32 standardized training features.
        y_train: (N,) int64 class indices.
        x_test: (N_test, d) float32 test features (standardized with the training statistics).
        y_test: (N_test,) int64 class indices.
        client_index: (N,) int64, the client 0..M−1 holding each training record.
        num_clients: M.
        num_classes: number of labels.
    """

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    client_index: np.ndarray
    num_clients: int
    num_classes: int

    def records_of(self, client_id: int) -> np.ndarray:
        """Indices (into the training set) of one client's records.

        Args:
            client_id: 0..M−1.
        Returns:
            (n_k,) int64 indices into ``x_train`` / ``y_train``, ascending.
        """
        return np.flatnonzero(self.client_index == client_id)

    def client_data(self, client_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One client's training records.

        Args:
            client_id: 0..M−1.
        Returns:
            (features (n_k, d) float32, labels (n_k,) int64), in the order of :meth:`records_of`.
        """
        import torch

        idx = torch.from_numpy(self.records_of(client_id))
        return self.x_train[idx], self.y_train[idx]


def _load_digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return x, y, "standardize"


def _load_breast_cancer():
    from sklearn.datasets import load_breast_cancer

    x, y = load_breast_cancer(return_X_y=True)
    return x, y, "standardize"


_LOADERS: dict[str, Callable] = {"digits": _load_digits, "breast_cancer": _load_breast_cancer}
_MODEL_SHAPES: dict[str, tuple[int, int]] = {"digits": (64, 10), "breast_cancer": (30, 2)}
SPLITS = ("iid", "label", "dirichlet")


def datasets() -> tuple[str, ...]:
    """The federated datasets on offer.

    Returns:
        their names, a tuple of str.
    """
    return tuple(_LOADERS)


def model_factory(dataset: str) -> Callable[[], torch.nn.Module]:
    """The model builder of a dataset.

    Args:
        dataset: "digits" or "breast_cancer".
    Returns:
        a function building a fresh model for it (initialized from torch's global RNG): a linear layer,
        (B, d) float32 features → (B, K) logits.
    Raises:
        ValueError for another dataset.
    """
    if dataset not in _MODEL_SHAPES:
        raise ValueError(f"dataset must be one of {', '.join(map(repr, _MODEL_SHAPES))}, got {dataset!r}")
    return functools.partial(_linear, *_MODEL_SHAPES[dataset])


def _linear(features: int, classes: int):
    from torch import nn

    return nn.Linear(features, classes)


def partition(labels: np.ndarray, num_clients: int, split: str, seed: int = 0,
              dirichlet_alpha: float = 0.5) -> np.ndarray:
    """Share the records out across clients.

    Args:
        labels: (N,) int labels (a 1-D array, list or CPU tensor of integers).
        num_clients: M, an int in [1, N].
        split: "iid", "label" or "dirichlet" (Dirichlet(α) label proportions).
        seed: of the split.
        dirichlet_alpha: α, a finite number > 0, used by split "dirichlet" (checked for every split).
    Returns:
        (N,) int64 client index 0..M−1 of each record.
    Raises:
        TypeError for labels that are not integers; ValueError for labels that are not 1-D, an unknown
        split, a bad ``num_clients`` or α, or if a client would get no record.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(map(repr, SPLITS))}, got {split!r}")
    check_int("clients", num_clients, 1)
    check_int("seed", seed, 0)
    # α is checked whatever the split: a bad value given with another split is a mistake, not a no-op
    check_positive("dirichlet_alpha", dirichlet_alpha)
    labels = _check_labels(labels)
    n = labels.shape[0]
    if num_clients > n:
        raise ValueError(f"clients={num_clients} is more than the {n} training records: a client would have no data")
    rng = np.random.default_rng([0xDA7A, int(seed)])
    owner = np.empty(n, dtype=np.int64)
    if split == "iid":
        for k, part in enumerate(np.array_split(rng.permutation(n), num_clients)):
            owner[part] = k
    elif split == "label":
        by_label = np.lexsort((rng.random(n), labels))      # sorted by label, ties in random order
        shards = np.array_split(by_label, 2 * num_clients)
        for j, shard in enumerate(rng.permutation(2 * num_clients)):
            owner[shards[shard]] = j // 2
    else:
        for c in np.unique(labels):
            members = rng.permutation(np.flatnonzero(labels == c))
            shares = rng.dirichlet(np.full(num_clients, float(dirichlet_alpha)))
            cuts = np.round(np.cumsum(shares)[:-1] * members.shape[0]).astype(int)
            for k, part in enumerate(np.split(members, cuts)):
                owner[part] = k
    sizes = np.bincount(owner, minlength=num_clients)
    if (sizes == 0).any():
        empty = np.flatnonzero(sizes == 0).tolist()
        raise ValueError(f"split={split!r} leaves client(s) {empty} with no data; use fewer clients, "
                         "another seed, or a larger dirichlet_alpha")
    return owner


def _check_labels(labels) -> np.ndarray:
    """(N,) integer class labels as an array; refused by name before numpy fails on them deep in a split."""
    try:
        arr = np.asarray(labels)
    except (TypeError, ValueError):   # ragged lists
        raise TypeError(f"labels must be a 1-D array of integer class labels, got {type(labels).__name__}") from None
    if arr.ndim != 1:
        raise ValueError(f"labels must be 1-D (one class label per record), got shape {arr.shape}")
    if arr.dtype.kind not in "iu":   # not floats (2.5), booleans or strings
        raise TypeError(f"labels must be integer class labels, got dtype {arr.dtype}")
    return arr


def load_federated(dataset: str = "digits", clients: int = 5, split: str = "iid", *, seed: int = 0,
                   dirichlet_alpha: float = 0.5, test_fraction: float = 0.2) -> FederatedData:
    """Load a dataset for a federation.

    Args:
        dataset: "digits" or "breast_cancer".
        clients: M.
        split, seed, dirichlet_alpha: as in :func:`partition` (``seed`` also seeds the train/test split).
        test_fraction: the share of records in the stratified test set, in (0, 1).
    Returns:
        ``FederatedData``: training features and labels with each record's client, and the test set.
    Raises:
        ValueError for an unknown dataset, or as :func:`partition`.
    """
    import torch
    from sklearn.model_selection import train_test_split

    if dataset not in _LOADERS:
        raise ValueError(f"dataset must be one of {', '.join(map(repr, _LOADERS))}, got {dataset!r}")
    x, y, preprocess = _LOADERS[dataset]()
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y)
    if preprocess == "standardize":   # statistics of the training records only
        mean, std = x_tr.mean(0), x_tr.std(0)
        std = np.where(std > 0, std, 1.0)
        x_tr, x_te = (x_tr - mean) / std, (x_te - mean) / std
    owner = partition(y_tr, clients, split, seed=seed, dirichlet_alpha=dirichlet_alpha)
    as_x = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    return FederatedData(dataset, as_x(x_tr), torch.tensor(y_tr, dtype=torch.int64), as_x(x_te),
                         torch.tensor(y_te, dtype=torch.int64), owner, int(clients), int(np.unique(y).shape[0]))
