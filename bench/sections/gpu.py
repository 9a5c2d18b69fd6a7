"""GPU: the NCCL path, NVML metrics against nvidia-smi, bf16 throughput and a bit-exact GPU recovery.

Runs where CUDA is (the device machine lent to some sessions; `python -m bench.sections.gpu --out F`
writes the same dict as JSON); on a CPU machine the section records why it was skipped. Every figure
comes from the product's own paths: `torchrig run` of the tinygpt example on one GPU (the worker picks
`cuda:0` and `nccl`), its metrics.jsonl and Prometheus exporter, `torchrig drill kill-worker`.

Measured:
- `facts`: torch, CUDA, NCCL and driver versions, the device.
- `throughput`: tokens/s, step time and MFU of tinygpt (FSDP2 and DDP, fp32 and bf16), medians over
  the steps after warm-up; `bf16_over_fp32` per strategy is the ratio of two runs in this section.
- `nvml`: the exporter's `torchrig_gpu_*` values next to `nvidia-smi`'s, read in the same second while
  a bf16 job trains.
- `drill`: a kill-worker drill on the GPU (one rank; a group restart from the checkpoint, NCCL
  re-initialised), MTTR and whether the end is bit-identical to the uninterrupted reference.
- `checkpoint`: a one-rank job's checkpoints on the GPU: the manifest's files against the bytes on disk,
  `torchrig checkpoints verify`, and a resubmit's restore (a GPU drill once restored nothing).
- `profile`: `metrics.profile` over three bf16 FSDP2 steps: the ops' device time against the steps'
  wall time (how much of a step the GPU is busy), and the costliest ops.
- `staging`: the device-to-host copy a checkpoint's staging blocks on (pageable, as `stage` does today)
  against a pinned, non-blocking copy of the same bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.common import PY, REPO, env, run
from bench.sections.base import Section
from training.contract import EventKind, RunFiles, read_jsonl

TINYGPT = REPO / "examples" / "tinygpt-fsdp.yaml"
# Larger than the example's 512 x 8 so that the GPU, not Python, bounds a step.
MODEL_ARGS = {"dim": 1024, "layers": 12, "heads": 16, "seq_len": 512}
METRICS_PORT = 29700
GPUS = 1  # per node (a test on a CPU machine sets 0)


def _spec_file(directory: Path, name: str, overrides: list[str]) -> Path:
    """The tinygpt example on one local GPU, renamed `name`, with `--set` overrides."""
    import yaml

    from orchestrator.loader import apply_overrides, read_yaml

    base = [
        f"metadata.name={name}",
        f"spec.resources.gpus={GPUS}",
        "spec.procsPerNode=1",
        "spec.nodes.min=1",
        "spec.nodes.max=1",
        'spec.checkpoint.stores=[{"uri": "file://./ckpt", "name": "local"}]',
        "spec.checkpoint.nodeLocal.enabled=false",
        "spec.training.evalAtEnd=false",
        "spec.metrics.logEvery=5",
        f"spec.metrics.port={METRICS_PORT}",
        *(f"spec.task.args.{k}={v}" for k, v in MODEL_ARGS.items()),
    ]
    doc = apply_overrides(read_yaml(TINYGPT.read_text(), str(TINYGPT)), [*base, *overrides])
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _no_checkpoints(steps: int) -> list[str]:
    """Overrides for a run that measures throughput: no periodic or final save."""
    return [f"spec.checkpoint.every.steps={steps * 10}", "spec.checkpoint.saveFinal=false"]


def _cli(*args: str, cwd: Path, timeout: float = 600) -> dict[str, Any]:
    """`torchrig ARGS -o json` in `cwd`; its JSON."""
    out = run([PY, "-m", "orchestrator.cli", *args, "-o", "json"], cwd=cwd, timeout=timeout)
    return dict(json.loads(out))


def facts() -> dict[str, Any]:
    import torch

    props = torch.cuda.get_device_properties(0)
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
    )
    nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
    return {
        "device": props.name,
        "multiprocessors": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
        "nvidia_smi": smi.stdout.strip(),
        "bf16_supported": torch.cuda.is_bf16_supported(),
    }


def _median_after(records: list[dict[str, Any]], key: str, skip: int) -> float | None:
    vals = [float(r[key]) for r in records if int(r["step"]) > skip and r.get(key) is not None]
    return statistics.median(vals) if vals else None


def throughput(tmp: Path, steps: int) -> dict[str, Any]:
    """tokens/s, step seconds and MFU per (strategy, precision); bf16/fp32 per strategy."""
    out: dict[str, Any] = {"model": MODEL_ARGS, "steps": steps}
    for strategy in ("fsdp", "ddp"):
        for precision in ("fp32", "bf16"):
            name = f"gpu-{strategy}-{precision}"
            spec = _spec_file(
                tmp,
                name,
                [
                    f"spec.training.steps={steps}",
                    f"spec.training.strategy={strategy}",
                    f"spec.training.precision={precision}",
                    *_no_checkpoints(steps),
                ],
            )
            summary = _cli("run", str(spec), cwd=tmp)
            records = read_jsonl(RunFiles(Path(summary["run_dir"])).metrics)
            result = json.loads(RunFiles(Path(summary["run_dir"])).result.read_text())
            skip = steps // 3
            out[f"{strategy}_{precision}"] = {
                "status": summary["status"],
                "device": result.get("device"),
                "backend": result.get("backend"),
                "tokens_per_s": _median_after(records, "tokens_per_s", skip),
                "step_s": _median_after(records, "step_s", skip),
                "mfu": _median_after(records, "mfu", skip),
            }
        fp32 = out[f"{strategy}_fp32"]["tokens_per_s"]
        bf16 = out[f"{strategy}_bf16"]["tokens_per_s"]
        out[f"{strategy}_bf16_over_fp32"] = round(bf16 / fp32, 3) if fp32 and bf16 else None
    return out


def _scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=5).read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(("torchrig_gpu_", "torchrig_mfu", "torchrig_tokens_per_second", "torchrig_step")):
                values[sample.name] = float(sample.value)
    return values


def _smi() -> dict[str, float]:
    fields = "utilization.gpu,memory.used,memory.total,power.draw,temperature.gpu"
    line = subprocess.run(
        ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()[0]
    util, used, total, power, temp = (float(v) for v in line.split(","))
    return {
        "utilization_ratio": util / 100,
        "memory_used_bytes": used * 2**20,
        "memory_total_bytes": total * 2**20,
        "power_watts": power,
        "temperature_celsius": temp,
    }


def nvml_against_smi(tmp: Path, steps: int, reads: int = 4) -> dict[str, Any]:
    """While a bf16 FSDP job trains: the exporter's GPU gauges and nvidia-smi's, read in the same second."""
    spec = _spec_file(
        tmp,
        "gpu-nvml",
        [f"spec.training.steps={steps}", *_no_checkpoints(steps)],
    )
    url = f"http://127.0.0.1:{METRICS_PORT}/metrics"
    proc = subprocess.Popen(
        [PY, "-m", "orchestrator.cli", "run", str(spec), "-o", "json"],
        cwd=tmp,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pairs: list[dict[str, Any]] = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None and len(pairs) < reads:
            try:
                scraped = _scrape(url)
            except OSError:
                time.sleep(0.5)
                continue
            if scraped.get("torchrig_step", 0) < 10:  # past start-up: kernels are running
                time.sleep(0.5)
                continue
            pairs.append({"exporter": scraped, "nvidia_smi": _smi()})
            time.sleep(1.0)
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    summary = json.loads(stdout) if stdout.strip().startswith("{") else {"error": stderr[-2000:]}
    names = {
        "utilization_ratio": "torchrig_gpu_utilization_ratio",
        "memory_used_bytes": "torchrig_gpu_memory_used_bytes",
        "memory_total_bytes": "torchrig_gpu_memory_total_bytes",
        "power_watts": "torchrig_gpu_power_watts",
        "temperature_celsius": "torchrig_gpu_temperature_celsius",
    }
    agreement = {
        key: [{"exporter": p["exporter"].get(metric), "nvidia_smi": p["nvidia_smi"][key]} for p in pairs]
        for key, metric in names.items()
    }
    return {
        "status": summary.get("status"),
        "error": summary.get("error"),
        "reads": len(pairs),
        "pairs": agreement,
        "raw": pairs,
    }


def drill(tmp: Path, steps: int) -> dict[str, Any]:
    """kill-worker on the GPU: group restart from the checkpoint; bit-exact against the reference."""
    spec = _spec_file(
        tmp,
        "gpu-drill",
        [f"spec.training.steps={steps}", f"spec.checkpoint.every.steps={max(2, steps // 6)}"],
    )
    report_file = tmp / "gpu-drill-report.json"
    # The drill exits 1 on a failed verdict: its report, not its exit code, is the measurement.
    proc = subprocess.run(
        [PY, "-m", "orchestrator.cli", "drill", "kill-worker", str(spec), "--report", str(report_file)],
        cwd=tmp,
        env=env(),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if not report_file.exists():
        raise RuntimeError(f"the drill wrote no report (exit {proc.returncode}): {proc.stderr[-1500:]}")
    report = json.loads(report_file.read_text())
    keys = ("verdict", "recovery_path", "mttr_seconds", "lost_steps", "fault_step", "resumed_from_step")
    checkpoints = [
        {k: e.get(k) for k in ("step", "generation", "blocked_s", "save_s", "bytes", "stores_ok")}
        for e in report.get("events", [])
        if e.get("event") in (EventKind.CHECKPOINT_COMMITTED, EventKind.CHECKPOINT_CORRUPT, EventKind.RESTORE)
    ]
    return {
        **{k: report.get(k) for k in keys},
        "bit_identical": report.get("final_params_match_reference"),
        "restored_from": report.get("restored_from"),
        "checks": [f"{c['name']}: {'ok' if c['passed'] else 'FAILED'} ({c['detail']})" for c in report["checks"]],
        "checkpoint_events": checkpoints,
    }


def checkpoint(tmp: Path, steps: int) -> dict[str, Any]:
    """A one-rank FSDP2 bf16 job's checkpoints on the GPU, as a person would check them: the manifest's
    files against the bytes on disk, `torchrig checkpoints verify`, and a resubmit's restore."""
    every = max(2, steps // 6)
    spec = _spec_file(tmp, "gpu-ckpt", [f"spec.training.steps={2 * every}", f"spec.checkpoint.every.steps={every}"])
    summary = _cli("run", str(spec), cwd=tmp)
    run_dir = Path(summary["run_dir"])
    store = run_dir / "ckpt"
    steps_on_disk: dict[str, Any] = {}
    for step_dir in sorted(store.glob("step-*")):
        manifest = json.loads((step_dir / "manifest.json").read_text())
        listed = {f["path"]: f["size"] for f in manifest.get("files", [])}
        on_disk = {str(p.relative_to(step_dir)): p.stat().st_size for p in step_dir.rglob("*") if p.is_file()}
        steps_on_disk[step_dir.name] = {"manifest": listed, "on_disk": on_disk}
    verify = subprocess.run(
        [PY, "-m", "orchestrator.cli", "checkpoints", "verify", f"file://{store}", "-o", "json"],
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    again = _cli("run", str(spec), "--run-dir", str(run_dir), cwd=tmp)
    events = [
        {k: e.get(k) for k in ("event", "generation", "step", "store", "detail", "bytes")}
        for e in read_jsonl(RunFiles(run_dir).events)
        if e.get("event") in (EventKind.CHECKPOINT_COMMITTED, EventKind.CHECKPOINT_CORRUPT, EventKind.RESTORE)
    ]
    return {
        "steps": steps_on_disk,
        "verify_exit": verify.returncode,
        "verify": verify.stdout[-3000:] or verify.stderr[-1500:],
        "resubmit": {k: again.get(k) for k in ("status", "restored_from", "reason")},
        "events": events,
    }


def profile(tmp: Path, steps: int) -> dict[str, Any]:
    """Where a bf16 FSDP2 step's time goes: `metrics.profile` over 3 steps after warm-up, host vs device."""
    start = max(5, steps // 2)
    spec = _spec_file(
        tmp,
        "gpu-profile",
        [
            f"spec.training.steps={start + 4}",
            *_no_checkpoints(start + 4),
            f"spec.metrics.profile.startStep={start}",
            "spec.metrics.profile.steps=3",
        ],
    )
    summary = _cli("run", str(spec), cwd=tmp)
    run_dir = Path(summary["run_dir"])
    event = next(e for e in read_jsonl(RunFiles(run_dir).events) if e.get("event") == EventKind.PROFILE)
    table = (run_dir / str(event["table"])).read_text().splitlines()
    return {
        "steps": [event["first_step"], event["last_step"]],
        "wall_s": event["wall_s"],
        "host_time_s": event["host_time_s"],
        "device_time_s": event["device_time_s"],
        "device_busy_ratio": round(float(event["device_time_s"]) / float(event["wall_s"]), 3),
        "table_head": table[:20],
    }


def staging(size_mb: int, repeats: int = 5) -> dict[str, Any]:
    """Seconds to copy `size_mb` of GPU state to the host: pageable (`stage` today) vs pinned non-blocking."""
    import torch

    numel = size_mb * 2**20 // 4
    src = torch.randn(numel, device="cuda")
    pinned = torch.empty(numel, pin_memory=True)

    def pageable() -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        src.detach().to("cpu", copy=True)
        return time.perf_counter() - t

    def pinned_copy() -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        pinned.copy_(src, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        return time.perf_counter() - t

    pageable(), pinned_copy()  # warm-up: first-touch of host pages, the allocator
    page = statistics.median(pageable() for _ in range(repeats))
    pin = statistics.median(pinned_copy() for _ in range(repeats))
    assert torch.equal(pinned, src.cpu())
    return {
        "size_mb": size_mb,
        "pageable_s": round(page, 5),
        "pinned_s": round(pin, 5),
        "pageable_gb_per_s": round(size_mb / 1024 / page, 2),
        "pinned_gb_per_s": round(size_mb / 1024 / pin, 2),
        "pinned_speedup": round(page / pin, 2),
    }


def _guarded(fn: Any, *args: Any) -> dict[str, Any]:
    try:
        return dict(fn(*args))
    except Exception as exc:  # one part failing must not lose the others' figures
        return {"error": f"{type(exc).__name__}: {str(exc)[-1500:]}"}


PARTS = ("staging", "checkpoint", "drill", "profile", "throughput", "nvml")  # the open questions first


def bench_gpu(quick: bool = False, parts: tuple[str, ...] = PARTS) -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device on this machine; `python -m bench.sections.gpu` on a GPU machine"}
    steps = 30 if quick else 60
    out: dict[str, Any] = {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "facts": facts()}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        measure: dict[str, Any] = {
            "staging": lambda: {f"{mb}MB": _guarded(staging, mb) for mb in (256, 1024)},
            "checkpoint": lambda: _guarded(checkpoint, tmp, steps),
            "drill": lambda: _guarded(drill, tmp, steps),
            "profile": lambda: _guarded(profile, tmp, steps),
            "throughput": lambda: _guarded(throughput, tmp, steps),
            "nvml": lambda: _guarded(nvml_against_smi, tmp, 4 * steps),
        }
        for part in parts:
            out[part] = measure[part]()
    return out


SECTION = Section("gpu", bench_gpu)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sections.gpu", description=__doc__)
    parser.add_argument("--out", help="also write the results here as JSON")
    parser.add_argument("--quick", action="store_true", help="shorter runs")
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    args = parser.parse_args(argv)
    parts = tuple(p.strip() for p in args.only.split(",") if p.strip())
    if unknown := set(parts) - set(PARTS):
        parser.error(f"--only: unknown parts {sorted(unknown)}; valid: {', '.join(PARTS)}")
    results: dict[str, Any] = {}
    for part in parts:  # one at a time, the file rewritten after each: a cut-short run keeps what it measured
        results.update(bench_gpu(args.quick, (part,)))
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    print(json.dumps(results, indent=2, default=str), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
