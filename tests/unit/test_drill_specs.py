"""A drill accepts every spec that `validate` accepts: its store isolation keeps one store per original
store (same order and name, distinct, private to the drill), and the whole drill runs on such a spec.

The end-to-end check runs `run_drill` against a fake backend that writes a scripted run directory, so
the runner, the plan and the verdict are exercised without starting processes.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.backends import BACKENDS
from orchestrator.backends.base import (
    Backend,
    Capabilities,
    DryRun,
    RunHandle,
    RunState,
    RunStatus,
    SubmitOptions,
    SupervisedRun,
)
from orchestrator.drills import DrillOptions, run_drill, runner
from orchestrator.drills.plan import DrillContext
from orchestrator.drills.scenarios import SCENARIOS
from orchestrator.drills.spec_patch import isolate_stores, revalidate, with_fallback_store
from orchestrator.errors import SpecError
from orchestrator.loader import validate_document
from orchestrator.spec import JobSpec
from tests.fixtures.common import REPO
from training.contract import Env, RunFiles, Summary, write_json

_BASE = yaml.safe_load((REPO / "examples" / "digits-ddp.yaml").read_text())
TWO_UNNAMED_ABSOLUTE = [{"uri": "file:///ckpt/a"}, {"uri": "file:///ckpt/b"}]


def _spec(stores: list[dict[str, Any]], *, steps: int = 40) -> JobSpec:
    doc = copy.deepcopy(_BASE)
    doc["spec"]["checkpoint"]["stores"] = stores
    doc["spec"]["checkpoint"]["every"] = {"steps": 10}
    doc["spec"]["training"]["steps"] = steps
    return validate_document(doc, "test")


def _ctx(spec: JobSpec) -> DrillContext:
    return DrillContext(
        scenario="test",
        seed=0,
        steps=spec.spec.training.steps,
        world_size=spec.spec.max_world_size,
        nodes=spec.spec.nodes.max,
        checkpoint_every=10,
        fault_step=23,
        fault_rank=1,
        rng=random.Random(0),
    )


_segments = st.sampled_from(["a", "b", "ckpt", "stores", "x.y", "drill-b", "checkpoints"])
_paths = st.lists(_segments, min_size=1, max_size=3).map("/".join)


@st.composite
def _store(draw: st.DrawFn) -> dict[str, Any]:
    shape = draw(st.sampled_from(["file-rel", "bare-rel", "file-abs", "bare-abs", "file-up", "s3"]))
    path = draw(_paths)
    uri = {
        "file-rel": f"file://./{path}",
        "bare-rel": path,
        "file-abs": f"file:///{path}",
        "bare-abs": f"/{path}",
        "file-up": f"file://../{path}",
        "s3": f"s3://bucket/{path}{draw(st.sampled_from(['', '/']))}",
    }[shape]
    store: dict[str, Any] = {"uri": uri}
    if draw(st.booleans()):
        store["name"] = draw(st.sampled_from(["a", "b", "local", "s3", "drill-b", "ckpt_a", "x/y"]))
    if shape == "file-abs" and draw(st.booleans()):
        store["pvc"] = "claim"
    if shape == "s3" and draw(st.booleans()):
        store["options"] = {"endpoint_url": "http://127.0.0.1:9000"}
    return store


def _valid_spec(stores: list[dict[str, Any]]) -> JobSpec | None:
    try:
        return _spec(stores)
    except SpecError:
        return None


def _check_isolated(original: JobSpec, isolated: JobSpec, run_dir: Path, role: str) -> None:
    before, after = original.spec.checkpoint.stores, isolated.spec.checkpoint.stores
    assert [s.display_name for s in after] == [s.display_name for s in before], "one store per store, same order"
    resolved = [s.resolved_uri(run_dir) for s in after]
    assert len(set(resolved)) == len(resolved), f"stores share a place: {resolved}"
    for old, new, uri in zip(before, after, resolved, strict=True):
        assert new.options == old.options
        if old.scheme == "file":
            assert Path(uri[len("file://") :]).is_relative_to(run_dir), f"{old.uri} -> {uri} leaves the run dir"
            assert new.pvc is None or new.uri == old.uri
        else:
            assert new.uri.startswith(old.uri.rstrip("/") + f"/torchrig-drill-t1/{role}/"), new.uri
    assert isolated.spec.checkpoint.resume.value == "auto"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(st.lists(_store(), min_size=1, max_size=3))
def test_every_valid_spec_survives_store_isolation(stores: list[dict[str, Any]]) -> None:
    spec = _valid_spec(stores)
    if spec is None:
        return  # `validate` rejects it too (e.g. two stores share a derived name): not a drill's problem
    drill_dir = Path("/drill")
    for role in ("run", "reference"):
        isolated = revalidate(isolate_stores(spec, "t1", role), "drill")
        _check_isolated(spec, isolated, drill_dir / role, role)
        # Every scenario's patch of it stays valid too (the store scenarios add a second store).
        for scenario in SCENARIOS.values():
            revalidate(scenario().patch(isolated, _ctx(isolated)), "drill")
    run = isolate_stores(spec, "t1", "run").spec.checkpoint.stores
    ref = isolate_stores(spec, "t1", "reference").spec.checkpoint.stores
    for a, b in zip(run, ref, strict=True):
        if a.scheme != "file":
            assert a.uri != b.uri, "the faulted run and the reference never share an object-store prefix"


def test_two_unnamed_absolute_stores_are_isolated_apart() -> None:
    spec = _spec(TWO_UNNAMED_ABSOLUTE)
    isolated = revalidate(isolate_stores(spec, "t1", "run"), "drill")
    stores = isolated.spec.checkpoint.stores
    assert [s.uri for s in stores] == ["file://./stores/ckpt_a", "file://./stores/ckpt_b"]
    assert [s.display_name for s in stores] == ["ckpt_a", "ckpt_b"]


def test_fallback_store_gets_a_free_name_and_place() -> None:
    spec = _spec([{"uri": "file://./drill-b"}])
    stores = revalidate(with_fallback_store(spec), "drill").spec.checkpoint.stores
    assert [(s.uri, s.display_name) for s in stores] == [
        ("file://./drill-b", "drill-b"),
        ("file://./drill-b-2", "drill-b-2"),
    ]
    two = _spec(TWO_UNNAMED_ABSOLUTE)
    assert with_fallback_store(two) is two


# -- the whole drill on that spec, against a fake backend ---------------------------------------------
class _ScriptedRun:
    """A finished run whose directory holds a kill at step 23 and a resume from step 20."""

    def __init__(self, run_dir: Path, env: dict[str, str]) -> None:
        self._run_dir = run_dir
        files = RunFiles(run_dir)
        run_dir.mkdir(parents=True)
        faulted = Env.FAULTS in env
        events: list[dict[str, Any]] = [
            {"time": 1.0, "event": "start", "rank": 0, "world_size": 2, "pid": 11, "generation": 0},
            {"time": 5.0, "event": "checkpoint_committed", "step": 10, "rank": 0},
            {"time": 9.0, "event": "checkpoint_committed", "step": 20, "rank": 0},
        ]
        if faulted:
            events += [
                {"time": 10.0, "event": "fault", "kind": "kill", "rank": 1, "step": 23, "generation": 0},
                {"time": 13.0, "event": "start", "rank": 0, "world_size": 2, "pid": 21, "generation": 1},
                {"time": 14.0, "event": "restore", "step": 20, "store": "ckpt_a", "rank": 0, "generation": 1},
                {"time": 15.5, "event": "first_step", "step": 21, "rank": 0, "generation": 1},
            ]
        files.events.write_text("".join(json.dumps(e) + "\n" for e in events))
        self.summary = Summary(status="succeeded", final_loss=0.5, params_sha256="same", world_sizes=[2])
        write_json(files.summary, self.summary.to_dict())

    @property
    def run_dir(self) -> Path:
        return self._run_dir

    def poll(self) -> RunState:
        return RunState.SUCCEEDED

    def wait(self, timeout_s: float | None = None) -> Summary:
        return self.summary

    def kill_node(self, node: int) -> list[int]:
        raise NotImplementedError

    def add_node(self) -> int:
        raise NotImplementedError

    def stop(self, grace_s: float = 10.0) -> None:
        pass

    def request_cancel(self) -> None:
        pass


class ScriptedBackend(Backend):
    name = "scripted"
    capabilities: ClassVar[Capabilities] = Capabilities(supervised=True)
    launched: ClassVar[list[JobSpec]] = []

    def _dry_run(self, spec: JobSpec, options: SubmitOptions) -> Any:
        return {}

    def _launch(self, dryrun: DryRun) -> SupervisedRun:
        ScriptedBackend.launched.append(dryrun.spec)
        assert dryrun.options.run_dir is not None
        return _ScriptedRun(Path(dryrun.options.run_dir), dryrun.options.env)

    def _schedule(self, dryrun: DryRun) -> RunHandle:
        raise NotImplementedError

    def _status(self, run_id: str) -> RunStatus:
        raise NotImplementedError

    def _logs(self, run_id: str, rank: int | None, follow: bool) -> Iterator[str]:
        raise NotImplementedError

    def _cancel(self, run_id: str) -> RunStatus:
        raise NotImplementedError

    def _list(self) -> list[RunStatus]:
        return []


@pytest.fixture
def scripted_backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[ScriptedBackend]]:
    monkeypatch.setitem(BACKENDS, "scripted", f"{__name__}:ScriptedBackend")
    monkeypatch.setattr(runner, "_REFERENCES", {})
    ScriptedBackend.launched.clear()
    yield ScriptedBackend


def test_a_drill_runs_on_two_unnamed_absolute_stores(tmp_path: Path, scripted_backend: type[ScriptedBackend]) -> None:
    """Issue 15.1: this spec passes `validate`, so the drill must run it (it used to stop with
    `two stores share the name 'stores_store'`)."""
    spec = _spec(TWO_UNNAMED_ABSOLUTE)
    options = DrillOptions(backend="scripted", at_step=23, rank=1, nodes=1, drill_dir=str(tmp_path / "d"))
    report = run_drill("kill-worker", spec, options)
    assert report.passed, report.to_dict()
    assert report.resumed_from_step == 20 and report.lost_steps == 3
    faulted, reference = scripted_backend.launched
    for launched in (faulted, reference):
        assert [s.display_name for s in launched.spec.checkpoint.stores] == ["ckpt_a", "ckpt_b"]
        assert all(not s.uri.startswith("file:///ckpt") for s in launched.spec.checkpoint.stores)
    assert (tmp_path / "d" / "report.json").exists()


def test_a_drill_whose_fault_struck_a_finished_job_is_inconclusive(
    tmp_path: Path, scripted_backend: type[ScriptedBackend]
) -> None:
    """lose-store strikes from outside; the scripted run has already succeeded when it does."""
    spec = _spec([{"uri": "file://./ckpt", "name": "ckpt_a"}])
    options = DrillOptions(backend="scripted", at_step=23, nodes=1, reference=False, drill_dir=str(tmp_path / "d"))
    report = run_drill("lose-store", spec, options)
    assert report.verdict == "inconclusive" and not report.passed and report.exit_code == 6
    assert report.inconclusive is not None and report.inconclusive.startswith("the job finished before the fault")
    assert report.checks, "judged all the same, for people to read"
    written = json.loads((tmp_path / "d" / "report.json").read_text())
    assert written["verdict"] == "inconclusive" and written["inconclusive"] == report.inconclusive
