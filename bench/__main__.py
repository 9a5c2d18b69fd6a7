"""`python -m bench` (`make bench`): every figure is a ratio of two things measured in the same run.

Sections: overhead, checkpoint_stall, mttr, exporter, scaling, gpu. `--quick` uses fewer repeats and
smaller states (for a smoke run); `--only a,b` runs some sections. Results go to
bench/results/latest.json, latest.md and PNG plots; docs/performance.md embeds the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from bench.common import PY, REPO, RESULTS, now_iso, run, stats, throughput_from_records, write_results

SECTIONS = ("overhead", "checkpoint_stall", "mttr", "exporter", "scaling", "gpu")


def _spec_file(tmp: Path, overrides: dict[str, Any], name: str = "bench-digits") -> Path:
    """The digits example with overrides, written where a run can read it."""
    import yaml

    doc = yaml.safe_load((REPO / "examples" / "digits-ddp.yaml").read_text())
    doc["metadata"]["name"] = name
    for dotted, value in overrides.items():
        node = doc
        parts = dotted.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


# ---------------------------------------------------------------------------------------------------
def bench_overhead(repeats: int, steps: int) -> dict[str, Any]:
    """torchrig's worker loop vs a hand-written DDP loop, both under plain torchrun, 2 ranks, gloo."""
    from orchestrator.drills.history import read_jsonl

    torchrig, bare = [], []
    batch, world = 32, 2
    for _ in range(repeats):
        torchrig.append(_worker_throughput(steps, metrics_enabled=True)[0])
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            out = tmp / "bare.jsonl"
            run(
                [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), "--log-dir",
                 str(tmp / "logs"), str(REPO / "bench" / "bare_ddp.py"), "--steps", str(steps), "--out", str(out)]
            )  # fmt: skip
            bare.append(throughput_from_records(read_jsonl(out), batch * world, skip_steps=10))
    ratios = [t / b for t, b in zip(torchrig, bare, strict=True)]
    return {
        "torchrig_samples_per_s": stats(torchrig)["median"],
        "bare_ddp_samples_per_s": stats(bare)["median"],
        "ratio": stats(ratios)["median"],
        "ratio_stats": stats(ratios),
        "target": ">= 0.98",
        "steps": steps,
        "repeats": repeats,
    }


# ---------------------------------------------------------------------------------------------------
def _state_of(megabytes: int) -> tuple[Any, Any]:
    """A model + AdamW state of about `megabytes` (params + 2 moments, float32)."""
    import torch

    numel = megabytes * 2**20 // 4 // 3
    width = 1024
    rows = max(1, numel // width)
    model = torch.nn.Linear(width, rows, bias=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return model, opt


def _dd_write_mbps(directory: Path, megabytes: int) -> float:
    """The disk's own write bandwidth: dd of the same size, flushed to the device (conv=fdatasync)."""
    target = directory / "dd.bin"
    t = time.perf_counter()
    run(["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={megabytes}", "conv=fdatasync", "status=none"])
    seconds = time.perf_counter() - t
    target.unlink()
    return megabytes / seconds


def bench_checkpoint_stall(sizes_mb: list[int], repeats: int) -> dict[str, Any]:
    """Time training is blocked per checkpoint: torchrig async (2 stores) vs torch.save, dcp.save, dcp.async_save,
    and a plain in-memory copy (the floor)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from training.checkpoint import CheckpointContext, CheckpointManager
    from training.config import CheckpointConfig

    out: dict[str, Any] = {}
    for mb in sizes_mb:
        model, opt = _state_of(mb)
        flat = {"model": model.state_dict(), "optim": opt.state_dict()}
        res: dict[str, list[float]] = {
            k: []
            for k in ("torch_save", "dcp_save", "dcp_async", "memcpy", "torchrig", "torchrig_write_MBps", "dd_MBps")
        }
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            for i in range(repeats):
                t = time.perf_counter()
                torch.save(flat, tmp / f"ts{i}.pt")
                res["torch_save"].append(time.perf_counter() - t)
                t = time.perf_counter()
                dcp.save(flat, checkpoint_id=str(tmp / f"dcp{i}"))
                res["dcp_save"].append(time.perf_counter() - t)
                t = time.perf_counter()
                fut = dcp.async_save(flat, checkpoint_id=str(tmp / f"adcp{i}"))
                res["dcp_async"].append(time.perf_counter() - t)
                fut.result()
                t = time.perf_counter()
                _copy = {k: v.detach().clone() for k, v in model.state_dict().items()}
                _copy_o = [s["exp_avg"].clone() for s in opt.state.values()] + [
                    s["exp_avg_sq"].clone() for s in opt.state.values()
                ]
                res["memcpy"].append(time.perf_counter() - t)
                del _copy, _copy_o
                config = CheckpointConfig.model_validate(
                    {
                        "every": {"steps": 1},
                        "keep": 1,
                        "async": True,
                        "stores": [
                            {"uri": f"file://{tmp}/a{i}", "name": "a"},
                            {"uri": f"file://{tmp}/b{i}", "name": "b"},
                        ],
                    }
                )
                ctx = CheckpointContext(
                    job="bench", run_dir=str(tmp), rank=0, world_size=1, local_rank=0, local_world_size=1,
                    node_rank=0, num_nodes=1, generation=0,
                )  # fmt: skip
                mgr = CheckpointManager(config, ctx)
                t = time.perf_counter()
                mgr.save(1, flat)
                res["torchrig"].append(time.perf_counter() - t)
                mgr.wait()
                commit_s = time.perf_counter() - t
                mgr.close()
                written = sum(
                    f.stat().st_size for st in ("a", "b") for f in (tmp / f"{st}{i}").rglob("*") if f.is_file()
                )
                res["torchrig_write_MBps"].append(written / 2**20 / commit_s)
                res["dd_MBps"].append(_dd_write_mbps(tmp, mb))
                for p in tmp.iterdir():
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
        med = {k: stats(v)["median"] for k, v in res.items()}
        out[f"{mb}MB"] = {
            "torchrig_blocked_s": med["torchrig"],
            "torch_save_s": med["torch_save"],
            "dcp_save_s": med["dcp_save"],
            "dcp_async_blocked_s": med["dcp_async"],
            "memcpy_s": med["memcpy"],
            "ratio_vs_torch_save": med["torchrig"] / med["torch_save"],
            "ratio_vs_memcpy": med["torchrig"] / med["memcpy"],
            "torchrig_write_MBps": med["torchrig_write_MBps"],
            "dd_write_MBps": med["dd_MBps"],
            "write_ratio_vs_dd": med["torchrig_write_MBps"] / med["dd_MBps"],
            "spread_pct": {k: round(stats(v)["spread_pct"], 1) for k, v in res.items()},
            "targets": {"ratio_vs_torch_save": "<= 0.10", "ratio_vs_memcpy": "<= 1.5"},
        }
    return out


# ---------------------------------------------------------------------------------------------------
def _torchrig_kill_drill(steps: int, kill_step: int, world: int, workdir: Path) -> Any:
    """One kill-worker drill on the local backend (no reference run); returns its DrillReport."""
    from orchestrator.drills import DrillOptions, run_drill
    from orchestrator.loader import load_spec

    spec = load_spec(
        REPO / "examples" / "digits-ddp.yaml",
        [
            f"spec.training.steps={steps}",
            "spec.checkpoint.every.steps=10",
            "spec.training.evalAtEnd=false",
            "spec.metrics.port=29700",
            f"spec.procsPerNode={world}",
            "spec.nodes.min=1",
            "spec.nodes.max=1",
        ],
    )
    report = run_drill(
        "kill-worker",
        spec,
        DrillOptions(seed=0, at_step=kill_step, rank=world - 1, reference=False, drill_dir=str(workdir / "drill")),
    )
    if report.mttr_seconds is None or report.lost_steps is None:
        raise RuntimeError(f"torchrig drill did not recover: {report.to_dict()}")
    return report


def _mttr_torchrig(steps: int, kill_step: int) -> tuple[float, int]:
    with tempfile.TemporaryDirectory() as d:
        report = _torchrig_kill_drill(steps, kill_step, 2, Path(d))
        return float(report.mttr_seconds), int(report.lost_steps)


def _mttr_torchrun_naive(steps: int, kill_step: int) -> tuple[float, int]:
    from orchestrator.drills.history import read_jsonl

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "ckpt").mkdir()
        events = tmp / "events.jsonl"
        run(
            [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
             "--log-dir", str(tmp / "logs"), str(REPO / "bench" / "naive_torchrun.py"), "--steps", str(steps),
             "--every", "10", "--kill-step", str(kill_step), "--ckpt-dir", str(tmp / "ckpt"), "--events", str(events)]
        )  # fmt: skip
        ev = read_jsonl(events)
        fault = next(e for e in ev if e["event"] == "fault")
        first = next(e for e in ev if e["event"] == "first_step")
        restore = next((e for e in ev if e["event"] == "restore"), {"step": 0})
        return float(first["time"]) - float(fault["time"]), kill_step - int(restore["step"])


def _mttr_ray(steps: int, kill_step: int) -> tuple[float, int]:
    from orchestrator.drills import DrillOptions, run_drill
    from orchestrator.loader import load_spec

    with tempfile.TemporaryDirectory() as d:
        spec = load_spec(
            REPO / "examples" / "digits-ddp.yaml",
            [f"spec.training.steps={steps}", "spec.checkpoint.every.steps=10", "spec.training.evalAtEnd=false",
             "spec.nodes.min=1", "spec.nodes.max=1", "spec.metrics.port=29750"],
        )  # fmt: skip
        report = run_drill(
            "kill-worker",
            spec,
            DrillOptions(
                backend="ray", seed=0, at_step=kill_step, rank=1, reference=False, drill_dir=str(Path(d) / "r")
            ),
        )
        if report.mttr_seconds is None or report.lost_steps is None:
            raise RuntimeError(f"ray drill did not recover: {report.to_dict()}")
        return report.mttr_seconds, report.lost_steps


def bench_mttr(repeats: int) -> dict[str, Any]:
    steps, kill = 60, 25
    out: dict[str, Any] = {"lost_steps": {}, "kill_step": kill, "checkpoint_every": 10}
    for name, fn in (("torchrig", _mttr_torchrig), ("torchrun_naive", _mttr_torchrun_naive), ("ray_train", _mttr_ray)):
        try:
            samples = [fn(steps, kill) for _ in range(repeats)]
        except Exception as exc:  # a peer that cannot run here is reported, not hidden
            out[f"{name}_s"] = None
            out["lost_steps"][name] = None
            out.setdefault("errors", {})[name] = f"{exc.__class__.__name__}: {str(exc)[-400:]}"
            continue
        out[f"{name}_s"] = stats([s[0] for s in samples])["median"]
        out[f"{name}_stats"] = stats([s[0] for s in samples])
        out["lost_steps"][name] = max(s[1] for s in samples)
    peers = [out.get("torchrun_naive_s"), out.get("ray_train_s")]
    peers = [p for p in peers if p]
    if out.get("torchrig_s") and peers:
        out["speedup_vs_fastest_peer"] = min(peers) / out["torchrig_s"]
    out["target"] = "torchrig >= 2x faster than the fastest peer"
    return out


# ---------------------------------------------------------------------------------------------------
def _worker_throughput(steps: int, metrics_enabled: bool) -> tuple[float, float]:
    """(samples/s, median step seconds) of the real worker, 2 ranks under torchrun, metrics on or off."""
    from orchestrator.drills.history import read_jsonl

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        spec = _spec_file(
            tmp,
            {
                "spec.training.steps": steps,
                "spec.checkpoint.every": {"steps": steps * 10},
                "spec.checkpoint.saveFinal": False,
                "spec.training.evalAtEnd": False,
                "spec.metrics.logEvery": 1,
                "spec.metrics.enabled": metrics_enabled,
                "spec.metrics.port": 29650,
            },
        )
        run(
            [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--log-dir",
             str(tmp / "logs"), "-m", "training", "--spec", str(spec)],
            extra_env={"TORCHRIG_RUN_DIR": str(tmp / "run")},
        )  # fmt: skip
        records = read_jsonl(tmp / "run" / "metrics.jsonl")
        step_s = stats([float(r["step_s"]) for r in records if int(r["step"]) >= 10])["median"]
        return throughput_from_records(records, 64, skip_steps=10), step_s


def bench_exporter(repeats: int, steps: int) -> dict[str, Any]:
    """Exporter overhead: (a) the real worker with the Prometheus exporter on and off, alternated in one
    run; (b) the cost of one `on_step` through every sink, as a share of the measured step time."""
    from training.metrics import bench as metrics_bench

    on, off, step_times = [], [], []
    for _ in range(repeats):
        t_on, s_on = _worker_throughput(steps, True)
        t_off, _ = _worker_throughput(steps, False)
        on.append(t_on)
        off.append(t_off)
        step_times.append(s_on)
    step_s = stats(step_times)["median"]
    micro = metrics_bench.measure_on_step_overhead(step_s=step_s)
    end_to_end = [1.0 - a / b for a, b in zip(on, off, strict=True)]
    return {
        "overhead_ratio": micro.overhead_ratio,
        "on_step_us": micro.per_call_us,
        "measured_step_s": step_s,
        "end_to_end_ratio": stats(end_to_end)["median"],
        "end_to_end_stats": stats(end_to_end),
        "samples_per_s_with_exporter": stats(on)["median"],
        "samples_per_s_without_exporter": stats(off)["median"],
        "target": "< 0.005",
        "note": "overhead_ratio = cost of on_step through all sinks / median step time of the same job; "
        "end_to_end_ratio = 1 - throughput(on)/throughput(off), alternated runs (noise-limited here)",
    }


# ---------------------------------------------------------------------------------------------------
def bench_scaling(world_sizes: list[int]) -> dict[str, Any]:
    """Checkpoint save, restore and MTTR against world size (local, tiny model), from kill-worker drills."""
    from orchestrator.drills.history import RunHistory

    save_s, restore_s, mttr_s = [], [], []
    for w in world_sizes:
        with tempfile.TemporaryDirectory() as d:
            report = _torchrig_kill_drill(40, 35, w, Path(d))
            history = RunHistory.load(report.run_dir)
        mttr_s.append(float(report.mttr_seconds))
        commits = [float(e["save_s"]) for e in history.of("checkpoint_committed") if e.get("save_s") is not None]
        restores = [float(e["seconds"]) for e in history.of("restore") if e.get("seconds") is not None]
        save_s.append(max(commits, default=float("nan")))
        restore_s.append(max(restores, default=float("nan")))
    return {"world_sizes": world_sizes, "save_s": save_s, "restore_s": restore_s, "mttr_s": mttr_s}


# ---------------------------------------------------------------------------------------------------
def bench_gpu() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device on this machine; see docs/performance.md for the device-tool procedure"}
    return {"skipped": "run bench/gpu.py on the GPU machine"}


# ---------------------------------------------------------------------------------------------------
def write_markdown(results: dict[str, Any]) -> Path:
    lines = [f"# torchrig benchmarks ({results['timestamp']}, {results['machine']['cpus']} CPUs)", ""]
    ov = results.get("overhead") or {}
    if "ratio" in ov:
        lines += [
            "| runtime overhead | torchrig samples/s | bare DDP samples/s | ratio (target >= 0.98) |",
            "|---|---|---|---|",
            f"| 2 ranks, gloo | {ov['torchrig_samples_per_s']:.0f} | {ov['bare_ddp_samples_per_s']:.0f} | "
            f"{ov['ratio']:.3f} (spread {ov['ratio_stats']['spread_pct']:.1f}%) |",
            "",
        ]
    cs = results.get("checkpoint_stall") or {}
    if cs and "error" not in cs:
        lines += [
            "| state | torchrig blocked | torch.save | dcp.save | dcp.async_save blocked | memcpy "
            "| vs torch.save (<= 0.10) | vs memcpy (<= 1.5) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for size, r in cs.items():
            lines.append(
                f"| {size} | {r['torchrig_blocked_s']:.3f} s | {r['torch_save_s']:.3f} s | {r['dcp_save_s']:.3f} s | "
                f"{r['dcp_async_blocked_s']:.3f} s | {r['memcpy_s']:.3f} s | {r['ratio_vs_torch_save']:.3f} | "
                f"{r['ratio_vs_memcpy']:.2f} |"
            )
        lines.append("")
        if all("write_ratio_vs_dd" in r for r in cs.values()):
            lines += [
                "| state | torchrig write MB/s (2 stores, fsynced, hashed) | dd MB/s (conv=fdatasync) | ratio |",
                "|---|---|---|---|",
            ]
            for size, r in cs.items():
                mbps, dd, ratio = r["torchrig_write_MBps"], r["dd_write_MBps"], r["write_ratio_vs_dd"]
                lines.append(f"| {size} | {mbps:.0f} | {dd:.0f} | {ratio:.2f} |")
            lines.append("")
    mt = results.get("mttr") or {}
    if mt:
        fmt = lambda v: f"{v:.2f} s" if isinstance(v, (int, float)) else "n/a"  # noqa: E731
        lines += [
            "| MTTR (SIGKILL one rank at step 25, checkpoint every 10) | seconds | steps lost |",
            "|---|---|---|",
            f"| torchrig local | {fmt(mt.get('torchrig_s'))} | {mt['lost_steps'].get('torchrig')} |",
            f"| torchrun + naive save-every-N | {fmt(mt.get('torchrun_naive_s'))} "
            f"| {mt['lost_steps'].get('torchrun_naive')} |",
            f"| Ray Train FailureConfig | {fmt(mt.get('ray_train_s'))} | {mt['lost_steps'].get('ray_train')} |",
            "",
        ]
        if "speedup_vs_fastest_peer" in mt:
            lines += [f"Speed-up against the fastest peer: {mt['speedup_vs_fastest_peer']:.2f}x (target >= 2x).", ""]
    if isinstance(results.get("exporter_overhead_ratio"), (int, float)):
        lines += [
            f"Exporter overhead: {100 * results['exporter_overhead_ratio']:.3f}% of step time (target < 0.5%).",
            "",
        ]
    sc = results.get("scaling") or {}
    if sc.get("world_sizes"):
        lines += ["| world size | save s | restore s | MTTR s |", "|---|---|---|---|"]
        for i, w in enumerate(sc["world_sizes"]):
            lines.append(f"| {w} | {sc['save_s'][i]:.3f} | {sc['restore_s'][i]:.3f} | {sc['mttr_s'][i]:.2f} |")
        lines.append("")
    for name, err in (results.get("errors") or {}).items():
        lines.append(f"- section `{name}` failed: `{err.splitlines()[-1] if err else err}`")
    path = RESULTS / "latest.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def plot_scaling(results: dict[str, Any]) -> None:
    sc = results.get("scaling") or {}
    if not sc.get("world_sizes"):
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
    for key, label in (("save_s", "checkpoint save"), ("restore_s", "restore"), ("mttr_s", "MTTR")):
        ax.plot(sc["world_sizes"], sc[key], marker="o", label=label)
    ax.set_xlabel("world size (local ranks)")
    ax.set_ylabel("seconds")
    ax.set_xticks(sc["world_sizes"])
    ax.set_title("torchrig: recovery costs against world size")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "scaling.png")
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repeats, small states (smoke run)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    args = parser.parse_args()
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(only) - set(SECTIONS)
    if unknown:
        parser.error(f"--only: unknown sections {sorted(unknown)}; valid: {', '.join(SECTIONS)}")
    repeats = 2 if args.quick else 5
    previous = RESULTS / "latest.json"
    results: dict[str, Any] = json.loads(previous.read_text()) if previous.exists() else {}
    results.update(
        {
            "timestamp": now_iso(),
            "machine": {"cpus": os.cpu_count(), "gpu": None, "python": platform.python_version()},
            "quick": args.quick,
        }
    )
    results.setdefault("errors", {})
    plan = {
        "overhead": lambda: bench_overhead(repeats, 60 if args.quick else 200),
        "checkpoint_stall": lambda: bench_checkpoint_stall([50] if args.quick else [50, 500], repeats),
        "mttr": lambda: bench_mttr(1 if args.quick else 3),
        "exporter": lambda: bench_exporter(repeats, 60 if args.quick else 200),
        "scaling": lambda: bench_scaling([2, 4] if args.quick else [2, 4, 8]),
        "gpu": bench_gpu,
    }
    for name in only:
        print(f"== {name}", flush=True)
        t = time.time()
        try:
            value = plan[name]()
            if name == "exporter":
                results["exporter_overhead_ratio"] = value.get("overhead_ratio")
                results["exporter"] = value
            else:
                results[name] = value
            results["errors"].pop(name, None)
        except Exception:
            results["errors"][name] = traceback.format_exc()[-2000:]
            print(results["errors"][name], flush=True)
        print(f"   {time.time() - t:.1f}s", flush=True)
    write_results(results)
    write_markdown(results)
    plot_scaling(results)
    print((RESULTS / "latest.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
