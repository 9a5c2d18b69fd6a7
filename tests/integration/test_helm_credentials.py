"""The chart refuses a credential written inline anywhere in a job given as values, as torchrig's loader does.

`helm install NAME helm/torchrig -f job.yaml` never passes through `orchestrator.loader`: without its own
check the chart would put the secret into the spec ConfigMap and the pods' env. The chart reads the
loader's rules from the generated `_credentials.tpl` (orchestrator.credentials.chart_rules) and must
refuse exactly what the loader refuses, with the same one-line message. Rendered with the real helm binary.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.errors import SpecError
from orchestrator.loader import load_spec
from tests.integration.test_helm import CHART, run_helm
from tests.unit.test_spec_credentials import (
    BENIGN_ARGS,
    BENIGN_ENV,
    BENIGN_OPTIONS,
    CREDENTIAL_NAMES,
    CREDENTIAL_VALUES,
    PLAIN_VALUES,
    SLOTS,
    _base,
    _put,
)

pytestmark = [pytest.mark.helm, pytest.mark.timeout(300)]

_SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _loader_problems(doc: dict[str, Any], tmp_path: Path) -> list[str]:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    with pytest.raises(SpecError) as info:
        load_spec(job)
    return info.value.problems


def _chart_refusal(doc: dict[str, Any], tmp_path: Path) -> str:
    job = tmp_path / "values.yaml"
    job.write_text(yaml.safe_dump(doc))
    proc = run_helm("template", "t", str(CHART), "-f", str(job), "--set", "fixedSize=true", check=False)
    assert proc.returncode != 0, "the chart rendered a job with an inline credential"
    line = next(line for line in proc.stderr.splitlines() if line.startswith("Error:"))
    return line.split("): ", 1)[1] if "): " in line else line


def _assert_refused_alike(doc: dict[str, Any], tmp_path: Path, secret: str) -> None:
    problems = _loader_problems(copy.deepcopy(doc), tmp_path)
    message = _chart_refusal(doc, tmp_path)
    assert message in problems, (message, problems)
    assert secret.strip() not in message


@_SETTINGS
@given(value=CREDENTIAL_VALUES, slot=st.sampled_from(SLOTS))
def test_a_credential_shaped_value_anywhere_is_refused_with_the_loaders_message(
    value: str, slot: tuple[tuple[Any, ...], str], tmp_path: Path
) -> None:
    keys, _ = slot
    _assert_refused_alike(_put(_base(), keys, value), tmp_path, value.split("\n", maxsplit=1)[0])


# Names that say credential in general text (task arguments): `token` only after a word of authentication.
GENERAL_NAMES = st.sampled_from(["hf_token", "access_token", "api_key", "db_password", "client_secret", "token"])


@_SETTINGS
@given(
    where=st.sampled_from(
        [
            (("spec", "kubernetes", "env"), CREDENTIAL_NAMES),
            (("spec", "ray", "runtimeEnv", "env_vars"), CREDENTIAL_NAMES),
            (("spec", "task", "args"), GENERAL_NAMES),
        ]
    ),
    value=PLAIN_VALUES,
    data=st.data(),
)
def test_a_value_under_a_credential_name_is_refused_with_the_loaders_message(
    where: tuple[tuple[str, ...], st.SearchStrategy[str]], value: str, data: st.DataObject, tmp_path: Path
) -> None:
    keys, names = where
    _assert_refused_alike(_put(_base(), (*keys, data.draw(names)), value), tmp_path, value)


_TOKEN_KEY = "hf_" + "a1" * 20


@pytest.mark.parametrize(
    ("keys", "value", "secret"),
    [
        # a store's options (a credential-like key there is the compiler's rule, checked first: tests/integration/
        # test_helm_policies.py); a password in a URI is the loader's
        (
            ("spec", "checkpoint", "initFrom", "options", "endpoint_url"),
            "https://admin:hunter22@minio:9000",
            "hunter22",
        ),
        (("spec", "task", "args", _TOKEN_KEY), 1, _TOKEN_KEY),  # a map key that is itself a token
        (
            ("spec", "ray", "runtimeEnv", "env_vars", "OTHER"),
            "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",  # recognisable only beside its key id (set below)
            "wJalrXUtnFEMI",
        ),
    ],
    ids=["options", "key", "aws-secret-beside-id"],
)
def test_each_rule_of_the_loader_holds_in_the_chart(
    keys: tuple[str, ...], value: Any, secret: str, tmp_path: Path
) -> None:
    doc = _put(_base(), keys, value)
    if keys[-1] == "OTHER":
        doc = _put(doc, ("spec", "ray", "runtimeEnv", "env_vars", "ID"), "AKIAIOSFODNN7EXAMPLE")
    _assert_refused_alike(doc, tmp_path, secret)


def test_ordinary_settings_render(tmp_path: Path) -> None:
    """Names with KEY/TOKEN/CREDENTIALS in them that hold no secret (the loader's own benign corpus) pass."""
    doc = _base()
    doc["spec"]["kubernetes"] = {"env": dict(BENIGN_ENV), "tolerations": [{"key": "gpu"}]}
    doc["spec"]["ray"] = {"runtimeEnv": {"env_vars": dict(BENIGN_ENV)}}
    doc["spec"]["task"]["args"] = {**doc["spec"]["task"].get("args", {}), **BENIGN_ARGS}
    doc["spec"]["checkpoint"]["stores"][0]["options"] = BENIGN_OPTIONS
    doc["metadata"]["annotations"] = {"vault.hashicorp.com/agent-inject-secret-db": "database/creds/train"}
    job = tmp_path / "values.yaml"
    job.write_text(yaml.safe_dump(doc))
    load_spec(job)  # the loader accepts it...
    proc = run_helm("template", "t", str(CHART), "-f", str(job), "--set", "fixedSize=true", check=False)
    assert proc.returncode == 0, proc.stderr  # ...and so does the chart
