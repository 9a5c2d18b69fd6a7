"""The bench's output files: bench/results/latest.json (the measurements), latest.md (the tables that
docs/performance.md embeds) and scaling.png."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.common import RESULTS

Results = dict[str, Any]


def write_json(results: Results, out_dir: Path = RESULTS) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "latest.json"
    path.write_text(json.dumps(results, indent=2, sort_keys=False) + "\n")
    return path


def read_previous(out_dir: Path = RESULTS) -> Results:
    """The last run's results: a run of some sections keeps the others' figures."""
    path = out_dir / "latest.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    return data if isinstance(data, dict) else {}


def _overhead(results: Results) -> list[str]:
    ov = results.get("overhead") or {}
    if "ratio" not in ov:
        return []
    return [
        "| runtime overhead | torchrig samples/s | bare DDP samples/s | ratio (target >= 0.98) |",
        "|---|---|---|---|",
        f"| 2 ranks, gloo | {ov['torchrig_samples_per_s']:.0f} | {ov['bare_ddp_samples_per_s']:.0f} | "
        f"{ov['ratio']:.3f} (spread {ov['ratio_stats']['spread_pct']:.1f}%) |",
        "",
    ]


def _checkpoint_stall(results: Results) -> list[str]:
    cs = results.get("checkpoint_stall") or {}
    if not cs or "error" in cs:
        return []
    lines = [
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
    return lines


def _seconds(value: Any) -> str:
    return f"{value:.2f} s" if isinstance(value, (int, float)) else "n/a"


def _mttr(results: Results) -> list[str]:
    mt = results.get("mttr") or {}
    if not mt:
        return []
    lost = mt["lost_steps"]
    lines = [
        "| MTTR (SIGKILL one rank at step 25, checkpoint every 10) | seconds | steps lost |",
        "|---|---|---|",
        f"| torchrig local | {_seconds(mt.get('torchrig_s'))} | {lost.get('torchrig')} |",
        f"| torchrun + naive save-every-N | {_seconds(mt.get('torchrun_naive_s'))} | {lost.get('torchrun_naive')} |",
        f"| Ray Train FailureConfig | {_seconds(mt.get('ray_train_s'))} | {lost.get('ray_train')} |",
        "",
    ]
    if "speedup_vs_fastest_peer" in mt:
        lines += [f"Speed-up against the fastest peer: {mt['speedup_vs_fastest_peer']:.2f}x (target >= 2x).", ""]
    return lines


def _exporter(results: Results) -> list[str]:
    ratio = results.get("exporter_overhead_ratio")
    if not isinstance(ratio, (int, float)):
        return []
    return [f"Exporter overhead: {100 * ratio:.3f}% of step time (target < 0.5%).", ""]


def _scaling(results: Results) -> list[str]:
    sc = results.get("scaling") or {}
    if not sc.get("world_sizes"):
        return []
    lines = ["| world size | save s | restore s | MTTR s |", "|---|---|---|---|"]
    for i, w in enumerate(sc["world_sizes"]):
        lines.append(f"| {w} | {sc['save_s'][i]:.3f} | {sc['restore_s'][i]:.3f} | {sc['mttr_s'][i]:.2f} |")
    lines.append("")
    return lines


def markdown(results: Results) -> str:
    """latest.md: one table per section that has results, then the sections that failed."""
    lines = [f"# torchrig benchmarks ({results['timestamp']}, {results['machine']['cpus']} CPUs)", ""]
    for table in (_overhead, _checkpoint_stall, _mttr, _exporter, _scaling):
        lines += table(results)
    for name, err in (results.get("errors") or {}).items():
        lines.append(f"- section `{name}` failed: `{err.splitlines()[-1] if err else err}`")
    return "\n".join(lines) + "\n"


def write_markdown(results: Results, out_dir: Path = RESULTS) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "latest.md"
    path.write_text(markdown(results))
    return path


def plot_scaling(results: Results, out_dir: Path = RESULTS) -> Path | None:
    """scaling.png: save, restore and MTTR against world size (None when the run has no scaling results)."""
    sc = results.get("scaling") or {}
    if not sc.get("world_sizes"):
        return None
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
    path = out_dir / "scaling.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def write_report(results: Results, out_dir: Path = RESULTS) -> Path:
    """Write latest.json, latest.md and the plot; returns latest.md's path."""
    write_json(results, out_dir)
    md = write_markdown(results, out_dir)
    plot_scaling(results, out_dir)
    return md
