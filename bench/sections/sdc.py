"""Silent data corruption checks (`training.sdc`): what replica agreement costs, and how soon a flip is found.

- overhead: the digits job (2 ranks, DDP, gloo) with `sdc.every` at its default, with a check every step,
  and with the checks off, run side by side (interleaved, so a noisy neighbour hits all three alike); the
  wall time per step from the ranks' step records. One check's cost is the difference between every step
  and off; the default's overhead is that cost spread over `sdc.every` steps (a 1% difference is below the
  noise of one run on a shared machine, so the direct ratio is reported too but not judged);
- fingerprint: one fingerprint of the tinygpt example's DDP replica (parameters + AdamW state) against one
  of its training steps, in this process;
- detection: a `bitflip` of a parameter on rank 1 at a step that is no multiple of `sdc.every`: the time
  and the steps from the `fault` event to the `sdc` event (two replicas: the replay decides, and its time
  is in it);
- recompute: the same digits job with `sdc.recomputeEvery` off, at every step and at its default (when it
  is not off), side by side, the replica check off in all three; one recompute check's cost as a share of a
  step, and that share spread over the default; tinygpt's recomputation (one forward and backward of a
  micro-batch, `torch.autograd.grad`) against one of its steps, in this process;
- recompute detection: a `bitflip` of rank 1's local gradient before the all-reduce (`local_grad`) with a
  check every step: steps and seconds from the flip to the `sdc` event (evidence `recompute`).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import PY, run, stats, throughput_from_records
from bench.sections.base import Section

BATCH, WORLD = 32, 2
TARGET = 0.01  # the default's overhead, as a share of a step
RECOMPUTE_TARGET = 0.05  # the recompute's overhead at its default (issue 38: off by default above this)


def _seconds_per_step(
    steps: int, every: int | None, *, recompute: int = 0, faults: str | None = None, out: Path | None = None
) -> float:
    """Wall seconds per step of the digits job under torchrun with `sdc.every` = `every` (None: off) and
    `sdc.recomputeEvery` = `recompute`."""
    from bench.common import digits_spec_file
    from training.contract import Env, RunFiles, read_jsonl

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        spec = digits_spec_file(
            tmp,
            [
                f"spec.training.steps={steps}",
                f"spec.checkpoint.every.steps={max(10, steps // 4)}",
                "spec.checkpoint.saveFinal=false",
                "spec.training.evalAtEnd=false",
                "spec.metrics.logEvery=1",
                "spec.metrics.enabled=false",
                f"spec.sdc.every={0 if every is None else every}",
                f"spec.sdc.recomputeEvery={recompute}",
            ],
        )
        run_dir = RunFiles(tmp / "run")
        env = {Env.RUN_DIR: str(run_dir.root)}
        if faults is not None:
            env[Env.FAULTS] = faults
        run(
            [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD), "--max-restarts",
             "1", "--log-dir", str(tmp / "logs"), "-m", "training", "--spec", str(spec)],
            extra_env=env,
        )  # fmt: skip
        if out is not None:
            out.write_text(run_dir.events.read_text())
        records = read_jsonl(run_dir.metrics)
        return BATCH * WORLD / throughput_from_records(records, BATCH * WORLD, skip_steps=10)


def _overhead(repeats: int, steps: int, every: int) -> dict[str, Any]:
    off, each, default = [], [], []
    for _ in range(repeats):
        off.append(_seconds_per_step(steps, None))
        each.append(_seconds_per_step(steps, 1))
        default.append(_seconds_per_step(steps, every))
    per_check = [e - o for e, o in zip(each, off, strict=True)]
    check_s = statistics.median(per_check)
    step_s = statistics.median(off)
    return {
        "step_s_off": stats(off),
        "step_s_every_step": stats(each),
        "step_s_default": stats(default),
        "check_s": check_s,
        "check_ratio_of_a_step": check_s / step_s,
        "default_every": every,
        "default_overhead_ratio": max(0.0, check_s) / (every * step_s),
        "default_overhead_ratio_direct": statistics.median(d / o - 1 for d, o in zip(default, off, strict=True)),
        "target": f"<= {TARGET}",
        "steps": steps,
        "repeats": repeats,
    }


@dataclass
class _Example:
    """An example's task, model, optimizer and one batch of its size, built in this process (seed 0)."""

    task: Any
    model: Any
    optimizer: Any
    batch: Any
    params: list[Any]


def _example(name: str) -> _Example:
    import torch

    from orchestrator.loader import load_spec
    from training.optim import build_optimizer
    from training.task import load_task

    spec = load_spec(Path(__file__).resolve().parents[2] / "examples" / f"{name}.yaml")
    cfg = spec.spec.training
    task = load_task(spec.spec.task.entrypoint, spec.spec.task.args)
    torch.manual_seed(0)
    model = task.build_model()
    optimizer = build_optimizer(model, cfg.optimizer)
    dataset = task.train_dataset()
    batch = task.collate([dataset[i] for i in range(cfg.batch_size)])  # type: ignore[index]
    return _Example(task, model, optimizer, batch, [p for p in model.parameters() if p.requires_grad])


def _fingerprint_vs_step(repeats: int) -> dict[str, Any]:
    """tinygpt (its example's model and micro-batch), one process: a training step of one micro-batch (the
    example accumulates two, so a real step is longer and the share smaller) against one fingerprint."""
    import torch

    from training.sdc import fingerprint, fingerprint_tensors

    ex = _example("tinygpt-fsdp")
    task, model, optimizer, batch, params = ex.task, ex.model, ex.optimizer, ex.batch, ex.params
    device = torch.device("cpu")

    def step() -> None:
        task.loss(model, batch).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # AdamW's state exists from here on
    step_s, fp_s, rc_s = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        step_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        fingerprint(model, optimizer, device)
        fp_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()  # what `RecomputeCheck.recompute` adds: a neighbour's forward and backward
        grads = torch.autograd.grad(task.loss(model, batch), params)
        fingerprint_tensors(grads, device)
        rc_s.append(time.perf_counter() - t0)
    words = sum(p.numel() for p in model.parameters()) * 3  # parameters + two AdamW moments (float32 words)
    return {
        "model_words": words,
        "step_s": stats(step_s)["median"],
        "fingerprint_s": stats(fp_s)["median"],
        "fingerprint_ratio_of_a_step": stats(fp_s)["median"] / stats(step_s)["median"],
        "fingerprint_ns_per_word": stats(fp_s)["median"] / words * 1e9,
        "recompute_s": stats(rc_s)["median"],
        "recompute_ratio_of_a_step": stats(rc_s)["median"] / stats(step_s)["median"],
    }


def _recompute_overhead(repeats: int, steps: int, default: int) -> dict[str, Any]:
    """The digits job with `sdc.recomputeEvery` off, 1 and `default` (when on), interleaved; the replica
    check off in all of them."""
    off, each, at_default = [], [], []
    for _ in range(repeats):
        off.append(_seconds_per_step(steps, None))
        each.append(_seconds_per_step(steps, None, recompute=1))
        if default > 0:
            at_default.append(_seconds_per_step(steps, None, recompute=default))
    check_s = statistics.median(e - o for e, o in zip(each, off, strict=True))
    step_s = statistics.median(off)
    out: dict[str, Any] = {
        "step_s_off": stats(off),
        "step_s_every_step": stats(each),
        "check_s": check_s,
        "check_ratio_of_a_step": check_s / step_s,
        "every_step_overhead_ratio_direct": statistics.median(e / o - 1 for e, o in zip(each, off, strict=True)),
        "default_every": default,
        "target": f"<= {RECOMPUTE_TARGET}",
        "steps": steps,
        "repeats": repeats,
    }
    if default > 0:
        out["step_s_default"] = stats(at_default)
        out["default_overhead_ratio"] = max(0.0, check_s) / (default * step_s)
        out["default_overhead_ratio_direct"] = statistics.median(
            d / o - 1 for d, o in zip(at_default, off, strict=True)
        )
    return out


def _recompute_vs_step_digits(repeats: int) -> dict[str, Any]:
    """The digits model (its example's size and batch), one process: a training step against what a recompute
    check adds (a forward and backward with `torch.autograd.grad`, and the fingerprint of the gradients).
    Robust where the side-by-side runs drown in a loaded machine's noise: no scheduling, no all-gather."""
    import torch

    from training.sdc import fingerprint_tensors

    ex = _example("digits-ddp")
    task, model, optimizer, batch, params = ex.task, ex.model, ex.optimizer, ex.batch, ex.params
    device = torch.device("cpu")
    step_s, rc_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        task.loss(model, batch).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        fingerprint_tensors(torch.autograd.grad(task.loss(model, batch), params), device)
        rc_s.append(time.perf_counter() - t0)
    return {
        "step_s": stats(step_s)["median"],
        "recompute_s": stats(rc_s)["median"],
        "recompute_ratio_of_a_step": stats(rc_s)["median"] / stats(step_s)["median"],
    }


def _detection(steps: int, every: int, flip_step: int, *, target: str = "param", recompute: int = 0) -> dict[str, Any]:
    from training.contract import EventKind, read_events

    faults = json.dumps([{"kind": "bitflip", "rank": 1, "step": flip_step, "target": target}])
    with tempfile.TemporaryDirectory() as d:
        events_path = Path(d) / "events.jsonl"
        _seconds_per_step(steps, every, recompute=recompute, faults=faults, out=events_path)
        events = read_events(events_path)
    flip = next(e for e in events if e.kind == EventKind.FAULT and e.get("kind") == "bitflip")
    found = next(e for e in events if e.kind == EventKind.SDC and e.time >= flip.time)
    return {
        "every": every,
        "flip_step": flip.step,
        "detected_step": found.step,
        "steps_to_detection": (found.step or 0) - (flip.step or 0),
        "seconds_to_detection": round(found.time - flip.time, 4),
        "suspects": found.get("suspects"),
        "decided": found.get("decided"),
        "evidence": found.get("evidence"),
        "detail": found.get("detail"),
    }


class _Bucket:
    """DDP's `GradBucket` as the trail reads it: its parameters and their gradients."""

    def __init__(self, params: list[Any]) -> None:
        self._params = params

    def parameters(self) -> list[Any]:
        return self._params

    def gradients(self) -> list[Any]:
        return [p.grad for p in self._params]


def _trail_vs_step(example: str, repeats: int) -> dict[str, Any]:
    """The gradient trail of two-replica jobs (`training.sdc_replay.GradientTrail`, every step): one
    process, a training step of the example's model and batch against the trail's begin, capture of every
    gradient and end (what DDP's communication hook adds to each step). In process for the same reason as
    `_recompute_vs_step_digits`: a per-step cost of a few percent drowns in a loaded machine's side-by-side noise."""
    import torch

    from training.sdc_replay import GradientTrail

    ex = _example(example)
    task, model, optimizer, batch, params = ex.task, ex.model, ex.optimizer, ex.batch, ex.params
    trail = GradientTrail(params, torch.device("cpu"))
    step_s, trail_s = [], []
    for step in range(1, repeats + 1):
        t0 = time.perf_counter()
        task.loss(model, batch).backward()  # type: ignore[no-untyped-call]
        step_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        trail.begin(step)
        trail.capture(_Bucket(params))
        trail.end()
        trail_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_s[-1] += time.perf_counter() - t0
        trail.forget_through(step)
    return {
        "step_s": stats(step_s)["median"],
        "trail_s": stats(trail_s)["median"],
        "trail_ratio_of_a_step": stats(trail_s)["median"] / stats(step_s)["median"],
    }


def bench_sdc(quick: bool) -> dict[str, Any]:
    """Overhead of `sdc.every` at its default against the same job without it, and flip-to-detection."""
    from training.config import DEFAULT_SDC_EVERY, DEFAULT_SDC_RECOMPUTE_EVERY

    repeats, steps = (2, 80) if quick else (4, 200)
    return {
        "overhead": _overhead(repeats, steps, DEFAULT_SDC_EVERY),
        "fingerprint_tinygpt": _fingerprint_vs_step(2 if quick else 5),  # a CPU step of it takes seconds
        # a flip between two checks: found at the next one, and (two replicas) decided by replaying the steps since
        "detection": _detection(2 * DEFAULT_SDC_EVERY + 10, DEFAULT_SDC_EVERY, DEFAULT_SDC_EVERY + 3),
        "recompute": _recompute_overhead(repeats, steps, DEFAULT_SDC_RECOMPUTE_EVERY),
        "recompute_digits_in_process": _recompute_vs_step_digits(200 if quick else 1000),
        "recompute_detection": _detection(40, 0, 23, target="local_grad", recompute=1),
        "trail_digits_in_process": _trail_vs_step("digits-ddp", 200 if quick else 1000),
        "trail_tinygpt_in_process": _trail_vs_step("tinygpt-fsdp", 3 if quick else 8),
    }


SECTION = Section("sdc", bench_sdc)
