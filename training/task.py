"""The Task interface: what a user writes to train their model with torchrig.

A task is found through `spec.task.entrypoint` (`package.module:callable`); the callable is invoked with
`spec.task.args` as keyword arguments and returns an object satisfying `Task`. Subclassing `TaskBase`
gives every optional member a sensible default, so a minimal task is three methods::

    class MyTask(TaskBase):
        def build_model(self) -> nn.Module: ...
        def train_dataset(self) -> Dataset: ...
        def loss(self, model, batch) -> torch.Tensor: ...

    def task(**args) -> MyTask:
        return MyTask(**args)

The worker owns everything distributed: it seeds the RNG before `build_model` (so every rank builds the
same initial weights), wraps the model (DDP / FSDP2), moves batches to the device and shards the data.
A task never calls `torch.distributed` itself.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

__all__ = ["Task", "TaskBase", "TaskLoadError", "load_task"]

Batch = Any


@runtime_checkable
class Task(Protocol):
    """What the worker needs from a user's training task.

    Required: `build_model`, `train_dataset`, `loss`. Everything else has a default in `TaskBase`.
    """

    def build_model(self) -> nn.Module:
        """Build the model on the CPU in float32. Called once per rank after the RNG is seeded with
        `training.seed`, so initial weights are identical on every rank and across restarts."""
        ...

    def train_dataset(self) -> Dataset[Any]:
        """A map-style dataset (`__len__` and `__getitem__`) of training samples. Must be deterministic:
        index i is the same sample on every rank and after a restart."""
        ...

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """The mean loss of one (collated, on-device) batch, a scalar tensor with a gradient.

        The mean over the batch matters: the worker averages micro-batches and ranks, so a run at world
        size W with batch B matches one process with batch W x B."""
        ...

    def eval_dataset(self) -> Dataset[Any] | None:
        """A held-out dataset, or None for no evaluation."""
        ...

    def evaluate(self, model: nn.Module, batch: Batch) -> Mapping[str, float | torch.Tensor]:
        """Sums over one held-out batch, e.g. `{"correct": 57, "loss": 12.3, "count": 64}`.

        Return SUMS, not means, and a `count`: the worker adds them up over batches and ranks and hands
        the totals to `summarize`. Runs under `torch.no_grad()` with the model in eval mode."""
        ...

    def summarize(self, totals: Mapping[str, float]) -> dict[str, float]:
        """Turn the summed `evaluate` outputs into the reported metrics (e.g. accuracy)."""
        ...

    def collate(self, samples: list[Any]) -> Batch:
        """Combine samples into a batch (default: `torch.utils.data.default_collate`)."""
        ...

    def tokens_per_sample(self) -> int:
        """Tokens in one sample (for tokens/s); 0 when the notion does not apply."""
        ...

    def flops_per_sample(self) -> float:
        """Model FLOPs of forward + backward for one sample (for MFU); 0 when unknown."""
        ...

    def blocks(self, model: nn.Module) -> Sequence[nn.Module]:
        """The repeated blocks of `model` (e.g. transformer layers): each becomes one FSDP unit and,
        with `activationCheckpointing`, one recomputation unit. Empty: the whole model is one unit."""
        ...


class TaskBase:
    """Convenience base class: defaults for every optional member of `Task`."""

    def build_model(self) -> nn.Module:
        raise NotImplementedError("a task must implement build_model()")

    def train_dataset(self) -> Dataset[Any]:
        raise NotImplementedError("a task must implement train_dataset()")

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        raise NotImplementedError("a task must implement loss()")

    def eval_dataset(self) -> Dataset[Any] | None:
        return None

    def evaluate(self, model: nn.Module, batch: Batch) -> Mapping[str, float | torch.Tensor]:
        """Default: the summed loss of the batch (so `summarize` reports the mean held-out loss)."""
        loss = self.loss(model, batch)
        count = _batch_len(batch)
        return {"loss": loss.detach().float() * count, "count": float(count)}

    def summarize(self, totals: Mapping[str, float]) -> dict[str, float]:
        """Default: every total divided by `count` (means per sample), plus `count` itself."""
        count = totals.get("count", 0.0)
        out = {k: (v / count if count else float("nan")) for k, v in totals.items() if k != "count"}
        out["count"] = float(count)
        return out

    def collate(self, samples: list[Any]) -> Batch:
        return default_collate(samples)

    def tokens_per_sample(self) -> int:
        return 0

    def flops_per_sample(self) -> float:
        return 0.0

    def blocks(self, model: nn.Module) -> Sequence[nn.Module]:
        return []


def _batch_len(batch: Batch) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, Mapping):
        return _batch_len(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_len(batch[0])
    raise TypeError(f"cannot tell the batch size of a {type(batch).__name__}; override Task.evaluate")


class TaskLoadError(ValueError):
    """`task.entrypoint` cannot be imported or does not produce a Task."""


_REQUIRED = ("build_model", "train_dataset", "loss")


def load_task(entrypoint: str, args: Mapping[str, Any] | None = None) -> Task:
    """Import `module:callable`, call it with `args` and check the result is a usable Task.

    Optional members the object lacks are filled from `TaskBase`, so a task may be any object with the
    three required methods.

    Raises:
        TaskLoadError: with a one-line message naming `task.entrypoint` or `task.args`.
    """
    module_name, _, attr = entrypoint.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TaskLoadError(f"task.entrypoint: cannot import {module_name!r}: {exc}") from None
    factory: Callable[..., Any] | None = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise TaskLoadError(f"task.entrypoint: {module_name!r} has no callable {attr!r}")
    try:
        obj = factory(**dict(args or {}))
    except TypeError as exc:
        raise TaskLoadError(f"task.args: {entrypoint} rejected the arguments: {exc}") from None
    missing = [name for name in _REQUIRED if not callable(getattr(obj, name, None))]
    if missing:
        raise TaskLoadError(
            f"task.entrypoint: {entrypoint} returned a {type(obj).__name__} without {', '.join(missing)}"
        )
    if isinstance(obj, Task):
        return obj
    return _WithDefaults(obj)


class _WithDefaults(TaskBase):
    """Adapts a duck-typed task that implements only part of the protocol: each member is the task's
    own when it has one, else `TaskBase`'s default (explicit delegation, no attribute magic)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def _own(self, name: str) -> Callable[..., Any] | None:
        member = getattr(self._inner, name, None)
        return member if callable(member) else None

    def build_model(self) -> nn.Module:
        return self._inner.build_model()  # type: ignore[no-any-return]

    def train_dataset(self) -> Dataset[Any]:
        return self._inner.train_dataset()  # type: ignore[no-any-return]

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return self._inner.loss(model, batch)  # type: ignore[no-any-return]

    def eval_dataset(self) -> Dataset[Any] | None:
        own = self._own("eval_dataset")
        return own() if own else super().eval_dataset()

    def evaluate(self, model: nn.Module, batch: Batch) -> Mapping[str, float | torch.Tensor]:
        own = self._own("evaluate")
        return own(model, batch) if own else super().evaluate(model, batch)

    def summarize(self, totals: Mapping[str, float]) -> dict[str, float]:
        own = self._own("summarize")
        return own(totals) if own else super().summarize(totals)

    def collate(self, samples: list[Any]) -> Batch:
        own = self._own("collate")
        return own(samples) if own else super().collate(samples)

    def tokens_per_sample(self) -> int:
        own = self._own("tokens_per_sample")
        return int(own()) if own else 0

    def flops_per_sample(self) -> float:
        own = self._own("flops_per_sample")
        return float(own()) if own else 0.0

    def blocks(self, model: nn.Module) -> Sequence[nn.Module]:
        own = self._own("blocks")
        return list(own(model)) if own else []
