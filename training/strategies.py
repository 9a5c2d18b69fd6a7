"""Parallelism from `spec.training`: DDP, FSDP2, HSDP, mixed precision, activation checkpointing,
gradient accumulation and clipping, and the DDP wrapper's life through an in-place recovery.

The time the wrappers spend in collectives is measured by `training.comm_timing`; the optimizer and the
learning-rate schedule are `training.optim`'s. Everything here runs on CPU/gloo as well as on GPU/nccl.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from training.comm_timing import CommTimer, time_fsdp_comms, timed_allreduce_hook
from training.config import Precision, Strategy, TrainingConfig
from training.contract import WorkerIdentity

__all__ = [
    "Parallel",
    "clip_grad_norm",
    "ddp_bucket_order",
    "ddp_wrap",
    "forget_dtensor_plans",
    "parallelize",
    "rewrap_ddp",
    "unwrap_ddp",
]

log = logging.getLogger(__name__)


@dataclass
class Parallel:
    """A model wrapped for its strategy, and how to run a micro-step with it.

    Attributes:
        model: The wrapped module to train (DDP, FSDP2 root, or the plain module at world size 1).
        module: The unwrapped module (same object for FSDP2, which wraps in place).
        strategy: What was applied.
        comm: Times the gradient collectives.
        scaler: Gradient scaler for fp16, else None.
        mesh: The FSDP/HSDP device mesh, else None.
    """

    model: nn.Module
    module: nn.Module
    strategy: Strategy
    device: torch.device
    precision: Precision
    comm: CommTimer = field(default_factory=CommTimer)
    scaler: torch.amp.GradScaler | None = None
    mesh: Any = None
    # DDP: the order (indices into DDP's module-order parameter list) its buckets were rebuilt to after
    # the first step; a wrapper made later (in-place recovery) starts from it (`ddp_wrap`).
    bucket_order: list[int] | None = None

    @contextlib.contextmanager
    def micro_step(self, sync: bool) -> Iterator[None]:
        """Context of one forward/backward; `sync=False` skips the gradient collective (accumulation)."""
        with contextlib.ExitStack() as stack:
            if isinstance(self.model, nn.parallel.DistributedDataParallel):
                if not sync:
                    stack.enter_context(self.model.no_sync())
            elif self.strategy is not Strategy.ddp:
                self.model.set_requires_gradient_sync(sync)  # type: ignore[operator]
            if self.strategy is Strategy.ddp and self.precision is not Precision.fp32:
                dtype = torch.bfloat16 if self.precision is Precision.bf16 else torch.float16
                stack.enter_context(torch.autocast(self.device.type, dtype=dtype))
            yield

    def eval_model(self) -> nn.Module:
        """The module to evaluate with: DDP's inner module (no buffer broadcast), FSDP's root (its
        forward all-gathers the shards, so every rank must run the same number of eval batches)."""
        return self.module if isinstance(self.model, nn.parallel.DistributedDataParallel) else self.model

    def eval_autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.strategy is Strategy.ddp and self.precision is not Precision.fp32:
            dtype = torch.bfloat16 if self.precision is Precision.bf16 else torch.float16
            return torch.autocast(self.device.type, dtype=dtype)
        return contextlib.nullcontext()


def parallelize(
    model: nn.Module,
    blocks: Sequence[nn.Module],
    cfg: TrainingConfig,
    identity: WorkerIdentity,
    device: torch.device,
    *,
    bucket_order: list[int] | None = None,
    in_sync: bool = False,
) -> Parallel:
    """Apply activation checkpointing, then the strategy and its mixed precision, to `model` (in place).

    Args:
        model: The task's model, on the CPU in float32, identically initialised on every rank.
        blocks: The task's repeated blocks (FSDP units, activation-checkpointing units).
        cfg: `spec.training`.
        identity: This rank's coordinates (HSDP mesh shape: num_nodes x local_world_size).
        device: Where to train.
        bucket_order: DDP: the bucket layout of an earlier wrapper of this model (`Parallel.bucket_order`).
        in_sync: DDP: every rank's `model` already holds the same bytes (a spare after the in-place state
            transfer), so DDP skips its construction-time check and broadcast (`init_sync`).
    """
    model.to(device)
    if cfg.activation_checkpointing:
        if not blocks:
            log.warning("activationCheckpointing: the task exposes no blocks; nothing is recomputed")
        # The composable API keeps parameter names unchanged (checkpoint_wrapper would add a prefix),
        # so checkpoints stay loadable with activation checkpointing switched on or off.
        from torch.distributed._composable import checkpoint  # type: ignore[attr-defined]

        for block in blocks:
            checkpoint(block)

    par = Parallel(
        model=model,
        module=model,
        strategy=cfg.strategy,
        device=device,
        precision=cfg.precision,
        bucket_order=bucket_order,
    )
    if cfg.strategy is Strategy.ddp:
        if cfg.precision is Precision.fp16:
            par.scaler = torch.amp.GradScaler(device.type)
        if identity.world_size > 1:
            par.model = ddp_wrap(par, init_sync=not in_sync)
        return par

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    forget_dtensor_plans()

    if cfg.strategy is Strategy.hsdp:
        mesh = init_device_mesh(
            device.type, (identity.num_nodes, identity.local_world_size), mesh_dim_names=("replicate", "shard")
        )
    else:
        mesh = init_device_mesh(device.type, (identity.world_size,), mesh_dim_names=("shard",))
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if cfg.precision is Precision.bf16
        else MixedPrecisionPolicy()
    )
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    time_fsdp_comms(model, par.comm)
    par.mesh = mesh
    return par


class _OrderedDDP(nn.parallel.DistributedDataParallel):
    """DDP whose reducer takes the parameters in a given order, so that its first buckets are the ones
    an earlier wrapper of the same model rebuilt to.

    DDP lays its first buckets out in module order and, after the first step, rebuilds them once in the
    order the gradients became ready. With 3+ ranks the sum of an element in gloo's ring all-reduce
    depends on its offset in the bucket, so a wrapper made mid-run (in-place recovery) would compute
    its first step with different rounding than the run it continues (measured: 1.5e-8 apart after
    one such step at 4 ranks; bit-identical with the order carried over).
    """

    def __init__(self, module: nn.Module, order: list[int], **kwargs: Any) -> None:
        object.__setattr__(self, "_torchrig_order", order)
        super().__init__(module, **kwargs)

    def _build_params_for_reducer(self) -> tuple[list[nn.Parameter], list[bool]]:
        params, sparse = super()._build_params_for_reducer()  # type: ignore[no-untyped-call]
        order: list[int] = object.__getattribute__(self, "_torchrig_order")
        if sorted(order) != list(range(len(params))):
            log.warning("DDP: the carried-over bucket order does not fit this model; using module order")
            return params, sparse
        return [params[i] for i in order], [sparse[i] for i in order]


def ddp_bucket_order(ddp: nn.Module) -> list[int] | None:
    """The parameter order of `ddp`'s buckets once it rebuilt them (indices into DDP's module-order
    parameter list), else None (not DDP, not rebuilt yet, or a torch without the private accessors)."""
    if not isinstance(ddp, nn.parallel.DistributedDataParallel) or not getattr(ddp, "_has_rebuilt_buckets", False):
        return None
    try:
        params, _ = nn.parallel.DistributedDataParallel._build_params_for_reducer(ddp)  # type: ignore[no-untyped-call]
        index = {id(p): i for i, p in enumerate(params)}
        order = [index[id(p)] for b in ddp.reducer._get_zeros_like_grad_buckets() for p in b.parameters()]
    except Exception:
        log.debug("DDP: could not read the rebuilt bucket order", exc_info=True)
        return None
    return order if sorted(order) == list(range(len(params))) else None


def ddp_wrap(par: Parallel, *, init_sync: bool = True) -> nn.Module:
    """`par.module` in DDP over the current default group, its gradient all-reduce timed by `par.comm`;
    its buckets laid out as `par.bucket_order` when an earlier wrapper recorded one. `init_sync=False`
    skips DDP's construction-time shape check and broadcast of the module's state from rank 0: only
    where every rank is known to hold the same bytes (after the in-place state transfer)."""
    device_ids = [par.device.index] if par.device.type == "cuda" else None
    ddp = (
        _OrderedDDP(par.module, par.bucket_order, device_ids=device_ids, init_sync=init_sync)
        if par.bucket_order is not None
        else nn.parallel.DistributedDataParallel(par.module, device_ids=device_ids, init_sync=init_sync)
    )
    ddp.register_comm_hook(None, timed_allreduce_hook(par.comm))
    return ddp


def unwrap_ddp(par: Parallel) -> None:
    """Drop `par.model`'s DDP wrapper (in-place recovery, before its group is destroyed): its autograd
    hooks on the parameters are removed, so nothing keeps the wrapper, its reducer or its process group
    alive (a reference would keep the broken group's sockets open)."""
    old, par.model = par.model, par.module
    par.bucket_order = ddp_bucket_order(old) or par.bucket_order
    if isinstance(old, nn.parallel.DistributedDataParallel):
        # Now, not when the garbage collector gets to it (about a second here): the hooks would fire
        # into the destroyed group in the next backward.
        old._remove_autograd_hooks()  # type: ignore[no-untyped-call]
        for handle in old._accum_grad_hooks:
            handle.remove()
        old._accum_grad_hooks.clear()


def rewrap_ddp(par: Parallel) -> None:
    """Wrap `par.module` in a new DDP over the new default group (in-place recovery).

    The old wrapper's reducer belongs to the destroyed group and its autograd hooks sit on the
    parameters: they are removed first, so only the new reducer runs in backward.
    """
    unwrap_ddp(par)
    par.comm = CommTimer()
    # `InPlaceGroup.sync_state` just gave every member the source's exact bytes: DDP's own broadcast of
    # them (and its shape check, an all-gather) would repeat that on the recovery's path.
    par.model = ddp_wrap(par, init_sync=False)


def forget_dtensor_plans() -> None:
    """Drop DTensor's cached sharding and redistribution plans before a mesh is built.

    The plans are cached by `DeviceMesh` equality, which compares ranks and shape but not the process
    groups: after in-place recovery re-forms the group, the new generation's mesh equals the old one,
    and a cached plan hands back the old mesh, whose dimension groups were destroyed. A 1-D FSDP mesh
    survives that (its group is the default one, always named "0"); HSDP's 2-D mesh does not ("Could not
    resolve the process group registered under the name 3" in the first step after the recovery). The
    sharding cache is per thread: this clears the training thread's, where every DTensor op runs.
    """
    from torch.distributed.tensor import _redistribute, debug

    # Python's cache and the C++ dispatch fast path's (torch >= 2.9; older builds have only the first).
    clear: Any = getattr(debug, "_clear_sharding_prop_cache", None) or debug._clear_python_sharding_prop_cache
    clear()
    transforms: Any = getattr(_redistribute, "_gen_transform_infos", None)
    if hasattr(transforms, "cache_clear"):
        transforms.cache_clear()


def clip_grad_norm(par: Parallel, max_norm: float) -> float:
    """Clip the global gradient norm and return it (before clipping).

    Under FSDP2 the gradients are DTensor shards; `clip_grad_norm_` reduces their partial norms across
    the mesh, so the norm is the one of the full gradient (checked against a single process in the
    equivalence tests).
    """
    norm = torch.nn.utils.clip_grad_norm_(par.model.parameters(), max_norm)
    full = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    return float(full)
