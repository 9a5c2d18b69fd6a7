"""The typed contract between the control plane and the workers (training.contract)."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest

from training.contract import (
    DrillEventKind,
    Env,
    Event,
    EventKind,
    JsonlTail,
    Result,
    RunFiles,
    Summary,
    WorkerIdentity,
    append_jsonl,
    open_append,
    read_events,
    read_jsonl,
)
from training.contract.events import CheckpointCommitted, Fault, Start, payload_fields

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("orchestrator", "training", "bench")
ENV_NAMES = {v for k, v in vars(Env).items() if k.isupper() and isinstance(v, str)}
EVENT_NAMES = {k.value for k in EventKind} | {k.value for k in DrillEventKind}
# Calls whose first argument is an event kind.
EVENT_CALLS = {"on_event", "write", "event", "of", "_event", "emit"}


def _docstring_nodes(tree: ast.AST) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _literal_offences(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = _docstring_nodes(tree)
    found: list[str] = []

    def where(node: ast.AST) -> str:
        return f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"

    def event_literal(node: ast.AST | None) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in EVENT_NAMES:
            return node.value
        return None

    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
            and (node.value in ENV_NAMES or node.value.startswith("TORCHRIG_"))
        ):
            found.append(f"{where(node)}: env var {node.value!r}")
        if isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                if name := event_literal(operand):
                    found.append(f"{where(node)}: event {name!r} compared")
                if isinstance(operand, (ast.Tuple, ast.List, ast.Set)):
                    for elt in operand.elts:
                        if name := event_literal(elt):
                            found.append(f"{where(node)}: event {name!r} compared")
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if fname in EVENT_CALLS and (name := event_literal(node.args[0])):
                found.append(f"{where(node)}: event {name!r} passed to {fname}()")
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == "event" and (name := event_literal(value)):
                    found.append(f"{where(node)}: event {name!r} in a dict")
    return found


def test_no_module_spells_an_env_var_or_event_name_outside_the_contract() -> None:
    offences: list[str] = []
    for package in CHECKED:
        for path in sorted((ROOT / package).rglob("*.py")):
            if (ROOT / "training" / "contract") in path.parents:
                continue
            offences += _literal_offences(path)
    assert not offences, "use training.contract (Env / EventKind / DrillEventKind):\n" + "\n".join(offences)


def test_the_literal_check_catches_each_kind_of_offence(tmp_path: Path) -> None:
    bad = ROOT / "bench" / "_contract_probe_tmp.py"
    bad.write_text(
        'import os\nos.environ.get("TORCHRIG_RUN_DIR")\nx = {"event": "restore"}\n'
        'if x["event"] == "first_step":\n    pass\nsink.on_event("watchdog", step=1)\n'
    )
    try:
        offences = _literal_offences(bad)
    finally:
        bad.unlink()
    assert len(offences) == 4, offences


def test_training_contract_imports_only_the_standard_library() -> None:
    import sys

    for path in (ROOT / "training" / "contract").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or name.startswith("training.contract"), (path.name, name)


# -- identity -------------------------------------------------------------------------------------
def test_identity_from_torchrun_variables() -> None:
    env = {
        Env.RANK: "3",
        Env.WORLD_SIZE: "4",
        Env.LOCAL_RANK: "1",
        Env.LOCAL_WORLD_SIZE: "2",
        Env.GROUP_RANK: "1",
        Env.RESTART_COUNT: "2",
        Env.RUN_ID: "job-1",
    }
    ident = WorkerIdentity.from_env(env, job="j", run_dir="/r")
    assert (ident.rank, ident.world_size, ident.local_rank, ident.node_rank, ident.num_nodes) == (3, 4, 1, 1, 2)
    assert (ident.generation, ident.run_id, ident.job, ident.run_dir) == (2, "job-1", "j", "/r")
    assert not ident.is_leader


def test_identity_one_process_per_pod_and_elastic_range() -> None:
    ident = WorkerIdentity.from_env({Env.RANK: "2", Env.WORLD_SIZE: "3", Env.PET_NNODES: "1:4"})
    assert (ident.local_world_size, ident.num_nodes, ident.node_rank, ident.local_rank) == (1, 3, 2, 0)


def test_identity_without_launcher_is_a_single_process() -> None:
    ident = WorkerIdentity.from_env({})
    assert (ident.rank, ident.world_size, ident.generation, ident.run_id) == (0, 1, 0, "")
    assert ident.is_leader


@pytest.mark.parametrize(
    "env", [{Env.RANK: "x"}, {Env.RANK: "2", Env.WORLD_SIZE: "2"}, {Env.LOCAL_RANK: "3", Env.LOCAL_WORLD_SIZE: "2"}]
)
def test_identity_rejects_malformed_variables(env: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        WorkerIdentity.from_env(env)


# -- files and events ----------------------------------------------------------------------------
def test_run_files_layout_takes_str_and_path(tmp_path: Path) -> None:
    files = RunFiles(str(tmp_path))
    assert files == RunFiles(tmp_path)
    assert files.events == tmp_path / "events.jsonl"
    assert files.node_log(2) == tmp_path / "logs" / "node2.log"
    assert files.checkpoints == tmp_path / "checkpoints"


def test_events_round_trip_through_the_one_writer_and_reader(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    fd = open_append(path)
    try:
        for t, payload in [
            (2.0, CheckpointCommitted(step=10, blocked_s=0.01, save_s=0.2, stores_ok=["a"])),
            (1.0, Start(pid=7, world_size=2, node_rank=0, local_rank=1)),
            (3.0, Fault(fault="kill", step=12, pid=9)),
        ]:
            append_jsonl(fd, {"time": t, "rank": 1, "generation": 0, "event": payload.kind, **payload_fields(payload)})
        os.write(fd, b'{"time": 4.0, "event": "sta')  # a writer killed mid-line
    finally:
        os.close(fd)
    events = read_events(path)
    assert [e.kind for e in events] == [EventKind.START, EventKind.CHECKPOINT_COMMITTED, EventKind.FAULT]
    assert events[1].step == 10 and events[1].get("stores_ok") == ["a"]
    assert events[2].get("kind") == "kill" and "seconds" not in events[2].data
    assert json.loads(path.read_text().splitlines()[0])["event"] == "checkpoint_committed"
    assert Event.from_dict(events[0].to_dict()) == events[0]


def test_unknown_event_kinds_survive_as_strings() -> None:
    event = Event.from_dict({"time": 1, "event": "from_a_newer_worker", "rank": "?", "x": 1})
    assert event.kind == "from_a_newer_worker" and event.rank == 0 and event.data == {"x": 1}


def test_jsonl_tail_returns_only_complete_new_lines(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"a": 1}\n{"b"')
    tail = JsonlTail(path)
    assert tail.read_new() == [{"a": 1}]
    with path.open("a") as fh:
        fh.write(": 2}\nnot json\n[1]\n")
    assert tail.read_new() == [{"b": 2}]
    assert tail.read_new() == []
    assert read_jsonl(path) == [{"a": 1}, {"b": 2}]


# -- records ---------------------------------------------------------------------------------------
def test_result_and_summary_round_trip_and_tolerate_other_versions(tmp_path: Path) -> None:
    result = Result(steps=5, final_loss=0.5, eval={"accuracy": 0.9}, params_sha256="ab", world_size=2)
    result.write(tmp_path / "result.json")
    assert Result.read(tmp_path / "result.json") == result
    assert Result.from_dict({"steps": 1, "added_later": True}).steps == 1
    assert Result.read(tmp_path / "missing.json") is None

    summary = Summary(
        status="succeeded",
        steps=5,
        checkpoints=[
            {"name": "a", "uri": "file:///a", "last_committed_step": 4},
            {"name": "b", "uri": "file:///b", "last_committed_step": None},
        ],
    )
    summary.write(tmp_path / "summary.json")
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert "reason" not in on_disk and on_disk["status"] == "succeeded"
    assert Summary.read(tmp_path / "summary.json") == summary
    assert summary.last_checkpoint() == {"name": "a", "uri": "file:///a", "last_committed_step": 4}
    assert Summary.from_dict({}).status == "unknown"
