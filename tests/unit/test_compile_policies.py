"""What the Kubernetes targets refuse or add for safety (issue 13 points 7, 10, 12; issue 15 point 3):
fail-fast exit codes in every manifest, pod-local stores on multi-node jobs, inline credentials, the
TrainJob's own namespaced runtime."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from orchestrator.cli import cli
from orchestrator.compile import MANIFEST_TARGETS, check_target, compile, compile_plan
from orchestrator.errors import UnsupportedFeature
from orchestrator.loader import load_spec
from orchestrator.spec import JobSpec
from training.contract import PERMANENT, ExitCode, is_retryable

REPO = Path(__file__).resolve().parents[2]
DIGITS = REPO / "examples" / "digits-ddp.yaml"
LAUNCH = ["python", "-m", "training.launch", "--spec", "/etc/torchrig/job.yaml"]
POD_LOCAL = ["spec.checkpoint.stores=[{uri: 'file://./checkpoints'}]"]


def digits(*overrides: str) -> JobSpec:
    return load_spec(DIGITS, list(overrides))


def by_kind(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [o for o in objs if o["kind"] == kind]
    return found


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.stdout, result.stderr


# -- exit codes: permanent errors fail the job at once ---------------------------------------------------


def test_exit_code_convention() -> None:
    retryable = {
        ExitCode.TRAINING_FAILED,
        ExitCode.HUNG,
        ExitCode.PREEMPTED,
        ExitCode.RECOVERY_FAILED,
        ExitCode.STORE_LOST,
        ExitCode.STORE_UNAVAILABLE,
        ExitCode.SDC_DETECTED,  # the group restarts from the newest certified checkpoint
        ExitCode.SDC_SUSPECT,  # the majority's suspect leaves; a spare takes its rank in place
    }
    assert {c for c in ExitCode if c.retryable} == retryable
    assert all(not is_retryable(code) for code in (*PERMANENT, 1))
    assert is_retryable(137) and is_retryable(143) and is_retryable(-9) and not is_retryable(0)
    # Above every signal death (128 + 64), so never mistaken for one.
    assert min(c for c in ExitCode if c.retryable) > 128 + 64


def test_worker_and_watchdog_exit_with_retryable_codes() -> None:
    import training.entry as worker
    from training.watchdog import WATCHDOG_EXIT_CODE

    # A survivor of a lost peer raises too: an exception in training must not be permanent.
    assert is_retryable(worker.EXIT_FAILED) and is_retryable(WATCHDOG_EXIT_CODE)
    assert worker.EXIT_FAILED != WATCHDOG_EXIT_CODE
    assert worker.EXIT_USAGE == ExitCode.TASK_INVALID and not is_retryable(worker.EXIT_USAGE)


@pytest.mark.parametrize("fixed_size", [False, True])
def test_pytorchjob_fails_on_permanent_exit_codes(fixed_size: bool) -> None:
    job = by_kind(compile(digits(), "pytorchjob", fixed_size=fixed_size), "PyTorchJob")
    policies = {r: spec["restartPolicy"] for r, spec in job["spec"]["pytorchReplicaSpecs"].items()}
    assert policies and set(policies.values()) == {"ExitCode"}


def test_trainjob_fails_its_jobset_on_permanent_exit_codes() -> None:
    runtime = by_kind(compile(digits(), "trainjob", fixed_size=True), "TrainingRuntime")
    jobset = runtime["spec"]["template"]["spec"]
    (rjob,) = jobset["replicatedJobs"]
    job = rjob["template"]["spec"]
    # The Job fails on a permanent code through its pod failure policy (which needs restartPolicy Never) ...
    assert job["podFailurePolicy"] == {
        "rules": [
            {
                "action": "FailJob",
                "onExitCodes": {"containerName": "node", "operator": "In", "values": [2, 3, 126, 127]},
            }
        ]
    }
    assert job["template"]["spec"]["restartPolicy"] == "Never"
    assert job["backoffLimit"] == 0  # any other failed pod fails the Job, and the JobSet restarts the group
    # ... and the JobSet does not restart for that reason; for any other it does, restarts.max times.
    assert jobset["failurePolicy"] == {
        "maxRestarts": 3,
        "rules": [{"name": "PermanentExitCode", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}],
    }


def commands(objs: list[dict[str, Any]]) -> list[list[str]]:
    out: list[list[str]] = []
    for o in objs:
        spec = o.get("spec", {})
        if o["kind"] == "PyTorchJob":
            out += [r["template"]["spec"]["containers"][0]["command"] for r in spec["pytorchReplicaSpecs"].values()]
        elif o["kind"] == "TrainingRuntime":
            rjob = spec["template"]["spec"]["replicatedJobs"][0]
            out.append(rjob["template"]["spec"]["template"]["spec"]["containers"][0]["command"])
        elif o["kind"] == "TrainJob":
            out.append(spec["trainer"]["command"])
        elif o["kind"] == "RayJob":
            out.append(spec["entrypoint"].split())
    return out


@pytest.mark.parametrize("target", list(MANIFEST_TARGETS))
def test_every_compiled_command_starts_with_the_preflight(target: str) -> None:
    cmds = commands(compile(digits(), target, fixed_size=True))
    assert cmds
    for cmd in cmds:
        assert cmd[: len(LAUNCH)] == LAUNCH, cmd
        rest = cmd[cmd.index("--") + 1 :]
        assert rest[0] in ("torchrun", "python"), cmd
    if target == "rayjob":  # the head has no GPU; Ray places the GPU workers
        assert "--no-gpu-check" in cmds[0]
    plan = compile_plan(digits(), "torchrun")
    assert plan.command.startswith("python -m training.launch --spec job.yaml -- torchrun ")


# -- pod-local checkpoint stores (issue 13 point 7) ------------------------------------------------------


@pytest.mark.parametrize("target", list(MANIFEST_TARGETS))
def test_multi_node_job_with_only_pod_local_stores_is_refused(target: str) -> None:
    with pytest.raises(UnsupportedFeature) as info:
        compile(digits(*POD_LOCAL), target, fixed_size=True)
    msg = str(info.value)
    assert msg.startswith("spec.checkpoint.stores: every store is pod-local")
    assert "spec.nodes.max is 2" in msg and "pvc:" in msg and "ReadWriteMany" in msg and "s3://" in msg
    assert "--allow-pod-local-stores" in msg


@pytest.mark.parametrize(
    "stores",
    [
        "[{uri: 'file://./checkpoints', pvc: claim}]",
        "[{uri: 'file:///mnt/ckpt', pvc: claim}]",
        "[{uri: 'file://./checkpoints'}, {uri: 's3://bucket/x'}]",
        "[{uri: 'gs://bucket/x'}]",
    ],
)
def test_one_shared_store_is_enough(stores: str) -> None:
    assert check_target(digits(f"spec.checkpoint.stores={stores}"), "pytorchjob") == []


def test_pod_local_stores_pass_on_one_node_and_outside_kubernetes() -> None:
    assert check_target(digits(*POD_LOCAL, "spec.nodes.max=1"), "pytorchjob") == []
    assert check_target(digits(*POD_LOCAL, "spec.checkpoint.stores=[{uri: 'memory://x'}]"), "torchrun") == []
    compile_plan(digits(*POD_LOCAL), "torchrun")  # bare metal may share the path over NFS


def test_allow_pod_local_stores_downgrades_to_a_warning() -> None:
    spec = digits(*POD_LOCAL)
    (warning,) = check_target(spec, "pytorchjob", allow_pod_local_stores=True)
    assert warning.startswith("spec.checkpoint.stores: every store is pod-local")
    assert by_kind(compile(spec, "pytorchjob", allow_pod_local_stores=True), "PyTorchJob")


def test_cli_render_and_validate_apply_the_rule(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(DIGITS.read_text().replace(", pvc: digits-checkpoints", ""))
    code, out, err = run("render", str(job), "--target", "pytorchjob")
    assert (code, out) == (2, "") and err.startswith("error: spec.checkpoint.stores: every store is pod-local")
    code, out, err = run("render", str(job), "--target", "pytorchjob", "--allow-pod-local-stores")
    assert code == 0 and yaml.safe_load_all(out) and err.startswith("warning: spec.checkpoint.stores: ")
    assert run("render", str(job), "--target", "torchrun")[0] == 0
    assert run("validate", str(job)) == (0, "ok\n", "")  # the model alone: a local run is fine
    code, _, err = run("validate", str(job), "--target", "rayjob")
    assert code == 2 and "every store is pod-local" in err
    assert run("validate", str(job), "--target", "rayjob", "--allow-pod-local-stores")[0] == 0


# -- credentials (issue 13 point 10) ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "path"),
    [
        ("{key: AKIA, secret: s3cr3t}", "spec.checkpoint.stores[0].options.key"),
        ("{client_kwargs: {aws_secret_access_key: x}}", "spec.checkpoint.stores[0].options.client_kwargs."),
        ("{token: ya29.abc}", "spec.checkpoint.stores[0].options.token"),
        ("{account_key: x}", "spec.checkpoint.stores[0].options.account_key"),
    ],
)
def test_inline_credentials_are_refused_naming_secret_ref(options: str, path: str) -> None:
    # The loader refuses them first (tests/unit/test_spec_credentials.py); the compiler still does for a
    # JobSpec built without it (the Python API).
    change = f"spec.checkpoint.stores=[{{uri: 's3://bucket/x', options: {options}}}]"
    spec = load_spec(DIGITS, [change], allow_inline_secrets=True)
    for target in MANIFEST_TARGETS:
        with pytest.raises(UnsupportedFeature) as info:
            compile(spec, target, fixed_size=True)
        assert str(info.value).startswith(path)
        assert "spec.checkpoint.stores[0].secretRef" in str(info.value)
    compile_plan(spec, "torchrun")  # outside Kubernetes the job file is the user's own


def test_inline_credentials_of_init_from_are_refused() -> None:
    spec = load_spec(
        DIGITS, ["spec.checkpoint.initFrom={uri: 's3://b/base', options: {secret: x}}"], allow_inline_secrets=True
    )
    with pytest.raises(UnsupportedFeature, match=r"^spec\.checkpoint\.initFrom\.options\.secret: .*secretRef"):
        compile(spec, "pytorchjob")


def test_plain_options_and_token_methods_pass() -> None:
    options = "{endpoint_url: 'http://minio:9000', anon: false, token: google_default}"
    assert check_target(digits(f"spec.checkpoint.stores=[{{uri: 'gs://b/x', options: {options}}}]"), "rayjob") == []


def test_secret_ref_becomes_env_from_on_every_worker_container() -> None:
    spec = digits(
        "spec.checkpoint.stores=[{uri: 's3://a/x', secretRef: s3-creds}, {uri: 's3://a/y', secretRef: s3-creds}]"
    )
    want = [{"secretRef": {"name": "s3-creds"}}]
    job = by_kind(compile(spec, "pytorchjob"), "PyTorchJob")
    assert all(
        r["template"]["spec"]["containers"][0]["envFrom"] == want for r in job["spec"]["pytorchReplicaSpecs"].values()
    )
    runtime = by_kind(compile(spec, "trainjob", fixed_size=True), "TrainingRuntime")
    pod = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["envFrom"] == want
    cluster = by_kind(compile(spec, "rayjob"), "RayJob")["spec"]["rayClusterSpec"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        assert group["template"]["spec"]["containers"][0]["envFrom"] == want
    # The Secret's name is in the ConfigMap, its content nowhere.
    assert "s3-creds" in by_kind(compile(spec, "pytorchjob"), "ConfigMap")["data"]["job.yaml"]


def test_secret_ref_needs_the_generated_trainjob_runtime() -> None:
    spec = digits(
        "spec.checkpoint.stores=[{uri: 's3://a/x', secretRef: c}]",
        "spec.kubernetes.runtimeRef=torch-distributed",
        "spec.kubernetes.gang=none",
    )
    with pytest.raises(UnsupportedFeature, match=r"^spec\.checkpoint\.stores\[\]\.secretRef: .*envFrom"):
        compile(spec, "trainjob", fixed_size=True)


# -- the TrainJob's runtime (issue 13 point 12) -------------------------------------------------------------


def test_trainjob_runtime_is_namespaced_and_its_own() -> None:
    objs = compile(digits("metadata.namespace=team-a"), "trainjob", fixed_size=True)
    runtime, job = by_kind(objs, "TrainingRuntime"), by_kind(objs, "TrainJob")
    assert not [o for o in objs if o["kind"] == "ClusterTrainingRuntime"]
    assert runtime["metadata"]["namespace"] == job["metadata"]["namespace"] == "team-a"
    assert job["spec"]["runtimeRef"]["kind"] == "TrainingRuntime"
    assert job["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"]


@pytest.mark.parametrize("kind", ["ClusterTrainingRuntime", "TrainingRuntime"])
def test_runtime_ref_names_either_kind(kind: str) -> None:
    spec = digits("spec.kubernetes.runtimeRef=rt", "spec.kubernetes.gang=none", f"spec.kubernetes.runtimeKind={kind}")
    objs = compile(spec, "trainjob", fixed_size=True)
    assert [o["kind"] for o in objs] == ["ConfigMap", "NetworkPolicy", "TrainJob"]
    assert objs[2]["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": kind, "name": "rt"}
