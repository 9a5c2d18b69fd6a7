"""Handwritten digits: an MLP on scikit-learn's bundled 8x8 digits (real data, no download).

1797 images, a fixed stratified 80/20 train/held-out split, features standardised with the training
set's statistics. The default job (examples/digits-ddp.yaml) reaches >= 95% held-out accuracy on CPU in
a few seconds.

The data is the CSV file scikit-learn ships (`sklearn/datasets/data/digits.csv.gz`, what `load_digits`
reads), located without importing scikit-learn: importing it pulls in scipy and costs 1.4-1.8 s on this
class of machine, paid again by every worker after every restart (it was a third of the recovery time).
"""

from __future__ import annotations

import gzip
import importlib.util
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 - the universal alias
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from training.task import TaskBase

__all__ = ["DigitsTask", "task"]

Batch = tuple[torch.Tensor, torch.Tensor]


def load_bundled_digits() -> tuple[np.ndarray, np.ndarray]:
    """(images as float64 [n, 64], labels as int64 [n]) from scikit-learn's bundled copy of the data."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the digits example needs scikit-learn (pip install 'torchrig[examples]')")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(path, "rt") as fh:
        data = np.loadtxt(fh, delimiter=",")
    return data[:, :-1], data[:, -1].astype(np.int64)


def stratified_split(y: np.ndarray, held_out: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Train and held-out indices with every class split in the same proportion (fixed by `seed`)."""
    rng = np.random.default_rng(seed)
    labels, counts = np.unique(y, return_counts=True)
    # ceil(n * held_out) held out in total, as scikit-learn's train_test_split does, shared among the
    # classes by largest remainder so each class keeps its proportion.
    exact = counts * held_out
    per_class = np.floor(exact).astype(int)
    short = int(np.ceil(len(y) * held_out)) - int(per_class.sum())
    per_class[np.argsort(-(exact - per_class), kind="stable")[:short]] += 1
    train: list[np.ndarray] = []
    test: list[np.ndarray] = []
    for label, n_test in zip(labels, per_class, strict=True):
        idx = rng.permutation(np.flatnonzero(y == label))
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


class DigitsTask(TaskBase):
    """Classify 8x8 digit images with a 2-hidden-layer MLP.

    Args:
        hidden: Width of the hidden layers.
        dropout: Dropout after each hidden layer (randomness is reseeded per step by the worker).
        held_out: Fraction of the data held out for evaluation.
    """

    def __init__(self, hidden: int = 256, dropout: float = 0.0, held_out: float = 0.2) -> None:
        if hidden <= 0:
            raise ValueError("hidden must be > 0")
        if not 0.0 < held_out < 1.0:
            raise ValueError("held_out must be in (0, 1)")
        self.hidden = hidden
        self.dropout = dropout
        self.held_out = held_out

    @cached_property
    def _splits(self) -> tuple[TensorDataset, TensorDataset]:
        x, y = load_bundled_digits()
        train_idx, test_idx = stratified_split(y, self.held_out)
        x_train, x_test, y_train, y_test = x[train_idx], x[test_idx], y[train_idx], y[test_idx]
        mean = x_train.mean(axis=0)
        std = x_train.std(axis=0)
        # border pixels that never light up in training keep scale 1 (as StandardScaler does), else a
        # stray held-out pixel there becomes a huge input
        std[std < 1e-6] = 1.0

        def to_ds(xs: np.ndarray, ys: np.ndarray) -> TensorDataset:
            return TensorDataset(
                torch.from_numpy(((xs - mean) / std).astype(np.float32)), torch.from_numpy(ys.astype(np.int64))
            )

        return to_ds(x_train, y_train), to_ds(x_test, y_test)

    def build_model(self) -> nn.Module:
        return nn.Sequential(
            nn.Linear(64, self.hidden),
            nn.ReLU(),
            nn.Dropout(self.dropout),
            nn.Linear(self.hidden, self.hidden),
            nn.ReLU(),
            nn.Dropout(self.dropout),
            nn.Linear(self.hidden, 10),
        )

    def train_dataset(self) -> Dataset[tuple[torch.Tensor, ...]]:
        return self._splits[0]

    def eval_dataset(self) -> Dataset[tuple[torch.Tensor, ...]]:
        return self._splits[1]

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    def evaluate(self, model: nn.Module, batch: Batch) -> Mapping[str, float | torch.Tensor]:
        x, y = batch
        logits = model(x).float()
        return {
            "correct": (logits.argmax(dim=1) == y).sum(),
            "loss": F.cross_entropy(logits, y, reduction="sum"),
            "count": float(y.shape[0]),
        }

    def summarize(self, totals: Mapping[str, float]) -> dict[str, float]:
        count = totals.get("count", 0.0)
        if not count:
            return {}
        return {"accuracy": totals["correct"] / count, "loss": totals["loss"] / count, "count": count}

    def flops_per_sample(self) -> float:
        # forward 2 * weights, backward twice that
        weights = 64 * self.hidden + self.hidden * self.hidden + self.hidden * 10
        return 6.0 * weights


def task(hidden: int = 256, dropout: float = 0.0, held_out: float = 0.2) -> DigitsTask:
    """Entry point for `task.entrypoint: training.examples.digits:task`."""
    return DigitsTask(hidden=hidden, dropout=dropout, held_out=held_out)
