"""The worker runtime's pure parts: Task loading, launcher detection, the LR schedule, drill faults."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from training.config import LrScheduleConfig
from training.contract import WorkerIdentity
from training.determinism import step_seed
from training.faults import Fault, FaultInjector, parse_faults
from training.metrics.base import MetricsSink
from training.optim import lr_at
from training.state import params_sha256
from training.task import Task, TaskBase, TaskLoadError, load_task


class _MinimalTask:
    """Duck-typed: only the three required members."""

    def build_model(self) -> nn.Module:
        return nn.Linear(2, 2)

    def train_dataset(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.zeros(2), torch.tensor(0))]

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return model(batch[0]).sum()


def minimal_task() -> _MinimalTask:
    return _MinimalTask()


def not_a_task(size: int = 1) -> object:
    return object()


# --- Task loading ---------------------------------------------------------------------------------


def test_examples_load_as_tasks() -> None:
    digits = load_task("training.examples.digits:task", {"hidden": 16})
    assert isinstance(digits, Task)
    gpt = load_task("training.examples.tinygpt:task", {"dim": 16, "layers": 2, "heads": 2, "seq_len": 8})
    model = gpt.build_model()
    assert len(gpt.blocks(model)) == 2
    assert gpt.tokens_per_sample() == 8
    assert gpt.flops_per_sample() > 6 * 8 * sum(p.numel() for p in gpt.blocks(model)[0].parameters())


def test_duck_typed_task_gets_defaults() -> None:
    task = load_task(f"{__name__}:minimal_task")
    model = task.build_model()
    assert task.eval_dataset() is None
    assert task.blocks(model) == []
    assert task.tokens_per_sample() == 0
    assert task.collate([(torch.ones(2), torch.tensor(1))])[0].shape == (1, 2)


@pytest.mark.parametrize(
    ("entrypoint", "args", "match"),
    [
        ("no.such.module:task", {}, r"task.entrypoint: cannot import 'no.such.module'"),
        ("training.examples.digits:nope", {}, r"task.entrypoint: .* has no callable 'nope'"),
        ("training.examples.digits:task", {"bogus": 1}, r"task.args: .*bogus"),
        (f"{__name__}:not_a_task", {}, r"task.entrypoint: .* without build_model, train_dataset, loss"),
    ],
)
def test_bad_entrypoints_name_the_field(entrypoint: str, args: dict[str, int], match: str) -> None:
    with pytest.raises(TaskLoadError, match=match):
        load_task(entrypoint, args)


def test_default_evaluate_and_summarize_average_per_sample() -> None:
    class T(TaskBase):
        def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return batch[0].mean()

    out = T().evaluate(nn.Identity(), (torch.full((4,), 2.0), torch.zeros(4)))
    assert float(out["loss"]) == 8.0 and out["count"] == 4.0
    assert T().summarize({"loss": 8.0 + 3.0, "count": 5.0}) == {"loss": 11.0 / 5.0, "count": 5.0}


def test_digits_split_is_deterministic_and_standardised() -> None:
    a, b = load_task("training.examples.digits:task"), load_task("training.examples.digits:task")
    xa, ya = a.train_dataset()[17]
    xb, yb = b.train_dataset()[17]
    assert torch.equal(xa, xb) and int(ya) == int(yb)
    train = a.train_dataset()
    held = a.eval_dataset()
    assert held is not None
    assert len(train) + len(held) == 1797  # type: ignore[arg-type]
    xs = torch.stack([train[i][0] for i in range(len(train))])  # type: ignore[arg-type]
    assert xs.mean().abs() < 1e-3
    assert xs.abs().max() < 50  # no exploding constant-pixel features


def test_tinygpt_corpus_is_deterministic() -> None:
    task = load_task("training.examples.tinygpt:task", {"dim": 16, "layers": 1, "heads": 2, "seq_len": 16})
    x, y = task.train_dataset()[3]
    assert x.shape == (16,) and torch.equal(x[1:], y[:-1])
    again = load_task("training.examples.tinygpt:task", {"dim": 16, "layers": 1, "heads": 2, "seq_len": 16})
    assert torch.equal(again.train_dataset()[3][0], x)


# --- launcher detection ---------------------------------------------------------------------------


def detect(env: dict[str, str]) -> WorkerIdentity:
    """The identity the launcher's variables give (without the host name, which tests do not set)."""
    return dataclasses.replace(WorkerIdentity.from_env(env), node="")


def test_no_launcher_is_a_single_process() -> None:
    assert detect({}) == WorkerIdentity()


def test_torchrun_variables() -> None:
    env = {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "TORCHELASTIC_RESTART_COUNT": "3",
    }
    assert detect(env) == WorkerIdentity(
        rank=5, world_size=8, local_rank=1, local_world_size=4, node_rank=1, num_nodes=2, generation=3
    )


def test_pytorchjob_one_process_per_pod() -> None:
    # The operator without torchrun: RANK/WORLD_SIZE per pod, no LOCAL_* variables.
    assert detect({"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "x", "MASTER_PORT": "1"}) == WorkerIdentity(
        rank=2, world_size=3, local_rank=0, local_world_size=1, node_rank=2, num_nodes=3
    )


def test_pet_variables_and_elastic_range() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "PET_NPROC_PER_NODE": "2", "PET_NNODES": "1:4"}
    got = detect(env)
    assert (got.local_world_size, got.num_nodes, got.node_rank) == (2, 2, 1)


def test_malformed_variable_is_named() -> None:
    with pytest.raises(ValueError, match="WORLD_SIZE='two'"):
        detect({"WORLD_SIZE": "two"})
    with pytest.raises(ValueError, match="outside world size"):
        detect({"RANK": "2", "WORLD_SIZE": "2"})


# --- learning rate --------------------------------------------------------------------------------


def test_lr_warmup_cosine_and_world_size_scaling() -> None:
    sched = LrScheduleConfig(
        warmup_steps=10, decay="cosine", min_lr_ratio=0.1, scale_with_world_size="linear", base_world_size=2
    )
    assert lr_at(0, 2, 1e-3, 100, sched) == pytest.approx(1e-4)
    assert lr_at(9, 2, 1e-3, 100, sched) == pytest.approx(1e-3)
    assert lr_at(9, 4, 1e-3, 100, sched) == pytest.approx(2e-3)  # recomputed for the new world size
    assert lr_at(99, 2, 1e-3, 100, sched) == pytest.approx(1e-4)  # minLrRatio at the last step
    sqrt = sched.model_copy(update={"scale_with_world_size": "sqrt"})
    assert lr_at(9, 8, 1e-3, 100, sqrt) == pytest.approx(2e-3)


@given(step=st.integers(0, 999), world=st.integers(1, 64))
def test_lr_is_bounded_and_pure(step: int, world: int) -> None:
    sched = LrScheduleConfig(warmup_steps=50, decay="linear", scale_with_world_size="sqrt", base_world_size=4)
    lr = lr_at(step, world, 3e-4, 1000, sched)
    assert 0.0 <= lr <= 3e-4 * math.sqrt(world / 4) + 1e-12
    assert lr == lr_at(step, world, 3e-4, 1000, sched)


# --- faults, seeds, hashes ------------------------------------------------------------------------


def test_parse_faults() -> None:
    assert parse_faults(None) == []
    got = parse_faults(
        '[{"kind": "kill", "rank": 1, "step": 8}, {"kind": "slow", "rank": 0, "step": 2, "seconds": 0.5}]'
    )
    assert got == [Fault("kill", 1, 8), Fault("slow", 0, 2, 0, 0.5)]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{", "not JSON"),
        ('{"kind": "kill"}', "must be a JSON list"),
        ('[{"kind": "melt", "rank": 0, "step": 1}]', r"TORCHRIG_FAULTS\[0\].kind"),
        ('[{"kind": "kill", "rank": 0}]', "missing field"),
        ('[{"kind": "slow", "rank": 0, "step": 1}]', "seconds"),
        ('[{"kind": "kill", "rank": 0, "step": 1, "when": 2}]', "unknown keys"),
    ],
)
def test_bad_faults_are_named(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_faults(text)


class _Events(MetricsSink):
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, object]]] = []

    def on_event(self, event: str, **fields: object) -> None:
        self.events.append((event, fields))


def test_slow_fault_selects_rank_and_generation() -> None:
    faults = [Fault("slow", 1, 3, 0, 0.25), Fault("slow", 1, 3, 1, 9.0), Fault("slow", 0, 3, 0, 9.0)]
    events = _Events()
    injector = FaultInjector(faults, rank=1, generation=0, events=events)
    assert [injector.step_delay(s) for s in (2, 3, 4)] == [0.0, 0.25, 0.25]
    assert [e for e, _ in events.events] == ["fault"]  # once, when it starts


def test_step_seed_differs_by_rank_and_step() -> None:
    seeds = {step_seed(0, s, r) for s in range(50) for r in range(8)}
    assert len(seeds) == 400


def test_params_sha256_depends_on_bytes_in_key_order() -> None:
    a = {"b": torch.ones(2), "a": torch.zeros(3, dtype=torch.bfloat16)}
    assert params_sha256(a) == params_sha256(dict(reversed(list(a.items()))))
    assert params_sha256(a) != params_sha256({**a, "b": torch.tensor([1.0, 1.0 + 2**-20])})


def test_a_spare_in_a_dead_ranks_place_leaves_out_its_predecessors_faults() -> None:
    # The spare is the same rank in the same generation and resumes at step 50, where the process it
    # replaced was killed by the kill_during_checkpoint of step 50; the later faults are its own.
    faults = [
        Fault("kill_during_checkpoint", 1, 50),
        Fault("kill", 1, 70),
        Fault("hang", 1, 80),
        Fault("slow", -1, 1, -1, 0.01),
    ]
    original = FaultInjector(faults, rank=1, generation=0, events=_Events())
    original.after_step(1)
    assert [f.kind for f in original.faults] == ["kill_during_checkpoint", "kill", "hang", "slow"]
    spare = FaultInjector(faults, rank=1, generation=0, events=_Events(), replacement=True)
    spare.after_step(51)  # its first step after the recovery
    assert [f.kind for f in spare.faults] == ["kill", "hang", "slow"], "pacing and later faults go on"
    spare.after_save_staged(100)  # would SIGKILL this test process if the step-50 fault were kept
    assert spare.step_delay(60) == 0.01
    restarted = FaultInjector(faults, rank=1, generation=0, events=_Events())
    restarted.after_step(41)  # a group restart keeps "the first save at or after the step"
    assert restarted.faults[0].kind == "kill_during_checkpoint"
