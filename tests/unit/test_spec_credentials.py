"""Credentials written inline anywhere in a job are refused by path, never echoed (issue 33 point 4);
`spec.kubernetes.env` refuses torchrun's `PET_*` arguments (issue 40 point 10).

The loader is the one place `validate`, `render`, `submit`, `run`, drills and the chart's generated
values read jobs through, so the tests go through it (and the CLI), not through the scanner alone.
"""

from __future__ import annotations

import copy
import itertools
import re
import string
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.chart import values_document
from orchestrator.cli import cli
from orchestrator.credentials import inline_secrets
from orchestrator.errors import SpecError
from orchestrator.loader import load_spec, validate_document
from tests.fixtures import spec_variants

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
DIGITS = REPO / "examples" / "digits-ddp.yaml"

_UPPER = string.ascii_uppercase + string.digits
_ALNUM = string.ascii_letters + string.digits


def _text(alphabet: str, size: int) -> st.SearchStrategy[str]:
    return st.text(alphabet, min_size=size, max_size=size)


# Credential-shaped values, drawn (never real ones): each family the scanner knows by its value alone.
CREDENTIAL_VALUES = st.one_of(
    st.builds(lambda p, s: p + s, st.sampled_from(["AKIA", "ASIA"]), _text(_UPPER, 16)),
    st.builds(lambda s: "hf_" + s, st.text(_ALNUM, min_size=30, max_size=40)),
    st.builds(lambda s: "ghp_" + s, _text(_ALNUM, 36)),
    st.builds(lambda s: "github_pat_" + s, st.text(_ALNUM + "_", min_size=22, max_size=82)),
    st.builds(lambda s: "xoxb-" + s, st.text(_ALNUM + "-", min_size=10, max_size=40)),
    st.builds(lambda s: "AIza" + s, _text(_ALNUM + "_-", 35)),
    st.builds(
        lambda kind, body: f"-----BEGIN {kind}PRIVATE KEY-----\n{body}\n-----END {kind}PRIVATE KEY-----",
        st.sampled_from(["", "RSA ", "EC ", "OPENSSH "]),
        st.text(_ALNUM + "+/", min_size=1, max_size=64),
    ),
    st.builds(lambda s: '{"type": "service_account", "private_key": "' + s + '"}', st.text(_ALNUM, max_size=20)),
    st.builds(lambda s: "Bearer " + s, st.text(_ALNUM + "._-", min_size=16, max_size=60)),
    st.builds(
        lambda a, b, c: f"eyJ{a}.eyJ{b}.{c}", *(st.text(_ALNUM + "_-", min_size=8, max_size=30) for _ in range(3))
    ),
    st.builds(
        lambda scheme, user, pw: f"{scheme}://{user}:{pw}@host.example:1234/db",
        st.sampled_from(["https", "postgres", "redis", "s3"]),
        st.text(_ALNUM, min_size=1, max_size=12),
        st.text(_ALNUM + "!$&*", min_size=1, max_size=20),
    ),
)
# Names that say credential, in an environment map (the value is then anything but a reference or a path).
CREDENTIAL_NAMES = st.builds(
    lambda prefix, word: f"{prefix}_{word}" if prefix else word,
    st.sampled_from(["", "AWS", "HF", "WANDB", "MY_APP", "DB"]),
    st.sampled_from(
        ["SECRET", "SECRET_ACCESS_KEY", "TOKEN", "ACCESS_TOKEN", "PASSWORD", "API_KEY", "KEY", "CREDENTIALS"]
    ),
).filter(lambda name: name != "KEY")
# At least 8 characters, so that finding one in the message would mean it was echoed.
PLAIN_VALUES = st.text(_ALNUM + " -.,", min_size=8, max_size=24).filter(lambda v: bool(v.strip()))

# Where a drawn value goes: (the document's keys down to it, the path the error must name).
SLOTS: list[tuple[tuple[Any, ...], str]] = [
    (("spec", "kubernetes", "env", "APP_SETTING"), "spec.kubernetes.env.APP_SETTING"),
    (("spec", "ray", "runtimeEnv", "env_vars", "APP_SETTING"), "spec.ray.runtimeEnv.env_vars.APP_SETTING"),
    (("spec", "ray", "runtimeEnv", "config", "setup", 0), "spec.ray.runtimeEnv.config.setup[0]"),
    (
        ("spec", "checkpoint", "stores", 0, "options", "client_kwargs", 0, "extra"),
        "spec.checkpoint.stores[0].options.client_kwargs[0].extra",
    ),
    (("spec", "task", "args", "dataset"), "spec.task.args.dataset"),
    (("metadata", "annotations", "example.com/note"), "metadata.annotations.example.com/note"),
    (("spec", "kubernetes", "tolerations", 0, "value"), "spec.kubernetes.tolerations[0].value"),
    (("spec", "checkpoint", "initFrom", "options", "profile_data"), "spec.checkpoint.initFrom.options.profile_data"),
]


def _base() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(DIGITS.read_text())
    doc["spec"]["checkpoint"]["stores"] = [{"uri": "s3://bucket/ckpt"}]
    doc["spec"]["checkpoint"]["initFrom"] = {"uri": "s3://bucket/base"}
    return doc


def _put(doc: dict[str, Any], keys: tuple[Any, ...], value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    node: Any = doc
    for key, nxt in itertools.pairwise(keys):
        if isinstance(key, int):
            while len(node) <= key:
                node.append([] if isinstance(nxt, int) else {})
            node = node[key]
        else:
            node = node.setdefault(key, [] if isinstance(nxt, int) else {})
    last = keys[-1]
    if isinstance(last, int):
        node.append(value)
    else:
        node[last] = value
    return doc


def _refusal(doc: dict[str, Any], tmp_path: Path) -> list[str]:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    with pytest.raises(SpecError) as info:
        load_spec(job)
    return info.value.problems


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=CREDENTIAL_VALUES, slot=st.sampled_from(SLOTS))
def test_a_credential_shaped_value_anywhere_is_refused_with_its_path(
    value: str, slot: tuple[tuple[Any, ...], str], tmp_path: Path
) -> None:
    keys, path = slot
    doc = _put(_base(), keys, value)
    validate_document(copy.deepcopy(doc))  # a valid job but for the credential
    problems = _refusal(doc, tmp_path)
    assert [p.split(": ", 1)[0] for p in problems] == [path]
    assert value not in problems[0] and value.split("\n", maxsplit=1)[0] not in problems[0]
    assert "secretRef" in problems[0]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=CREDENTIAL_NAMES, value=PLAIN_VALUES, where=st.sampled_from(["kubernetes", "ray"]))
def test_a_value_under_a_credential_name_is_refused(name: str, value: str, where: str, tmp_path: Path) -> None:
    if where == "kubernetes":
        keys, path = ("spec", "kubernetes", "env", name), f"spec.kubernetes.env.{name}"
    else:
        keys, path = ("spec", "ray", "runtimeEnv", "env_vars", name), f"spec.ray.runtimeEnv.env_vars.{name}"
    problems = _refusal(_put(_base(), keys, value), tmp_path)
    assert len(problems) == 1 and problems[0].startswith(f"{path}: ")
    assert value not in problems[0]


@pytest.mark.parametrize(
    ("change", "path"),
    [
        # The four shapes of issue 33 point 4.
        (
            "spec.kubernetes.env={AWS_SECRET_ACCESS_KEY: wJalrXUtnFEMIK7MDENGbPxRfiCYzzzzzzzzzzzz}",
            "spec.kubernetes.env",
        ),
        ("spec.ray.runtimeEnv={env_vars: {HF_TOKEN: abc}}", "spec.ray.runtimeEnv.env_vars.HF_TOKEN"),
        (
            "spec.checkpoint.stores=[{uri: 's3://b/x', options: {client_kwargs: [{aws_secret_access_key: x}]}}]",
            "spec.checkpoint.stores[0].options.client_kwargs[0].aws_secret_access_key",
        ),
        ("spec.checkpoint.stores=[{uri: 's3://AKIAIOSFODNN7EXAMPLE:pw@bucket/x'}]", "spec.checkpoint.stores[0].uri"),
        # The store options the compiler refused before, now refused for every command.
        ("spec.checkpoint.stores=[{uri: 's3://b/x', options: {key: AKIA, secret: s3}}]", "spec.checkpoint.stores[0]"),
        ("spec.ray.address=http://admin:hunter2@ray-head:8265", "spec.ray.address"),
        # Task arguments: a token after a word of authentication (`eos_token` is text).
        ("spec.task.args={hf_token: abcdefgh12, eos_token: '</s>'}", "spec.task.args.hf_token"),
    ],
)
def test_issue_shapes_are_refused_naming_the_field(change: str, path: str) -> None:
    with pytest.raises(SpecError) as info:
        load_spec(DIGITS, [change])
    assert info.value.problems and all(p.startswith(path) for p in info.value.problems)
    assert not any("eos_token" in p for p in info.value.problems)
    for secret in ("wJalrXUtnFEMIK7MDENGbPxRfiCY", "AKIAIOSFODNN7EXAMPLE", "hunter2", ": abc"):
        assert secret not in str(info.value)


def test_an_aws_secret_key_is_found_beside_its_access_key_id_by_its_shape() -> None:
    env = "{ID: AKIAIOSFODNN7EXAMPLE, OTHER: wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY}"
    with pytest.raises(SpecError) as info:
        load_spec(DIGITS, [f"spec.ray.runtimeEnv={{env_vars: {env}}}"])
    assert [p.split(":")[0] for p in info.value.problems] == [
        "spec.ray.runtimeEnv.env_vars.ID",
        "spec.ray.runtimeEnv.env_vars.OTHER",
    ]


def test_a_map_key_that_is_a_credential_is_not_echoed() -> None:
    token = "hf_" + "a1" * 20
    with pytest.raises(SpecError) as info:
        load_spec(DIGITS, [f"spec.task.args={{{token}: 1}}"])
    assert token not in str(info.value) and "spec.task.args[<redacted>]" in str(info.value)


# -- what must never trip it --------------------------------------------------------------------------------


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_the_examples_hold_no_inline_secret(example: Path) -> None:
    assert inline_secrets(load_spec(example)) == []


def test_every_variant_of_the_default_job_holds_no_inline_secret() -> None:
    """Every leaf of the model changed (tests/fixtures/spec_variants.py): model fields named `secretRef`,
    `key` fields of tolerations, `keep`, ... are no credentials."""
    base = values_document()  # the chart's default job, resolved (as tests/integration/test_helm.py uses it)
    docs = [v.apply(base) for v in spec_variants.variants(base)]
    assert len(docs) > 50
    found = {str(i): inline_secrets(validate_document(d)) for i, d in enumerate(docs)}
    assert {k: v for k, v in found.items() if v} == {}


# Real settings users put in a job: names with KEY/TOKEN/CREDENTIALS in them that hold no secret.
BENIGN_ENV = {
    "PYTHONHASHSEED": "0",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HOME": "/cache/hf",
    "HF_HUB_OFFLINE": "1",
    "NCCL_DEBUG": "INFO",
    "OMP_NUM_THREADS": "4",
    "AWS_REGION": "eu-west-1",
    "AWS_ENDPOINT_URL": "http://minio:9000",
    "AWS_ROLE_ARN": "arn:aws:iam::123456789012:role/train",
    "AWS_WEB_IDENTITY_TOKEN_FILE": "/var/run/secrets/eks.amazonaws.com/serviceaccount/token",
    "GOOGLE_APPLICATION_CREDENTIALS": "/var/run/secrets/gcp/key.json",
    "HF_TOKEN": "$(HF_TOKEN_FROM_SECRET)",
    "WANDB_API_KEY": "${WANDB_KEY}",
    "SECRET_NAME": "train-creds",
    "TOKEN_TTL": "3600",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
}
BENIGN_ARGS = {
    "tokenizer": "gpt2",
    "max_tokens": 2048,
    "eos_token": "</s>",
    "pad_token_id": 50256,
    "bos_token": "<|endoftext|>",
    "tokens_per_step": 65536,
    "patience": 3,
    "sort_key": "length",
    "key": "text",
    "keep": 3,
}
BENIGN_OPTIONS = {
    "endpoint_url": "http://minio:9000",
    "anon": False,
    "token": "google_default",
    "client_kwargs": {"region_name": "eu-west-1"},
}


@settings(max_examples=60, deadline=None)
@given(
    env=st.dictionaries(st.sampled_from(sorted(BENIGN_ENV)), st.just(""), max_size=len(BENIGN_ENV)),
    args=st.dictionaries(st.sampled_from(sorted(BENIGN_ARGS)), st.just(""), max_size=len(BENIGN_ARGS)),
    annotations=st.dictionaries(
        st.sampled_from(["vault.hashicorp.com/agent-inject-secret-db", "example.com/token-issuer"]),
        st.sampled_from(["database/creds/train", "sts"]),
    ),
)
def test_ordinary_settings_never_trip_it(
    env: dict[str, str], args: dict[str, str], annotations: dict[str, str]
) -> None:
    doc = _base()
    doc["spec"]["kubernetes"] = {"env": {k: BENIGN_ENV[k] for k in env}, "tolerations": [{"key": "gpu"}]}
    doc["spec"]["ray"] = {"runtimeEnv": {"env_vars": {k: BENIGN_ENV[k] for k in env}}}
    doc["spec"]["task"]["args"] = {**doc["spec"]["task"].get("args", {}), **{k: BENIGN_ARGS[k] for k in args}}
    doc["spec"]["checkpoint"]["stores"][0]["options"] = BENIGN_OPTIONS
    doc["metadata"]["annotations"] = annotations
    assert inline_secrets(validate_document(doc)) == []


# -- the CLI -----------------------------------------------------------------------------------------------


def _invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


TOKEN_SET = "spec.kubernetes.env.HF_TOKEN=hf_" + "Z9" * 16


@pytest.mark.parametrize(
    "command",
    [
        ["validate"],
        ["render", "--target", "pytorchjob"],
        ["render", "--target", "torchrun"],
        ["submit", "--dry-run"],
        ["run", "--dry-run"],
    ],
)
def test_every_command_refuses_an_inline_secret_in_one_line(command: list[str], tmp_path: Path) -> None:
    run_dir = ["--run-dir", str(tmp_path / "r")] if command[0] in ("run", "submit") else []
    code, out, err = _invoke(*command, str(DIGITS), "--set", TOKEN_SET, *run_dir)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and "spec.kubernetes.env.HF_TOKEN: a Hugging Face token" in err
    assert "Z9Z9" not in err and "Traceback" not in err


def test_allow_inline_secrets_is_a_warning_for_a_local_run_only(tmp_path: Path) -> None:
    run_dir = str(tmp_path / "r")
    code, out, err = _invoke(
        "run", str(DIGITS), "--dry-run", "--allow-inline-secrets", "--set", TOKEN_SET, "--run-dir", run_dir
    )
    assert code == 0 and out
    assert "warning: spec.kubernetes.env.HF_TOKEN: a Hugging Face token written inline (accepted" in err
    assert "Z9Z9" not in err
    for backend in ("ray", "kubernetes"):
        code, out, err = _invoke(
            "run", str(DIGITS), "--backend", backend, "--dry-run", "--allow-inline-secrets", "--set", TOKEN_SET
        )
        assert (code, out) == (2, "") and err.startswith("error: --allow-inline-secrets: for the local backend only")


# -- PET_* (issue 40 point 10) -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["PET_NNODES", "PET_NODE_RANK", "PET_RDZV_ENDPOINT", "PET_MAX_RESTARTS", "PET_X"])
def test_torchrun_arguments_in_kubernetes_env_are_refused(name: str) -> None:
    """The operators set torchrun's `PET_*` arguments on every pod after the spec's env, so a value in
    the spec is silently overridden (or worse, half-applied):

    - training-operator v1.9.4 `pkg/controller.v1/pytorch/envvar.go` (`setPodEnv`: PET_NPROC_PER_NODE,
      PET_NNODES, PET_NODE_RANK) and `elastic.go` (PET_RDZV_BACKEND, PET_RDZV_ENDPOINT, PET_RDZV_ID,
      PET_RDZV_CONF, PET_MAX_RESTARTS, ...), `master.go` (PET_MASTER_ADDR/PORT);
    - Trainer v2.3.0 `pkg/runtime/framework/plugins/torch/torch.go` ("Inject PET_* envs into trainer main
      container (always)", `apply.UpsertEnvVars`) with the names in `pkg/constants/constants.go`.

    torchrun itself reads each of its arguments from `PET_<ARG>` (torch.distributed.run), so any
    `PET_*` changes the launch behind the backend's back: refused like torchrun's own variables.
    """
    with pytest.raises(SpecError) as info:
        load_spec(DIGITS, [f"spec.kubernetes.env.{name}=c10d"])
    (problem,) = info.value.problems
    assert problem.startswith(f"spec.kubernetes.env.{name}: PET_* are torchrun's arguments")


@pytest.mark.parametrize("target", ["pytorchjob", "trainjob", "rayjob"])
def test_compile_refuses_a_job_built_in_python_with_an_inline_secret(target: str) -> None:
    """The Python API (`orchestrator.api`) builds a JobSpec without the loader: the Kubernetes compilers
    refuse what the loader would, so a secret never reaches a ConfigMap or `env: value:` that way either."""
    from orchestrator.compile import compile as compile_target
    from orchestrator.errors import UnsupportedFeature
    from orchestrator.spec import JobSpec

    doc = yaml.safe_load(DIGITS.read_text())
    doc["spec"]["nodes"] = {"min": 2, "max": 2}
    doc["spec"].setdefault("kubernetes", {})["env"] = {"HF_TOKEN": "hf_" + "a1" * 20}
    spec = JobSpec.model_validate(doc)
    with pytest.raises(UnsupportedFeature) as info:
        compile_target(spec, target, allow_pod_local_stores=True)
    assert str(info.value).startswith("spec.kubernetes.env.HF_TOKEN: ") and "a1a1" not in str(info.value)


@pytest.mark.parametrize(
    "text",
    [
        "x" * 200_000,  # one long word: every start of a scheme tried and backtracked over (quadratic)
        "eyJ" * 60_000,  # a JWT's first segment started at each `eyJ`
        "a://" * 50_000,
        "a" * 100_000 + ":" + "b" * 100_000,
        "hf_" * 60_000,
    ],
    ids=["word", "eyJ", "schemes", "colon", "hf"],
)
def test_a_long_value_is_scanned_in_linear_time(text: str) -> None:
    """A job's strings are the user's (or a generated config's): a backtracking pattern made `render` of a
    100,000-character task argument run for minutes (quadratic: 200,000 characters took ~25 s per scan
    and a render scans more than once). Linear, each of these scans takes milliseconds; the bound is a
    thousand times that, so only a quadratic pattern can cross it, however loaded the machine."""
    import time

    from orchestrator.credentials import scan_value

    start = time.perf_counter()
    scan_value(text)
    assert time.perf_counter() - start < 5.0


# -- the chart's copy of the rules ---------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    before=st.text(string.printable, max_size=6),
    value=st.one_of(CREDENTIAL_VALUES, st.text(string.printable, max_size=40)),
    after=st.text(string.printable, max_size=6),
)
def test_the_charts_re2_patterns_find_what_the_loaders_find(before: str, value: str, after: str) -> None:
    """`re2` drops the lookarounds RE2 (Helm) lacks; whether a text holds a match must not change."""
    from orchestrator.credentials import _VALUE_SHAPES, re2

    text = before + value + after
    for _, pattern in _VALUE_SHAPES:
        assert bool(pattern.search(text)) == bool(re.search(re2(pattern.pattern), text)), pattern.pattern


def test_a_lookaround_re2_cannot_express_is_refused_when_the_chart_is_generated() -> None:
    from orchestrator.credentials import re2

    with pytest.raises(ValueError, match="lookaround"):
        re2(r"(?<=ab)c")
