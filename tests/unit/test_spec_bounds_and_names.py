"""Upper bounds of counts and durations, Kubernetes names, and the workers' reserved environment: each bad
value is one `path: message` line naming the field (orchestrator/spec.py)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from orchestrator.cli import cli
from orchestrator.errors import SpecError
from orchestrator.loader import load_spec, validate_document
from orchestrator.spec import USER_ENV
from tests.unit.test_spec_rules import BASE, problems
from training.contract.env import Env

DIGITS = str(Path(__file__).resolve().parents[2] / "examples" / "digits-ddp.yaml")
OBJECT_NAME = (
    "must be the name of a Kubernetes object, a DNS-1123 subdomain: lowercase letters, digits, '-' and '.', "
    "starting and ending with a letter or digit, at most 253 characters"
)
# Each field that names a Kubernetes object: its path in the document, and its path in a message.
NAME_FIELDS = [
    (("spec", "kubernetes", "serviceAccount"), "spec.kubernetes.serviceAccount"),
    (("spec", "kubernetes", "priorityClass"), "spec.kubernetes.priorityClass"),
    (("spec", "kubernetes", "runtimeRef"), "spec.kubernetes.runtimeRef"),
    (("spec", "kubernetes", "imagePullSecrets", 0), "spec.kubernetes.imagePullSecrets[0]"),
    (("spec", "checkpoint", "stores", 0, "pvc"), "spec.checkpoint.stores[0].pvc"),
    (("spec", "checkpoint", "stores", 0, "secretRef"), "spec.checkpoint.stores[0].secretRef"),
]


def problems_with(path: tuple[str | int, ...], value: Any) -> list[str]:
    """Problems of the base document with `path` set to `value` (not through `--set`, which parses YAML)."""
    doc = copy.deepcopy(BASE)
    if path[:3] == ("spec", "checkpoint", "stores"):
        doc["spec"]["checkpoint"] = {"stores": [{"uri": "file:///mnt/ckpt", path[-1]: value}]}
    elif path[-1] == 0:
        doc["spec"].setdefault("kubernetes", {})[str(path[-2])] = [value]
    else:
        node: Any = doc
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    try:
        validate_document(doc)
    except SpecError as exc:
        return exc.problems
    return []


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


# -- upper bounds ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "limit"),
    [
        ("spec.procsPerNode", 1024),
        ("spec.nodes.max", 100000),
        ("spec.kubernetes.activeDeadlineSeconds", 315360000),
        ("spec.kubernetes.ttlSecondsAfterFinished", 2**31 - 1),
    ],
)
def test_counts_and_durations_have_an_upper_bound(field: str, limit: int) -> None:
    assert problems(f"{field}={limit}") == []
    for value in (limit + 1, 99999999999999999999):
        assert problems(f"{field}={value}") == [f"{field}: Input should be less than or equal to {limit}"]


def test_nodes_min_has_the_same_bound() -> None:
    assert problems("spec.nodes.min=100000", "spec.nodes.max=100000") == []
    assert problems("spec.nodes.min=100001", "spec.nodes.max=100000") == [
        "spec.nodes.min: Input should be less than or equal to 100000"
    ]


def test_metrics_ports_of_every_local_rank_fit_below_65536() -> None:
    assert problems("spec.metrics.port=65000", "spec.procsPerNode=536") == []
    assert problems("spec.metrics.port=65000", "spec.procsPerNode=600") == [
        "spec.procsPerNode: spec.metrics.port (65000) + procsPerNode - 1 must be <= 65535, as local rank r exports "
        "metrics on port + r: at most 536 processes, or a lower port"
    ]
    # No exporter, no port.
    assert problems("spec.metrics.port=65000", "spec.procsPerNode=600", "spec.metrics.enabled=false") == []


def test_render_of_a_huge_process_count_is_one_line() -> None:
    # It once rendered a container port per process until memory ran out.
    code, out, err = run("render", DIGITS, "-t", "pytorchjob", "--set", "spec.procsPerNode=99999999999999999999")
    assert (code, out) == (2, "")
    assert err == f"error: {DIGITS}: spec.procsPerNode: Input should be less than or equal to 1024\n"


# -- Kubernetes names ---------------------------------------------------------------------------------

_dns_labels = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", fullmatch=True)
_subdomains = st.lists(_dns_labels, min_size=1, max_size=4).map(".".join).filter(lambda n: len(n) <= 253)


@st.composite
def _not_subdomains(draw: st.DrawFn) -> str:
    """A valid name with an uppercase letter or an underscore put in somewhere."""
    name = draw(_subdomains)
    i = draw(st.integers(0, len(name)))
    return name[:i] + draw(st.sampled_from(["A", "Z", "_"])) + name[i:]


@pytest.mark.parametrize(("path", "where"), NAME_FIELDS)
@pytest.mark.parametrize("value", ["Bad_Name", "bad name", "-x", "x-", "a..b", "", "x" * 254, "ok\n"])
def test_object_names_must_be_dns1123_subdomains(path: tuple[str | int, ...], where: str, value: str) -> None:
    assert problems_with(path, value) == [f"{where}: {OBJECT_NAME}"]


@pytest.mark.parametrize(("path", "where"), NAME_FIELDS)
@settings(max_examples=30, deadline=None)
@given(name=_subdomains)
def test_any_dns1123_subdomain_is_taken(path: tuple[str | int, ...], where: str, name: str) -> None:
    assert problems_with(path, name) == []


@pytest.mark.parametrize(("path", "where"), NAME_FIELDS)
@settings(max_examples=30, deadline=None)
@given(name=_not_subdomains())
def test_an_uppercase_letter_or_underscore_is_refused(path: tuple[str | int, ...], where: str, name: str) -> None:
    assert problems_with(path, name) == [f"{where}: {OBJECT_NAME}"]


def test_cli_refuses_a_bad_service_account_in_one_line() -> None:
    code, out, err = run("validate", DIGITS, "-t", "pytorchjob", "--set", "spec.kubernetes.serviceAccount=Bad_SA")
    assert (code, out) == (2, "")
    assert err == f"error: {DIGITS}: spec.kubernetes.serviceAccount: {OBJECT_NAME}\n"


@pytest.mark.parametrize(
    ("selector", "message"),
    [
        ("{Bad Key: x}", "label key 'Bad Key' is not a valid Kubernetes label key"),
        ("{Example.com/gpu: x}", "label key 'Example.com/gpu' is not a valid Kubernetes label key"),
        ("{a/b/c: x}", "label key 'a/b/c' is not a valid Kubernetes label key"),
        (f"{{{'k' * 64}: x}}", f"label key '{'k' * 64}' is not a valid Kubernetes label key"),
        ("{zone: 'a b'}", "label value 'a b' (key 'zone') is not a valid Kubernetes label value"),
        ("{zone: '-a'}", "label value '-a' (key 'zone') is not a valid Kubernetes label value"),
        (f"{{zone: {'v' * 64}}}", f"label value '{'v' * 64}' (key 'zone') is not a valid Kubernetes label value"),
    ],
)
def test_node_selector_is_labels(selector: str, message: str) -> None:
    assert problems(f"spec.kubernetes.nodeSelector={selector}") == [f"spec.kubernetes.nodeSelector: {message}"]


def test_node_selector_takes_kubernetes_labels() -> None:
    selector = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "Zone_A": "", "k" * 63: "v" * 63}
    assert problems_with(("spec", "kubernetes", "nodeSelector"), selector) == []


@pytest.mark.parametrize("image", ["", " ", "ghcr.io/x/y:1 ", "a b"])
def test_image_is_not_empty_nor_spaced(image: str) -> None:
    message = "must be an image reference such as ghcr.io/org/worker:tag (not empty, no whitespace)"
    assert problems_with(("spec", "image"), image) == [f"spec.image: {message}"]
    assert problems_with(("spec", "ray", "image"), image) == [f"spec.ray.image: {message}"]


@pytest.mark.parametrize("name", ["nvidia.com/gpu", "amd.com/gpu", "gpu.intel.com/i915", "example.com/Big_GPU"])
def test_gpu_resource_takes_extended_resource_names(name: str) -> None:
    assert problems_with(("spec", "resources", "gpuResource"), name) == []


@pytest.mark.parametrize("name", ["not valid", "gpu", "/gpu", "Nvidia.com/gpu", "nvidia.com/", "a/b/c", "x.io/-g"])
def test_gpu_resource_refuses_other_names(name: str) -> None:
    assert problems_with(("spec", "resources", "gpuResource"), name) == [
        "spec.resources.gpuResource: must be an extended resource name: a DNS subdomain, '/' and a name of at "
        "most 63 characters, such as nvidia.com/gpu"
    ]


@pytest.mark.parametrize(
    ("override", "where"),
    [
        ("metadata.name='abc\\n'", "metadata.name"),
        ("metadata.namespace='abc\\n'", "metadata.namespace"),
        ("metadata.labels={'team\\n': a}", "metadata.labels"),
    ],
)
def test_a_trailing_newline_is_no_part_of_a_name(override: str, where: str) -> None:
    (problem,) = problems(override)
    assert problem.startswith(f"{where}: ")


# -- the workers' environment -------------------------------------------------------------------------

RESERVED = (
    "TORCHRIG_* and the launcher's variables are torchrig's contract with its workers (training.contract.env), set "
    "by the backend; the spec may set only TORCHRIG_FAULTS, TORCHRIG_LOG_LEVEL, TORCHRIG_PEAK_FLOPS"
)
BAD_ENV_NAME = "not a variable name Kubernetes takes: letters, digits, '_', '-' and '.', no leading digit"
CONTRACT = sorted(
    v
    for k, v in vars(Env).items()
    if k.isupper() and isinstance(v, str) and v.startswith("TORCHRIG_") and v not in USER_ENV
)


@pytest.mark.parametrize("name", [*CONTRACT, "TORCHRIG_NOT_YET_USED", "RANK", "WORLD_SIZE", "MASTER_ADDR"])
def test_env_may_not_override_the_contract(name: str) -> None:
    assert problems(f"spec.kubernetes.env.{name}=evil") == [f"spec.kubernetes.env.{name}: {RESERVED}"]


@pytest.mark.parametrize("name", sorted(USER_ENV))
def test_env_may_set_the_contracts_user_knobs(name: str) -> None:
    """An unknown GPU's peak FLOP/s (for MFU) and the worker log level are the user's to set on a cluster."""
    assert load_spec(DIGITS, [f"spec.kubernetes.env.{name}=1e15"]).spec.kubernetes.env == {name: "1e15"}


def test_the_contract_variables_are_there() -> None:
    assert "TORCHRIG_SPEC" in CONTRACT and "TORCHRIG_RUN_DIR" in CONTRACT


@pytest.mark.parametrize(
    ("name", "where"),
    [
        ("1BAD", "spec.kubernetes.env.1BAD"),
        ("bad name", "spec.kubernetes.env['bad name']"),
        ("a=b", "spec.kubernetes.env['a=b']"),
    ],
)
def test_env_names_are_kubernetes_variable_names(name: str, where: str) -> None:
    assert problems_with(("spec", "kubernetes", "env"), {"OK": "1", name: "x"}) == [f"{where}: {BAD_ENV_NAME}"]


_env_names = st.from_regex(r"[-._a-zA-Z][-._a-zA-Z0-9]{0,30}", fullmatch=True)


@settings(max_examples=50, deadline=None)
@given(name=_env_names.filter(lambda n: not n.startswith("TORCHRIG_")))
def test_any_kubernetes_variable_name_reaches_the_pods(name: str) -> None:
    doc = copy.deepcopy(BASE)
    doc["spec"]["kubernetes"] = {"env": {name: "v"}}
    assert validate_document(doc).spec.kubernetes.env == {name: "v"}


@settings(max_examples=50, deadline=None)
@given(suffix=st.from_regex(r"[-._a-zA-Z0-9]{0,30}", fullmatch=True))
def test_any_torchrig_variable_is_refused(suffix: str) -> None:
    name = f"TORCHRIG_{suffix}"
    assume(name not in USER_ENV)
    assert problems_with(("spec", "kubernetes", "env"), {name: "v"}) == [f"spec.kubernetes.env.{name}: {RESERVED}"]


def test_the_examples_still_validate_and_render_their_env() -> None:
    spec = load_spec(DIGITS, ["spec.kubernetes.env.MY_FLAG=on-please"])
    assert spec.spec.kubernetes.env["MY_FLAG"] == "on-please"
    code, out, _ = run("render", DIGITS, "-t", "pytorchjob", "--set", "spec.kubernetes.env.MY_FLAG=on-please")
    job = next(d for d in yaml.safe_load_all(out) if d["kind"] == "PyTorchJob")
    env = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["env"]
    assert code == 0 and {"name": "MY_FLAG", "value": "on-please"} in env
    assert [e["value"] for e in env if e["name"] == Env.SPEC] == ["/etc/torchrig/job.yaml"]
