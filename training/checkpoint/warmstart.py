"""`checkpoint.initFrom`: warm start from another job's checkpoint when this job has none of its own.

`full` loads the whole state, as a resume would. `weights` loads only the model's weights: for every
entry of the state that is a DCP `Stateful` whose state dict has a `model` member (the worker's
`ModelOptimizerState`), or a plain entry named `model`, only that part is read from the checkpoint;
the optimizer state and the progress keep their fresh values, so training starts at step 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful

from training.checkpoint.results import CheckpointError

__all__ = ["MODEL_KEY", "weights_only"]

MODEL_KEY = "model"


def weights_only(state: dict[str, Any]) -> tuple[dict[str, Any], Callable[[], None]]:
    """The part of `state` that holds model weights, and a function applying what was loaded into it.

    Raises:
        CheckpointError: `state` has no model weights to load.
    """
    partial: dict[str, Any] = {}
    appliers: list[Callable[[], None]] = []
    for name, value in state.items():
        if isinstance(value, Stateful):
            sd = value.state_dict()
            if isinstance(sd, dict) and MODEL_KEY in sd:
                partial[name] = {MODEL_KEY: sd[MODEL_KEY]}
                appliers.append(_loader(value, sd, partial[name]))
        elif name == MODEL_KEY:
            partial[name] = value  # loaded in place
    if not partial:
        raise CheckpointError("checkpoint.initFrom mode `weights`: the training state holds no model weights")

    def apply() -> None:
        for load in appliers:
            load()

    return partial, apply


def _loader(target: Stateful, full: dict[str, Any], loaded: dict[str, Any]) -> Callable[[], None]:
    def load() -> None:
        # The rest of `full` is the target's own fresh state: only the model part changes.
        target.load_state_dict({**full, MODEL_KEY: loaded[MODEL_KEY]})

    return load
