"""`training.preflight` and the launcher's check mode (issue 15 point 3): deterministic startup errors end
the job at once with a permanent exit code and one line naming the field, before torchrun starts."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.fixtures.common import REPO
from training.config import WorkerSpec, load_worker_spec
from training.contract import Env, ExitCode
from training.launch import main as launch
from training.preflight import PreflightError, check_gpus, preflight

BASE: dict[str, Any] = {
    "apiVersion": "torchrig/v1",
    "kind": "TrainingJob",
    "metadata": {"name": "pf"},
    "spec": {
        "task": {"entrypoint": "training.examples.digits:task", "args": {"hidden": 8}},
        "training": {"steps": 1},
        "checkpoint": {"stores": [{"uri": "file://./checkpoints"}]},
    },
}


def spec_file(tmp_path: Path, **spec: Any) -> Path:
    doc = copy.deepcopy(BASE)
    doc["spec"].update(spec)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def worker_spec(tmp_path: Path, **spec: Any) -> WorkerSpec:
    return load_worker_spec(spec_file(tmp_path, **spec))


def verdict(spec: WorkerSpec, run_dir: Path) -> tuple[ExitCode, str]:
    with pytest.raises(PreflightError) as info:
        preflight(spec, run_dir=run_dir, check_gpu=False)
    return info.value.exit_code, str(info.value)


def test_a_runnable_job_passes_and_its_stores_exist(tmp_path: Path) -> None:
    preflight(worker_spec(tmp_path), run_dir=tmp_path / "run")
    assert (tmp_path / "run" / "checkpoints").is_dir()
    assert not list((tmp_path / "run" / "checkpoints").iterdir())  # the probe file is gone


def test_an_entrypoint_typo_is_permanent(tmp_path: Path) -> None:
    spec = worker_spec(tmp_path, task={"entrypoint": "training.examples.digitz:task"})
    code, msg = verdict(spec, tmp_path / "run")
    assert code == ExitCode.TASK_INVALID
    assert msg.startswith("spec.task.entrypoint: cannot import 'training.examples.digitz'")


@pytest.mark.parametrize(
    ("args", "start"),
    [
        ({"hiddn": 3}, "spec.task.args: training.examples.digits:task rejected the arguments"),
        ({"hidden": -1}, "spec.task.args: training.examples.digits:task rejected them: ValueError: hidden must be > 0"),
    ],
)
def test_bad_task_args_are_permanent(tmp_path: Path, args: dict[str, Any], start: str) -> None:
    code, msg = verdict(
        worker_spec(tmp_path, task={"entrypoint": "training.examples.digits:task", "args": args}), tmp_path
    )
    assert code == ExitCode.TASK_INVALID and msg.startswith(start)


def test_an_unwritable_store_is_an_environment_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    spec = worker_spec(tmp_path, checkpoint={"stores": [{"uri": f"file://{tmp_path}/file/ckpt"}]})
    code, msg = verdict(spec, tmp_path / "run")
    assert code == ExitCode.ENVIRONMENT
    assert msg.startswith(f"spec.checkpoint.stores[0].uri (file://{tmp_path}/file/ckpt): cannot create or write")


def test_object_stores_are_not_contacted(tmp_path: Path) -> None:
    spec = worker_spec(tmp_path, checkpoint={"stores": [{"uri": "s3://no-such-bucket/x"}]})
    preflight(spec, run_dir=tmp_path / "run", check_gpu=False)


def test_a_gpu_job_without_cuda_is_an_environment_error(tmp_path: Path) -> None:
    spec = worker_spec(tmp_path, resources={"gpus": 2})
    assert spec.spec.resources.gpus == 2
    with pytest.raises(PreflightError) as info:
        check_gpus(spec, probe=lambda: (False, 0))
    assert info.value.exit_code == ExitCode.ENVIRONMENT
    assert str(info.value).startswith("spec.resources.gpus: the job needs 2 GPU(s) per node but CUDA is not available")
    with pytest.raises(PreflightError, match="only 1 are visible"):
        check_gpus(spec, probe=lambda: (True, 1))
    check_gpus(spec, probe=lambda: (True, 2))
    check_gpus(worker_spec(tmp_path), probe=lambda: (False, 0))  # a CPU job needs no CUDA


def test_launcher_check_mode_exits_with_the_code_and_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = spec_file(tmp_path)
    assert launch(["--spec", str(good), "--run-dir", str(tmp_path / "run"), "--no-gpu-check"]) == 0
    bad = spec_file(tmp_path, task={"entrypoint": "training.examples.digitz:task"})
    assert launch(["--spec", str(bad), "--run-dir", str(tmp_path / "run"), "--", "false"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [err[0]] and err[0].startswith("torchrig: error: spec.task.entrypoint: cannot import")
    assert launch(["--spec", str(tmp_path / "missing.yaml")]) == ExitCode.TASK_INVALID


def _other_job_saved_into(store: Path, job: str) -> None:
    """The real checkpoint manager of job `job` takes its writer fence in `store` and commits step 1."""
    from tests.fixtures.checkpoint import ckpt_identity, config, save_steps
    from training.checkpoint import CheckpointManager

    mgr = CheckpointManager(config(f"file://{store}"), ckpt_identity(store.parent / f"run-{job}", job=job))
    try:
        save_steps(mgr, [1])
    finally:
        mgr.close()


def test_a_store_another_job_uses_is_refused_naming_the_field_and_the_job(tmp_path: Path) -> None:
    store = tmp_path / "shared"
    _other_job_saved_into(store, "first-job")
    before = sorted(p.relative_to(store) for p in store.rglob("*"))
    spec = worker_spec(tmp_path, checkpoint={"stores": [{"uri": "file://./mine"}, {"uri": f"file://{store}"}]})
    code, msg = verdict(spec, tmp_path / "run")
    assert code == ExitCode.TASK_INVALID
    assert msg.startswith(f"spec.checkpoint.stores[1].uri: file://{store} is already used by job 'first-job'")
    assert "spec.checkpoint.initFrom" in msg and "\n" not in msg
    assert sorted(p.relative_to(store) for p in store.rglob("*")) == before  # nothing of the other job touched


def test_the_same_job_resubmitted_keeps_its_store(tmp_path: Path) -> None:
    store = tmp_path / "mine"
    _other_job_saved_into(store, "pf")  # an earlier launch of this very job ("pf")
    preflight(worker_spec(tmp_path, checkpoint={"stores": [{"uri": f"file://{store}"}]}), run_dir=tmp_path / "run")


def test_a_relative_store_is_checked_where_it_resolves(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _other_job_saved_into(run_dir / "checkpoints", "someone-else")
    code, msg = verdict(worker_spec(tmp_path), run_dir)  # file://./checkpoints resolves into the run dir
    assert code == ExitCode.TASK_INVALID
    assert "job 'someone-else'" in msg


def test_the_launcher_refuses_a_foreign_store_with_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "shared"
    _other_job_saved_into(store, "first-job")
    job = spec_file(tmp_path, checkpoint={"stores": [{"uri": f"file://{store}"}]})
    assert launch(["--spec", str(job), "--run-dir", str(tmp_path / "run"), "--no-gpu-check"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is already used by job 'first-job'" in err[0]


def test_checkpoints_signed_with_another_key_stop_the_job_before_it_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rotated or mistyped `TORCHRIG_CHECKPOINT_KEY` must not make a resubmitted job start over from step
    0 behind its own checkpoints: the preflight names the variable, the store and the steps (permanent),
    and leaves the checkpoints as they are. The right key, `resume: never` or no key let it start."""
    from tests.fixtures.checkpoint import ckpt_identity, config, save_steps
    from training.checkpoint import CheckpointManager
    from training.contract import Env

    run_dir = tmp_path / "run"
    monkeypatch.setenv(Env.CHECKPOINT_KEY, "a" * 32)
    store = str(run_dir / "checkpoints")
    mgr = CheckpointManager(config(store, keep=5), ckpt_identity(run_dir, job="pf"))
    save_steps(mgr, [1, 2])
    mgr.close()
    before = sorted(p.name for p in Path(store).iterdir())
    preflight(worker_spec(tmp_path), run_dir=run_dir, check_gpu=False)  # the key that signed them
    monkeypatch.setenv(Env.CHECKPOINT_KEY, "b" * 32)
    code, message = verdict(worker_spec(tmp_path), run_dir)
    assert code is ExitCode.ENVIRONMENT
    assert message.startswith("TORCHRIG_CHECKPOINT_KEY: job 'pf''s checkpoints in spec.checkpoint.stores[0]")
    assert "steps 2, 1) fail their signature check with this key" in message and "\n" not in message
    assert sorted(p.name for p in Path(store).iterdir()) == before, "nothing written or removed"
    never = {"stores": [{"uri": "file://./checkpoints"}], "resume": "never"}
    preflight(worker_spec(tmp_path, checkpoint=never), run_dir=run_dir, check_gpu=False)
    monkeypatch.delenv(Env.CHECKPOINT_KEY)
    preflight(worker_spec(tmp_path), run_dir=run_dir, check_gpu=False)  # no key checks no signature


def test_a_store_a_running_local_run_writes_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same job submitted twice onto one absolute store: the second took the store's writer fence, the
    first trained on with every checkpoint refused and ended `failed`. The second is refused up front."""
    import os

    from orchestrator.backends._local_procs import process_start_ticks
    from orchestrator.backends._preflight import check_stores_not_in_use
    from orchestrator.errors import BackendError
    from orchestrator.loader import load_spec
    from training.contract import Env, write_json

    shared = f"file://{tmp_path / 'shared'}"
    job = tmp_path / "job.yaml"
    example = REPO / "examples" / "digits-ddp.yaml"
    job.write_text(example.read_text().replace('uri: "file://./checkpoints"', f'uri: "{shared}"'))
    live = tmp_path / "runs" / "digits-ddp" / "20261128-000001"
    live.mkdir(parents=True)
    (live / "job.yaml").write_text(job.read_text())
    write_json(live / "supervisor.json", {"pid": os.getpid(), "start_ticks": process_start_ticks(os.getpid())})
    monkeypatch.setenv(Env.RUNS_DIR, str(tmp_path / "runs"))
    spec = load_spec(job, ["spec.checkpoint.stores[0].pvc=null"])
    with pytest.raises(
        BackendError, match=rf"spec.checkpoint.stores\[0\].uri: {shared} is in use by the running run {live}"
    ):
        check_stores_not_in_use(spec, tmp_path / "runs" / "digits-ddp" / "20261128-000002")
    check_stores_not_in_use(spec, live)  # the run itself (its detached supervisor's own preflight)
    check_stores_not_in_use(load_spec(job, [f"spec.checkpoint.stores[0].uri={shared}-2"]), tmp_path / "r2")
    # A relative store lives in each run's own directory: never shared.
    check_stores_not_in_use(load_spec(example), tmp_path / "r3")
    (live / "supervisor.json").unlink()  # the run is over (its supervisor gone)
    check_stores_not_in_use(spec, tmp_path / "r4")


def test_without_a_checkpoint_key_the_preflight_loads_no_checkpoint_stack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key check imports the checkpoint stack (DCP, `torch._dynamo`: 0.6 s of CPU, on a local run's way
    to its store: docs/performance.md "Start-up") only when `TORCHRIG_CHECKPOINT_KEY` is set."""
    monkeypatch.delenv(Env.CHECKPOINT_KEY, raising=False)
    for name in ("training.checkpoint.manifest", "training.checkpoint.signing", "training.checkpoint.storage"):
        monkeypatch.setitem(sys.modules, name, None)  # importing it raises ImportError
    preflight(worker_spec(tmp_path), run_dir=tmp_path / "run", check_gpu=False)
    assert (tmp_path / "run" / "checkpoints").is_dir(), "the other checks ran (the store exists)"
    monkeypatch.setenv(Env.CHECKPOINT_KEY, "k" * 32)
    with pytest.raises(ImportError):  # with a key, the check runs (the stack is needed)
        preflight(worker_spec(tmp_path), run_dir=tmp_path / "run", check_gpu=False)
