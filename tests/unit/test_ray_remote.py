"""A remote Ray cluster without a cluster: the probe's report and verdict, the remote run directory, the
store rules and `--address`/`RAY_ADDRESS` on the CLI (dry runs), and Ray's log lines kept out."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from orchestrator import __version__
from orchestrator.backends import ray_jobs
from orchestrator.backends.ray_jobs import PROBE_MARKER, ClusterProbe, parse_probe, probe_problem, remote_run_dir
from orchestrator.cli import cli
from orchestrator.cli.run_cmds import _split_ref
from orchestrator.errors import SpecError
from orchestrator.loader import load_spec

pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "digits-ddp.yaml"


def _probe(**changes: object) -> ClusterProbe:
    fields: dict[str, object] = {
        "python": "/opt/venv/bin/python",
        "python_version": "3.11.7",
        "versions": {"torch": "2.13.0+cpu", "ray": "2.60.0", "torchrig": __version__},
        "missing": {},
        "gpus_per_node": [0.0, 0.0],
        "node_groups": [],
    }
    fields.update(changes)
    return ClusterProbe(**fields)  # type: ignore[arg-type]


def test_a_cluster_whose_python_lacks_ray_is_named_in_one_line() -> None:
    spec = load_spec(EXAMPLE)
    problem = probe_problem(
        spec,
        _probe(
            python="/usr/bin/python3",
            versions={},
            missing={"ray": "ModuleNotFoundError: No module named 'ray'", "torch": "ModuleNotFoundError: x"},
        ),
    )
    assert problem is not None and "\n" not in problem
    assert problem.startswith("its entrypoint python (/usr/bin/python3, Python 3.11.7) cannot import ray (")
    assert "torch (" in problem and "start Ray from that environment activated" in problem
    assert probe_problem(spec, _probe()) is None


def test_versions_below_the_floor_and_another_torchrig_are_refused() -> None:
    spec = load_spec(EXAMPLE)
    old_torch = probe_problem(spec, _probe(versions={"torch": "2.1.2", "ray": "2.60.0", "torchrig": __version__}))
    assert old_torch is not None and old_torch.endswith("has torch 2.1.2; torchrig needs torch >= 2.6")
    old_ray = probe_problem(spec, _probe(versions={"torch": "2.13.0", "ray": "2.9.3", "torchrig": __version__}))
    assert old_ray is not None and "ray >= 2.50" in old_ray
    other = probe_problem(spec, _probe(versions={"torch": "2.13.0", "ray": "2.60.0", "torchrig": "0.0.1"}))
    assert other is not None and "imports torchrig 0.0.1" in other


def test_gpus_must_exist_now_or_through_an_autoscaler_node_type() -> None:
    spec = load_spec(EXAMPLE, ["spec.resources.gpus=4", "spec.procsPerNode=4", "spec.nodes.min=2", "spec.nodes.max=2"])
    refused = probe_problem(spec, _probe(gpus_per_node=[0.0, 4.0, 2.0]))
    assert refused is not None and refused.startswith("spec.resources.gpus: the job needs 2 node(s) with 4 GPU(s)")
    assert "GPUs per live node: 0, 4, 2" in refused
    assert probe_problem(spec, _probe(gpus_per_node=[4.0, 8.0])) is None
    assert probe_problem(spec, _probe(gpus_per_node=[0.0], node_groups=[(4.0, 2)])) is None
    assert probe_problem(spec, _probe(gpus_per_node=[0.0], node_groups=[(8.0, -1)])) is None
    assert probe_problem(spec, _probe(gpus_per_node=[4.0], node_groups=[(2.0, 10)])) is not None


def test_the_probe_report_is_read_bounded_and_typed() -> None:
    good = {"python": "/v/bin/python", "python_version": "3.11", "versions": {"ray": "2.60.0"}, "missing": {}}
    log = "noise\n" + PROBE_MARKER + json.dumps({**good, "python": "first"}) + "\n" + PROBE_MARKER + json.dumps(good)
    probe = parse_probe(log + "\nmore noise\n")
    assert probe is not None and probe.python == "/v/bin/python" and probe.versions == {"ray": "2.60.0"}
    assert parse_probe("Traceback ...\nModuleNotFoundError") is None
    assert parse_probe(PROBE_MARKER + "{not json") is None
    assert parse_probe(PROBE_MARKER + "[1, 2]") is None
    odd = parse_probe(PROBE_MARKER + json.dumps({"gpus_per_node": ["x", 2, None], "node_groups": [[1, 2], "z", [1]]}))
    assert odd is not None and odd.gpus_per_node == [2.0] and odd.node_groups == [(1.0, 2)]
    # A report pushed out of the tail that is read is no report.
    assert parse_probe(PROBE_MARKER + json.dumps(good) + "\n" + "x" * (64 * 1024)) is None


@given(st.text(max_size=2000))
def test_any_log_parses_or_is_none(text: str) -> None:
    probe = parse_probe(text)
    assert probe is None or isinstance(probe, ClusterProbe)


def test_remote_run_dir() -> None:
    spec = load_spec(EXAMPLE)
    assert remote_run_dir(spec, None, "torchrig-digits-ddp-1234abcd") == (
        '"$HOME"/torchrig/runs/digits-ddp/torchrig-digits-ddp-1234abcd'
    )
    shared = load_spec(EXAMPLE, ["spec.ray.sharedDir=/mnt/my share"])
    assert remote_run_dir(shared, None, "s1") == "'/mnt/my share/runs/digits-ddp/s1'"
    assert remote_run_dir(spec, "/data/run 1", "s1") == "'/data/run 1'"
    with pytest.raises(SpecError, match=r"^--run-dir: 'runs/x' is relative; on a remote Ray cluster"):
        remote_run_dir(spec, "runs/x", "s1")


def test_split_ref_looks_bare_ids_up_on_the_address(tmp_path: Path) -> None:
    address = "http://10.0.0.1:8265/"
    assert _split_ref("torchrig-x-1", None, address) == ("ray", "http://10.0.0.1:8265/torchrig-x-1")
    assert _split_ref("torchrig-x-1", "ray", address) == ("ray", "http://10.0.0.1:8265/torchrig-x-1")
    assert _split_ref(str(tmp_path), None, address) == ("local", str(tmp_path))  # a run directory here
    assert _split_ref("ray://h:1/s", None, address) == ("ray", "h:1/s")
    assert _split_ref("torchrig-x-1", None, None) == ("local", "torchrig-x-1")
    assert _split_ref("torchrig-x-1", "kubernetes", address) == ("kubernetes", "torchrig-x-1")


@pytest.mark.parametrize("via_env", [False, True])
def test_submit_dry_run_to_an_address_applies_the_store_rules(via_env: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    address = "http://127.0.0.1:9"  # nothing listens: a dry run calls no cluster
    flag = [] if via_env else ["--address", address]
    if via_env:
        monkeypatch.setenv("RAY_ADDRESS", address)
    else:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    runner = CliRunner()
    base = ["submit", str(EXAMPLE), "--backend", "ray", "--dry-run", *flag]
    refused = runner.invoke(cli, base)
    assert refused.exit_code == 2
    assert refused.output.startswith("error: spec.checkpoint.stores[0].uri: file://./checkpoints is relative")
    ok = runner.invoke(cli, [*base, "--set", "spec.ray.sharedDir=/mnt/shared"])
    assert ok.exit_code == 0, ok.output
    jobs_api = yaml.safe_load(ok.output)["jobs_api"]
    assert jobs_api["address"] == address and jobs_api["probe"] is True
    assert jobs_api["run_dir"] == f"/mnt/shared/runs/digits-ddp/{jobs_api['submission_id']}"
    local_only = [*base, "--set", "spec.checkpoint.stores[0].uri=file:///var/ckpt"]
    assert "every store is node-local" in runner.invoke(cli, local_only).output
    allowed = runner.invoke(cli, [*local_only, "--allow-node-local-stores"])
    assert (
        allowed.exit_code == 0
        and "every store is node-local" in yaml.safe_load(allowed.output)["jobs_api"]["warnings"][0]
    )


def test_list_names_the_address_it_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    out = CliRunner().invoke(cli, ["list", "--backend", "ray"])
    assert out.exit_code == 3 and "give --address http://HOST:8265 (or set RAY_ADDRESS)" in out.output


def test_rays_info_lines_stay_out_unless_verbose() -> None:
    import ray.dashboard.modules.dashboard_sdk as sdk  # what prints "Uploading package ..."

    (handler,) = [h for h in logging.getLogger("ray").handlers if type(h).__name__ == "PlainRayHandler"]
    stream = io.StringIO()
    previous = handler.setStream(stream)  # Ray's own handler, the one the filter sits on
    try:
        ray_jobs.configure_logging(False)
        ray_jobs._quiet_ray_logs()
        sdk.logger.info("Uploading package gcs://_ray_pkg_quiet.zip.")
        sdk.logger.warning("a warning stays")
        ray_jobs.configure_logging(True)
        sdk.logger.info("Uploading package gcs://_ray_pkg_loud.zip.")
    finally:
        ray_jobs.configure_logging(False)
        handler.setStream(previous)
    err = stream.getvalue()
    assert "_ray_pkg_quiet" not in err and "a warning stays" in err and "_ray_pkg_loud" in err


def test_a_submission_waits_for_the_clusters_job_agent_and_gives_up_at_its_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cluster just started (or busy) answers 500 "No available agent to submit job, please try again
    later" until its head's job agent registers (Ray's job_head.py): the submission is tried again until the
    deadline; any other refusal, and that one past the deadline, is raised at once."""
    import time

    sleeps: list[float] = []
    monkeypatch.setattr(time, "sleep", sleeps.append)

    class Client:
        def __init__(self, refusals: list[str]) -> None:
            self.refusals = refusals
            self.calls: list[dict[str, object]] = []

        def submit_job(self, **job: object) -> str:
            self.calls.append(job)
            if self.refusals:
                raise RuntimeError(self.refusals.pop(0))
            return str(job["submission_id"])

    no_agent = "Request failed with status code 500: No available agent to submit job, please try again later."
    later = Client([no_agent, no_agent])
    ray_jobs.submit_when_an_agent_is_up(later, time.monotonic() + 60, submission_id="s1", entrypoint="x")
    assert [c["submission_id"] for c in later.calls] == ["s1", "s1", "s1"] and sleeps == [1.0, 1.0]
    refused = Client(["Request failed with status code 400: bad runtime_env"])
    with pytest.raises(RuntimeError, match="400"):
        ray_jobs.submit_when_an_agent_is_up(refused, time.monotonic() + 60, submission_id="s2")
    assert len(refused.calls) == 1
    never = Client([no_agent] * 100)
    with pytest.raises(RuntimeError, match=r"No available agent.*another Ray on the head's host may hold"):
        ray_jobs.submit_when_an_agent_is_up(never, time.monotonic() + 0.5, submission_id="s3")
    assert len(never.calls) == 1, "past the deadline: not tried again"
