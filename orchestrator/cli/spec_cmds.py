"""`torchrig validate`, `torchrig render` and `torchrig schema`: everything about job files that needs
no cluster. Imports only the model and the compilers (never torch, ray or kubernetes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import get_args

import click

from orchestrator.cli._common import emit_json, handle_errors, output_option, set_option
from orchestrator.compile import check_target
from orchestrator.compile import render as render_target
from orchestrator.errors import EXIT_USAGE, CompileError, SpecError
from orchestrator.loader import load_spec
from orchestrator.spec import JobSpec, RayClusterConfig
from orchestrator.targets import DEFAULT_TARGET, TARGETS, get_target

__all__ = ["render", "schema", "validate"]

_JOB_ARG = click.argument("job", metavar="JOB.yaml", type=click.Path(dir_okay=False, allow_dash=True))
_FIXED_SIZE = click.option(
    "--fixed-size",
    is_flag=True,
    help="Run an elastic job (nodes.min < nodes.max) at nodes.max nodes on a fixed-size shape.",
)
_ALLOW_POD_LOCAL = click.option(
    "--allow-pod-local-stores",
    "--allow-node-local-stores",
    "allow_pod_local_stores",
    is_flag=True,
    help="Kubernetes targets and Ray clusters: accept a job whose checkpoint stores all live on one pod's or "
    "node's own disk (a warning instead of an error; each pod or node then keeps only its own shards).",
)


@click.command(
    epilog=(
        "Examples:\n\n"
        "  torchrig validate examples/digits-ddp.yaml\n\n"
        "  torchrig validate job.yaml --set spec.nodes.max=4 -o json\n\n"
        "  torchrig validate job.yaml --target pytorchjob\n\n"
        "Problems are printed one per line as `error: FILE: PATH: MESSAGE` (exit code 2); options "
        "that are set but have no effect as `warning: PATH: MESSAGE` (exit code 0)."
    )
)
@_JOB_ARG
@click.option(
    "--target",
    "-t",
    type=click.Choice(tuple(TARGETS)),
    default=None,
    help="Also apply what this target refuses (a Kubernetes operator's name limit, pod-local checkpoint "
    "stores on a multi-node job, inline credentials), as `render` would.",
)
@_FIXED_SIZE
@_ALLOW_POD_LOCAL
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False, exists=True),
    default=None,
    help="A run of this job: warn when its last checkpoint took longer to save than "
    "spec.restarts.preemptGraceSeconds (an emergency checkpoint on SIGTERM would not commit in time).",
)
@set_option
@output_option
@handle_errors
def validate(
    job: str,
    target: str | None,
    fixed_size: bool,
    allow_pod_local_stores: bool,
    run_dir: str | None,
    overrides: tuple[str, ...],
    output: str,
) -> None:
    """Check JOB.yaml (after --set overrides) against the job model, and with --target against that target.

    Prints `ok` when the job is valid. Nothing is submitted and no cluster is needed.
    """
    try:
        spec = load_spec(job, list(overrides))
        target_warnings = (
            check_target(spec, target, fixed_size=fixed_size, allow_pod_local_stores=allow_pod_local_stores)
            if target
            else []
        )
    except (SpecError, CompileError) as exc:
        if output != "json":
            raise
        problems = exc.problems if isinstance(exc, SpecError) else [str(exc)]
        emit_json({"ok": False, "file": job, "problems": problems})
        raise SystemExit(EXIT_USAGE) from None
    warnings = spec.warnings() + target_warnings
    if run_dir is not None:
        from orchestrator.rundir import preempt_grace_warning

        grace = preempt_grace_warning(spec.spec.restarts.preempt_grace_seconds, Path(run_dir))
        warnings += [grace] if grace else []
    if output == "json":
        emit_json({"ok": True, "file": job, "name": spec.name, "warnings": warnings})
        return
    for line in warnings:
        click.echo(f"warning: {line}", err=True)
    click.echo("ok")


@click.command(
    epilog=(
        "Targets:\n\n" + "".join(f"  {t.name:<10}  {t.summary}\n\n" for t in TARGETS.values()) + "Examples:\n\n"
        "  torchrig render examples/digits-ddp.yaml --target pytorchjob | kubectl apply -f -\n\n"
        "  torchrig render examples/tinygpt-fsdp.yaml --target trainjob --fixed-size --monitoring\n\n"
        "  torchrig render job.yaml --target torchrun --set spec.nodes.max=2\n\n"
        "  torchrig render job.yaml --target raycluster --cloud gcp > cluster.yaml && ray up -y cluster.yaml"
    )
)
@_JOB_ARG
@click.option(
    "--target",
    "-t",
    type=click.Choice(tuple(TARGETS)),
    default=DEFAULT_TARGET,
    show_default=True,
    help="What to render.",
)
@click.option("--monitoring", is_flag=True, help="Also render a PodMonitor and a PrometheusRule (prometheus-operator).")
@click.option(
    "--cloud",
    type=click.Choice(get_args(RayClusterConfig.model_fields["cloud"].annotation)),
    default=None,
    help="Ray cluster files: the cloud (same as --set spec.ray.cluster.cloud=CLOUD).",
)
@_FIXED_SIZE
@_ALLOW_POD_LOCAL
@set_option
@handle_errors
def render(
    job: str,
    target: str,
    monitoring: bool,
    cloud: str | None,
    fixed_size: bool,
    allow_pod_local_stores: bool,
    overrides: tuple[str, ...],
) -> None:
    """Print what TARGET would get for JOB.yaml: manifests as multi-document YAML ready for
    `kubectl apply -f -`, or a launch plan.

    A target that cannot express part of the job, or would run it unsafely, fails with exit code 2 and
    names the field and the alternative (e.g. an elastic job on trainjob, a multi-node job whose
    checkpoint stores all live inside one pod). Warnings go to stderr.
    """
    if monitoring and not get_target(target).manifests:
        raise SpecError(f"--monitoring: applies to Kubernetes targets only, not {target!r}")
    if cloud is not None:
        if not get_target(target).ray_cluster:
            raise SpecError(f"--cloud: applies to Ray cluster files only, not {target!r}")
        overrides = (*overrides, f"spec.ray.cluster.cloud={cloud}")
    spec = load_spec(job, list(overrides))
    for line in check_target(spec, target, fixed_size=fixed_size, allow_pod_local_stores=allow_pod_local_stores):
        click.echo(f"warning: {line}", err=True)
    text = render_target(
        spec, target, monitoring=monitoring, fixed_size=fixed_size, allow_pod_local_stores=allow_pod_local_stores
    )
    click.echo(text, nl=False)


@click.command(
    epilog=(
        "Examples:\n\n"
        "  torchrig schema > torchrig.schema.json\n\n"
        "  # editors: first line of a job file\n\n"
        "  # yaml-language-server: $schema=./torchrig.schema.json"
    )
)
def schema() -> None:
    """Print the JSON Schema of job files (camelCase keys, with descriptions and defaults)."""
    click.echo(json.dumps(job_schema(), indent=2, sort_keys=False))


def job_schema() -> dict[str, object]:
    """The JSON Schema of a TrainingJob document, by alias."""
    out = JobSpec.model_json_schema(by_alias=True, mode="validation")
    out["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    out.setdefault("title", "TrainingJob")
    return out
