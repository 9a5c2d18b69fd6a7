"""`torchrig checkpoints list|verify|inspect`: what the stores hold, whether it verifies, what is inside.

Nothing a store holds is executed: manifests are JSON checked against the writer's layout, DCP metadata is
unpickled with an allow-list (`training.checkpoint.dcp_metadata`). With `TORCHRIG_CHECKPOINT_KEY` in the
environment, manifests are authenticated and `verify` fails on an unsigned or wrongly signed one.
"""

from __future__ import annotations

import os
import pickle
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import click
import yaml
from pydantic import ValidationError

from orchestrator.cli._common import emit_json, handle_errors, output_option
from orchestrator.errors import BackendError, SpecError, TorchrigError

if TYPE_CHECKING:
    from training.checkpoint.manifest import CheckpointListing, Manifest
    from training.checkpoint.storage import CheckpointStorage

__all__ = ["checkpoints"]

EXIT_INVALID = 1
DCP_METADATA_MAX_BYTES = 1 << 30  # DCP's metadata of a large sharded model is hundreds of MB; bounded all the same


class CheckpointInvalidError(TorchrigError):
    """The newest committed checkpoint of a store does not verify."""


def _parse_options(pairs: tuple[str, ...]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise SpecError(f"--option: expected key=value, got {pair!r}")
        # YAML scalars, so `anon=true` or `max_attempts=3` arrive typed.
        options[key] = yaml.safe_load(raw) if raw else ""
    # Credentials never on the command line (shell history, `ps`): the store clients read them from the
    # environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS, ...).
    from orchestrator.credentials import secret_option_paths

    for path in secret_option_paths(options, "--option"):
        raise SpecError(
            f"{path.replace('--option.', '--option ', 1)}: credentials are not taken from the command line; "
            "set them in the environment (e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY for s3://)"
        )
    return options


def _open(uris: tuple[str, ...], options: dict[str, Any]) -> list[CheckpointStorage]:
    from training.checkpoint.storage import open_storage
    from training.config import StoreConfig

    stores: list[CheckpointStorage] = []
    for uri in uris:
        try:
            StoreConfig(uri=uri)
        except ValidationError as exc:
            msg = str(exc.errors()[0]["msg"]).removeprefix("Value error, ")
            raise SpecError(f"STORE_URI {uri}: {msg}") from None
        try:
            store = open_storage(uri, options if "://" in uri and not uri.startswith("file://") else None)
        except (ImportError, ValueError, TypeError) as exc:
            raise SpecError(f"STORE_URI {uri}: {exc}") from None
        local = store.local_path()
        if local is not None and not os.path.isdir(local):  # a typo must not read as an empty store
            raise SpecError(f"STORE_URI {uri}: {'not a directory' if os.path.exists(local) else 'no such directory'}")
        stores.append(store)
    return stores


def _key() -> bytes | None:
    """The manifest signing key from the environment (never from argv: it would show in `ps`)."""
    from training.checkpoint.signing import signing_key_from_env

    try:
        return signing_key_from_env()
    except ValueError as exc:
        raise SpecError(str(exc)) from None


def _listing(store: CheckpointStorage, key: bytes | None = None) -> list[CheckpointListing]:
    from training.checkpoint.manifest import list_checkpoints

    try:
        return list_checkpoints(store, key=key)
    except Exception as exc:
        raise BackendError(f"{store.uri}: cannot list the store: {type(exc).__name__}: {exc}") from None


def _human(num: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num < 1024 or unit == "GiB":
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.1f} {unit}"
        num /= 1024
    return f"{num:.1f} TiB"


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _row(c: CheckpointListing) -> dict[str, Any]:
    m = c.manifest
    return {
        "step": c.step,
        "committed": c.committed,
        "job": m.job if m else None,
        "generation": m.generation if m else None,
        "world_size": m.world_size if m else None,
        "files": len(m.files) if m else None,
        "bytes": m.total_bytes if m else None,
        "time": m.time if m else None,
        "error": c.error,
    }


def _console() -> Any:
    from rich.console import Console

    console = Console(highlight=False)
    if not console.is_terminal:
        # Piped or captured output: do not squeeze URIs and states into 80 columns.
        console.width = 200
    return console


@click.group(name="checkpoints")
def checkpoints() -> None:
    """List, verify and inspect checkpoints in one or more stores.

    STORE_URI is a store root as in `spec.checkpoint.stores[].uri`: a path, `file:///abs`, or
    `s3://bucket/prefix` (with `--option endpoint_url=...`; credentials come from the environment,
    e.g. AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, never from the command line).
    """


_options = click.option(
    "--option",
    "pairs",
    multiple=True,
    metavar="KEY=VALUE",
    help="fsspec storage option for object stores (repeatable), e.g. endpoint_url=http://127.0.0.1:9000.",
)


@checkpoints.command(name="list")
@click.argument("uris", nargs=-1, required=True, metavar="STORE_URI...")
@_options
@output_option
@handle_errors
def list_cmd(uris: tuple[str, ...], pairs: tuple[str, ...], output: str) -> None:
    """List the steps in each store: committed or not, generation, world size, size.

    With several stores, one table shows which store holds which step.
    """
    key = _key()  # the environment's setting first: it is wrong for every store
    stores = _open(uris, _parse_options(pairs))
    per_store = {s.uri: {c.step: c for c in _listing(s, key)} for s in stores}
    if output == "json":
        emit_json(
            {uri: [_row(c) for c in sorted(rows.values(), key=lambda c: -c.step)] for uri, rows in per_store.items()}
        )
        return
    from rich.table import Table

    steps = sorted({step for rows in per_store.values() for step in rows}, reverse=True)
    table = Table(title="checkpoints" if len(stores) == 1 else "checkpoints across stores")
    for col in ("step", "job", "gen", "world", "size", "time (UTC)"):
        table.add_column(col, justify="right" if col != "time (UTC)" else "left", no_wrap=True)
    for store in stores:
        table.add_column(store.uri if len(stores) > 1 else "state", overflow="fold")
    for step in steps:
        present = [per_store[s.uri].get(step) for s in stores]
        ref = next((c.manifest for c in present if c is not None and c.manifest is not None), None)
        cells = []
        for c in present:
            if c is None:
                cells.append("[dim]-[/dim]")
            elif c.committed:
                cells.append("[green]committed[/green]")
            elif c.untrusted:
                cells.append("[red]untrusted[/red]")
            elif c.unreadable:
                cells.append("[red]unreadable[/red]")
            else:
                cells.append("[yellow]uncommitted[/yellow]" if not c.error else "[red]bad manifest[/red]")
        table.add_row(
            str(step),
            ref.job if ref else "?",
            str(ref.generation) if ref else "?",
            str(ref.world_size) if ref else "?",
            _human(ref.total_bytes) if ref else "?",
            _when(ref.time) if ref else "",
            *cells,
        )
    console = _console()
    if not steps:
        console.print("no checkpoints in " + ", ".join(s.uri for s in stores))
        return
    console.print(table)


@checkpoints.command(name="verify")
@click.argument("uris", nargs=-1, required=True, metavar="STORE_URI...")
@click.option("--step", type=int, default=None, help="Verify this step only (default: every committed step).")
@_options
@output_option
@handle_errors
def verify_cmd(uris: tuple[str, ...], step: int | None, pairs: tuple[str, ...], output: str) -> None:
    """Re-hash every file of the committed checkpoints against their manifests.

    Exits 1 when the newest committed checkpoint of a store (or `--step`) does not verify, or a store
    holds no committed checkpoint; the failing files are listed. With `TORCHRIG_CHECKPOINT_KEY` set,
    an unsigned, wrongly signed or malformed signature makes that step UNTRUSTED, which fails like a
    corrupt checkpoint; a manifest that could not be read (an I/O error) is UNREADABLE. Either is one
    step's status: the other steps are still checked.
    """
    from training.checkpoint.manifest import verify_store

    key = _key()  # the environment's setting first: it is wrong for every store
    stores = _open(uris, _parse_options(pairs))
    results: dict[str, list[dict[str, Any]]] = {}
    failures: list[str] = []
    for store in stores:
        listing = [c for c in _listing(store, key) if step is None or c.step == step]
        rows: list[dict[str, Any]] = []
        for c in listing:
            if c.untrusted or c.unreadable:  # one step: the others are still checked
                status = "UNTRUSTED" if c.untrusted else "UNREADABLE"
                rows.append({"step": c.step, "status": status, "bad": {}, "error": c.error})
                continue
            if c.manifest is None:
                row: dict[str, Any] = {"step": c.step, "status": "uncommitted" if not c.error else "bad manifest"}
                rows.append({**row, "bad": {}, **({"error": c.error} if c.error else {})})
                continue
            try:
                report = verify_store(store, c.manifest)
            except Exception as exc:
                raise BackendError(f"{store.uri}: cannot read step {c.step}: {exc}") from None
            if report.ok:
                report.bad.update(_unlisted_shards(store, c.manifest))
                report.ok = not report.bad
            rows.append({"step": c.step, "status": "ok" if report.ok else "CORRUPT", "bad": report.bad})
        results[store.uri] = rows
        # A damaged manifest was a commit marker once: it counts, and fails, like a corrupt checkpoint.
        committed = [r for r in rows if r["status"] in ("ok", "CORRUPT", "UNTRUSTED", "UNREADABLE", "bad manifest")]
        if step is not None and not rows:
            failures.append(f"{store.uri}: no step {step}")
        elif step is not None and rows[0]["status"] != "ok":
            failures.append(f"{store.uri}: step {step} is {rows[0]['status']}" + _why(rows[0]))
        elif not committed:
            failures.append(f"{store.uri}: no committed checkpoint")
        elif committed[0]["status"] != "ok":
            newest = committed[0]
            failures.append(f"{store.uri}: newest committed step {newest['step']} does not verify" + _why(newest))
    if output == "json":
        emit_json({"ok": not failures, "stores": results, "failures": failures})
    else:
        from rich.table import Table

        console = _console()
        for uri, rows in results.items():
            table = Table(title=f"verify {uri}")
            table.add_column("step", justify="right")
            table.add_column("status")
            table.add_column("failing files")
            for r in rows:
                color = {"ok": "green", "CORRUPT": "red", "UNTRUSTED": "red", "UNREADABLE": "red"}.get(
                    r["status"], "yellow"
                )
                bad = "\n".join([f"{k}: {v}" for k, v in sorted(r["bad"].items())] + [r.get("error") or ""]).strip()
                table.add_row(str(r["step"]), f"[{color}]{r['status']}[/{color}]", bad)
            console.print(table)
    if failures:
        if output != "json":
            for line in failures:
                click.echo(f"error: {line}", err=True)
        raise SystemExit(EXIT_INVALID)


@checkpoints.command(name="inspect")
@click.argument("uri", metavar="STORE_URI")
@click.option("--step", type=int, default=None, help="Step to inspect (default: the newest committed).")
@click.option(
    "--max-keys", type=click.IntRange(min=0), default=200, show_default=True, help="Show at most this many state keys."
)
@_options
@output_option
@handle_errors
def inspect_cmd(uri: str, step: int | None, max_keys: int, pairs: tuple[str, ...], output: str) -> None:
    """Show one checkpoint: its manifest and the tensors and values in its DCP metadata.

    The metadata is read with an allow-list unpickler: a crafted file cannot run code here.
    """
    (store,) = _open((uri,), _parse_options(pairs))
    listing = [c for c in _listing(store, _key()) if c.manifest is not None and (step is None or c.step == step)]
    if not listing:
        what = f"step {step}" if step is not None else "committed checkpoint"
        raise CheckpointInvalidError(f"{uri}: no {what}")
    manifest = listing[0].manifest
    assert manifest is not None
    keys = _state_keys(store, manifest)
    if output == "json":
        from dataclasses import asdict

        emit_json({"manifest": asdict(manifest), "state": keys})
        return
    from rich.table import Table

    console = _console()
    console.print(
        f"[bold]step {manifest.step}[/bold]  generation {manifest.generation}  world size {manifest.world_size}  "
        f"nodes {manifest.num_nodes}  job {manifest.job}  torch {manifest.torch_version}  "
        f"{_human(manifest.total_bytes)}  {_when(manifest.time)} UTC" + ("  (final)" if manifest.final else "")
    )
    part = manifest.digest_part_bytes
    algo = manifest.digest_algorithm
    digest = f"{algo} of {_human(part)} parts" if part else algo  # digest.py: a file of one part: its own hash
    files = Table(title=f"files (manifest version {manifest.version}; digest: {digest})")
    for col in ("path", "size", "digest", "rank", "node"):
        files.add_column(col)
    for f in manifest.files:
        files.add_row(f.path, _human(f.size), f.digest[:16] + "…", str(f.rank), str(f.node_rank))
    console.print(files)
    state = Table(title=f"state ({len(keys)} keys)")
    for col in ("key", "kind", "dtype", "shape"):
        state.add_column(col)
    for k in keys[:max_keys]:
        state.add_row(k["key"], k["kind"], k.get("dtype", ""), str(k.get("shape", "")))
    console.print(state)
    if len(keys) > max_keys:
        console.print(f"... {len(keys) - max_keys} more keys (--max-keys)")


def _why(row: dict[str, Any]) -> str:
    return f" ({row['error']})" if row.get("error") else ""


def _unlisted_shards(store: CheckpointStorage, manifest: Manifest) -> dict[str, str]:
    """The files DCP's metadata (verified against the manifest already) reads that the manifest does not
    list: a manifest whose every listed file is intact but which leaves a rank's shard out cannot be
    restored (the reader refuses an unlisted file), so `verify` must not call it ok."""
    from training.checkpoint.dcp_metadata import load_metadata
    from training.checkpoint.manifest import DCP_METADATA, step_dir

    listed = {f.path for f in manifest.files}
    try:
        data = store.read_bytes(f"{step_dir(manifest.step)}/{manifest.dcp_dir}/{DCP_METADATA}", DCP_METADATA_MAX_BYTES)
        metadata = load_metadata(data)
    except (OSError, ValueError, pickle.UnpicklingError) as exc:
        return {f"{manifest.dcp_dir}/{DCP_METADATA}": f"unreadable: {exc}"}
    needed = {f"{manifest.dcp_dir}/{info.relative_path}" for info in (metadata.storage_data or {}).values()}
    return {path: "read by the checkpoint, not in the manifest" for path in sorted(needed - listed)}


def _state_keys(store: CheckpointStorage, manifest: Manifest) -> list[dict[str, Any]]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from training.checkpoint.dcp_metadata import load_metadata
    from training.checkpoint.manifest import DCP_METADATA, step_dir

    rel = f"{step_dir(manifest.step)}/{manifest.dcp_dir}/{DCP_METADATA}"
    try:
        data = store.read_bytes(rel, max_bytes=DCP_METADATA_MAX_BYTES)
    except Exception as exc:
        raise BackendError(f"{store.uri}: cannot read {rel}: {exc}") from None
    try:
        # DCP's own format is a pickle (FileSystemWriter.finish): only its metadata classes are allowed.
        metadata = load_metadata(data)
    except pickle.UnpicklingError as exc:
        raise CheckpointInvalidError(f"{store.uri}: {rel}: {exc}") from None
    out: list[dict[str, Any]] = []
    for key, meta in sorted(metadata.state_dict_metadata.items()):
        if isinstance(meta, TensorStorageMetadata):
            dtype = str(meta.properties.dtype).removeprefix("torch.")
            out.append(
                {"key": key, "kind": "tensor", "dtype": dtype, "shape": list(meta.size), "chunks": len(meta.chunks)}
            )
        else:
            out.append({"key": key, "kind": "bytes"})
    return out
