"""What makes a resumed run bit-identical to an uninterrupted one.

Model init is seeded by `training.seed` alone, per-step randomness by (seed, step, rank), the data
order by (seed, epoch) and a global cursor (`training.data`), and the learning rate is a pure function
of (step, world size, config) (`training.optim.lr_at`). Nothing random lives only in process
memory, so a run killed and resumed from a checkpoint at the same world size ends bit-identical to an
uninterrupted one.
"""

from __future__ import annotations

import os
import sys

import torch

__all__ = ["configure_determinism", "seed_step_rng", "step_seed"]


def step_seed(seed: int, step: int, rank: int) -> int:
    """Seed of the RNG for (seed, step, rank): dropout and any other per-step randomness."""
    return (seed * 1_000_003 + step * 65_537 + rank) % (2**63 - 1)


def seed_step_rng(seed: int, device: torch.device) -> None:
    """Seed the generators a step draws from (dropout etc.): the CPU default generator, and the current
    CUDA device's on GPU.

    Not `torch.manual_seed`: on a machine where CUDA is not initialised it queues a lazy seeding call
    with a captured stack trace for every device backend, about 1 ms per call here (20% of a small
    model's step) and a queue that grows every step.
    """
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)  # CUDA is initialised by now: applied at once, nothing queued


def configure_determinism(deterministic: bool) -> None:
    """`training.deterministic`: deterministic kernels only (set before CUDA initialises)."""
    if not deterministic:
        return
    # cuBLAS needs a fixed workspace for deterministic GEMMs; must be set before CUDA initialises.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if "torch._inductor.config" in sys.modules:
        torch.use_deterministic_algorithms(True)
    else:
        # `use_deterministic_algorithms` also imports torch._inductor only to set its config flag:
        # 1.7 s at every worker start (every recovery). Inductor reads the same flag from this
        # variable when (if ever) a task compiles something.
        os.environ.setdefault("TORCHINDUCTOR_DETERMINISTIC", "1")
        torch._C._set_deterministic_algorithms(True, warn_only=False)
    torch.backends.cudnn.benchmark = False
