"""The bench's output files: bench/results/latest.json (the measurements), latest.md (the tables that
docs/performance.md embeds) and scaling.png."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.common import RESULTS
from bench.sections import inplace_scale

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


def _checkpoint_io(results: Results) -> list[str]:
    """The checkpoint data path: write vs dd, restore vs cat, commit latency busy vs idle."""
    lines: list[str] = []
    write, restore, commit = (results.get(k) or {} for k in ("checkpoint_write", "restore", "checkpoint_commit"))
    if write and "error" not in write:
        lines += [
            "| checkpoint write | torchrig MB/s (2 stores) | dd MB/s (same total) | ratio (>= 0.8) | vs dd's best |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {k} | {r['torchrig_MBps']:.0f} | {r['dd_MBps']:.0f} | {r['ratio_vs_dd']:.2f} "
            f"| {_opt(r.get('ratio_vs_fastest_dd'))} |"
            for k, r in write.items()
        ]
        lines.append("")
    if restore and "error" not in restore:
        lines += [
            "| restore | torchrig MB/s (verified, loaded) | cat MB/s | ratio (>= 0.8) | vs cat's best |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {k} | {r['torchrig_MBps']:.0f} | {r['cat_MBps']:.0f} | {r['ratio_vs_read']:.2f} "
            f"| {_opt(r.get('ratio_vs_fastest_read'))} |"
            for k, r in restore.items()
        ]
        lines.append("")
    if "busy_over_idle" in commit:
        lines += [
            "| commit latency (2 ranks, gloo) | idle | busy (training on) | busy / idle (<= 1.5) |",
            "|---|---|---|---|",
            f"| {commit['state_MB']} MB state | {commit['idle_s']:.3f} s | {commit['busy_s']:.3f} s | "
            f"{commit['busy_over_idle']:.2f} |",
        ]
        cpu = commit.get("cpu_only")
        if cpu:  # control: the same CPU load from a sibling process, no GIL shared with the commit
            lines.append(
                f"| control: the load in a sibling process (no shared GIL) | {cpu['idle_s']:.3f} s | "
                f"{cpu['busy_s']:.3f} s | {cpu['busy_over_idle']:.2f} |"
            )
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
        f"| torchrig in place (warm spare) | {_seconds(mt.get('torchrig_inplace_s', mt.get('torchrig_s')))} "
        f"| {lost.get('torchrig_inplace', lost.get('torchrig'))} |",
        f"| torchrig group restart | {_seconds(mt.get('torchrig_restart_s'))} | {lost.get('torchrig_restart')} |",
        f"| torchrun + naive save-every-N | {_seconds(mt.get('torchrun_naive_s'))} | {lost.get('torchrun_naive')} |",
        f"| Ray Train FailureConfig | {_seconds(mt.get('ray_train_s'))} | {lost.get('ray_train')} |",
        f"| torchrig in place on Ray | {_seconds(mt.get('ray_inplace_s'))} | {lost.get('ray_inplace')} |",
        "",
    ]
    if isinstance(mt.get("ray_inplace_vs_ray_train_ratio"), (int, float)):
        lines += [
            f"In place on Ray vs Ray Train FailureConfig: {mt['ray_inplace_vs_ray_train_ratio']:.3f}x the MTTR "
            f"(target <= 0.1x); final params bit-identical in {mt.get('ray_inplace_bit_exact', 'n/a')} checked runs.",
            "",
        ]
    if isinstance(mt.get("inplace_vs_torchrun_ratio"), (int, float)):
        lines += [
            f"In place vs plain torchrun: {mt['inplace_vs_torchrun_ratio']:.2f}x the MTTR (target <= 0.5x); "
            f"final params bit-identical to the reference in {mt.get('inplace_bit_exact', 'n/a')} checked runs.",
            "",
        ]
    if "speedup_vs_fastest_peer" in mt:
        lines += [f"Speed-up against the fastest peer: {mt['speedup_vs_fastest_peer']:.2f}x (target >= 2x).", ""]
    return lines


def _exporter(results: Results) -> list[str]:
    ratio = results.get("exporter_overhead_ratio")
    if not isinstance(ratio, (int, float)):
        return []
    per_step = (results.get("exporter") or {}).get("on_step_us")
    cost = f" ({per_step:.1f} µs per step, target <= 5 µs)" if isinstance(per_step, (int, float)) else ""
    return [f"Exporter overhead: {100 * ratio:.3f}% of step time (target < 0.15%){cost}.", ""]


def _paths(sc: dict[str, Any]) -> set[str]:
    """Every recovery path the scaling runs took (a list per world size; one path each in older results)."""
    out: set[str] = set()
    for p in sc.get("recovery_paths") or []:
        out.update(str(x) for x in p) if isinstance(p, list) else out.add(str(p))
    return out


def _scaling(results: Results) -> list[str]:
    sc = results.get("scaling") or {}
    if not sc.get("world_sizes"):
        return []
    cpu = sc.get("recovery_cpu_s_median") or [float("nan")] * len(sc["world_sizes"])
    runs = sc.get("mttr_s_runs") or [[] for _ in sc["world_sizes"]]
    lines = [
        "| world size | save s | restore s | MTTR s (median) | MTTR of each run, s | survivors' recovery s "
        "| step s | recovery CPU s per member |",
        "|---|---|---|---|---|---|---|---|",
    ]
    nan = [float("nan")] * len(sc["world_sizes"])
    recovery, step = sc.get("survivor_recovery_s") or nan, sc.get("step_s") or nan
    for i, w in enumerate(sc["world_sizes"]):
        each = ", ".join(f"{v:.3f}" for v in runs[i]) if i < len(runs) else ""
        save, restore, mttr = sc["save_s"][i], sc["restore_s"][i], sc["mttr_s"][i]
        lines.append(
            f"| {w} | {save:.3f} | {restore:.3f} | {mttr:.3f} | {each} | {recovery[i]:.3f} | {step[i]:.3f} "
            f"| {cpu[i]:.3f} |"
        )
    lines.append("")
    for w, phases in zip(sc["world_sizes"], sc.get("survivor_phases_median") or [], strict=False):
        if phases:  # when each phase of a survivor's recovery ended (median member), seconds
            ended = ", ".join(f"{k} {v:.3f}" for k, v in phases.items())
            lines.append(f"- {w} ranks, survivor phases ended at (s): {ended}")
    if sc.get("survivor_phases_median"):
        lines.append("")
    if isinstance(sc.get("mttr_ratio_max_vs_min"), (int, float)):
        paths = ", ".join(sorted(_paths(sc)))
        lines += [
            f"MTTR largest/smallest world size: {sc['mttr_ratio_max_vs_min']:.2f}x (target <= 1.5x; {paths}).",
            "",
        ]
    if isinstance(sc.get("survivor_recovery_ratio_max_vs_min"), (int, float)):
        lines += [
            f"The survivors' own recovery, largest/smallest world size: "
            f"{sc['survivor_recovery_ratio_max_vs_min']:.2f}x. The MTTR also holds one step, whose time "
            "grows with the ranks sharing this machine's cores (the `step s` column).",
            "",
        ]
    eq = sc.get("equal_cpu_per_rank") or {}
    if eq.get("doublings"):
        pinned = ", ".join(
            f"{w} ranks {m:.3f} s" for w, m in zip(eq["pinned_world_sizes"], eq["pinned_mttr_s"], strict=False)
        )
        each = "; ".join(
            f"{a} -> {b} ranks at {d['ranks_per_core']:g} ranks per core: {d['ratio']:.2f}x"
            for d in eq["doublings"]
            for a, b in [d["world_sizes"]]
        )
        lines += [
            f"At equal CPU per rank (half of each world size pinned to {eq['pinned_cores']} of the "
            f"{eq['cores']} cores: {pinned}), doubling the world size changes the MTTR by {each}; "
            f"their product, largest/smallest world size with the same CPU per rank: "
            f"**{eq['mttr_ratio_max_vs_min']:.2f}x**.",
            "",
        ]
    return lines


def _preempt(results: Results) -> list[str]:
    pr = results.get("preempt") or {}
    if not pr or "error" in pr:
        return []
    lines = [
        "| state | SIGTERM -> committed | synchronous save | torch.save | vs sync save | headroom in a 30 s grace |",
        "|---|---|---|---|---|---|",
    ]
    for size, r in pr.items():
        lines.append(
            f"| {size} | {r['sigterm_to_commit_s']:.3f} s | {r['sync_save_s']:.3f} s | {r['torch_save_s']:.3f} s | "
            f"{r['ratio_vs_sync_save']:.2f} | {r['grace_headroom']:.1f}x |"
        )
    return [*lines, ""]


def _startup(results: Results) -> list[str]:
    st = results.get("startup") or {}
    if not st or "error" in st:
        return []
    return [
        f"| {st['steps']}-step digits job, 2 ranks | wall s | first step s | teardown s |",
        "|---|---|---|---|",
        f"| torchrig run | {st['torchrig_wall']['median']:.2f} | {st['torchrig_first_step']['median']:.2f} | "
        f"{st['torchrig_teardown']['median']:.2f} |",
        f"| torchrun + naive loop | {st['torchrun_naive_wall']['median']:.2f} | "
        f"{st['torchrun_naive_first_step']['median']:.2f} | |"
        if "torchrun_naive_first_step" in st
        else f"| torchrun + naive loop | {st['torchrun_naive_wall']['median']:.2f} | | |",
        "",
        f"torchrig over torchrun, wall: {st['wall_ratio_vs_torchrun']:.2f}x"
        + (f", first step: {st['first_step_ratio_vs_torchrun']:.2f}x" if "first_step_ratio_vs_torchrun" in st else "")
        + (
            f"; `submit --backend local` back {st['submit_return_after_supervisor_start']['median']:.2f} s after its "
            "supervisor started."
            if "submit_return_after_supervisor_start" in st
            else "."
        )
        + (
            f" Alternated pairs: first step {st['first_step_ratio_pairs']['min']:.2f}-"
            f"{st['first_step_ratio_pairs']['max']:.2f}x, wall {st['wall_ratio_pairs']['min']:.2f}-"
            f"{st['wall_ratio_pairs']['max']:.2f}x; load average {st['load_average_1m']['min']:.1f}-"
            f"{st['load_average_1m']['max']:.1f} on {results.get('machine', {}).get('cpus')} CPUs."
            if "load_average_1m" in st
            else ""
        ),
        "",
    ]


def _sdc(results: Results) -> list[str]:
    sd = results.get("sdc") or {}
    if not sd or "error" in sd:
        return []
    ov, fp, det = sd["overhead"], sd["fingerprint_tinygpt"], sd["detection"]
    return [
        f"| sdc (digits, 2 ranks) | s/step off | every step | every {ov['default_every']} (default) |",
        "|---|---|---|---|",
        f"| median | {ov['step_s_off']['median']:.4f} | {ov['step_s_every_step']['median']:.4f} | "
        f"{ov['step_s_default']['median']:.4f} |",
        "",
        f"One check (fingerprint + all-gather): {ov['check_s'] * 1000:.3f} ms, "
        f"{100 * ov['check_ratio_of_a_step']:.2f}% of a step; at the default every {ov['default_every']} steps: "
        f"{100 * ov['default_overhead_ratio']:.3f}% "
        f"(target <= 1%; measured directly, side by side: {100 * ov['default_overhead_ratio_direct']:.2f}%). "
        f"tinygpt replica fingerprint: {fp['fingerprint_s'] * 1000:.2f} ms, "
        f"{100 * fp['fingerprint_ratio_of_a_step']:.2f}% of one of its steps "
        f"({fp['fingerprint_ns_per_word']:.2f} ns/word). "
        f"Flip to detection: {det['steps_to_detection']} steps, {det['seconds_to_detection']:.3f} s "
        f"(flip at step {det['flip_step']}, check every {det['every']}{_detail(det)}).",
        "",
        *_sdc_recompute(sd),
    ]


def _detail(detection: dict[str, Any]) -> str:
    return f"; {detection['detail']}" if detection.get("detail") else ""


def _sdc_recompute(sd: dict[str, Any]) -> list[str]:
    rc, fp, det = sd.get("recompute"), sd.get("fingerprint_tinygpt") or {}, sd.get("recompute_detection")
    if not rc or not det:
        return []
    default = rc["default_every"]
    at_default = (
        f"at the default every {default} steps: {100 * rc['default_overhead_ratio']:.2f}% "
        f"(measured directly, side by side: {100 * rc['default_overhead_ratio_direct']:.2f}%)"
        if default
        else "off by default"
    )
    return [
        "| sdc recompute (digits, 2 ranks) | s/step off | every step |",
        "|---|---|---|",
        f"| median | {rc['step_s_off']['median']:.4f} | {rc['step_s_every_step']['median']:.4f} |",
        "",
        f"One recompute check (a neighbour's forward and backward, two fingerprints, an all-gather): "
        f"{rc['check_s'] * 1000:.3f} ms, {100 * rc['check_ratio_of_a_step']:.1f}% of a step; {at_default} "
        f"(target <= 5%). tinygpt's recomputation: "
        f"{100 * fp.get('recompute_ratio_of_a_step', float('nan')):.0f}% of one of its steps. "
        f"A local-gradient flip before the all-reduce (invisible to the replica check) to detection: "
        f"{det['steps_to_detection']} steps, {det['seconds_to_detection']:.3f} s{_detail(det)}.",
        *_sdc_trail(sd),
        "",
    ]


def _sdc_trail(sd: dict[str, Any]) -> list[str]:
    digits, tinygpt = sd.get("trail_digits_in_process"), sd.get("trail_tinygpt_in_process")
    if not digits or not tinygpt:
        return []
    return [
        "",
        f"The gradient trail of two-replica jobs (every step, in process): "
        f"{100 * digits['trail_ratio_of_a_step']:.1f}% of a digits step, "
        f"{100 * tinygpt['trail_ratio_of_a_step']:.2f}% of a tinygpt step.",
    ]


def markdown(results: Results) -> str:
    """latest.md: one table per section that has results, then the sections that failed."""
    lines = [f"# torchrig benchmarks ({results['timestamp']}, {results['machine']['cpus']} CPUs)", ""]
    for table in (_overhead, _checkpoint_stall, _checkpoint_io, _mttr, _exporter, _scaling, _preempt, _startup, _sdc):
        lines += table(results)
    lines += inplace_scale.markdown(results)
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

    fig, ax = plt.subplots(figsize=(8.5, 4), dpi=110)
    paths = _paths(sc)
    mttr_label = "MTTR" + (f" ({next(iter(paths))}, median)" if len(paths) == 1 else " (median)")
    series = (
        ("save_s", "checkpoint save"),
        ("restore_s", "restore"),
        ("mttr_s", mttr_label),
        ("survivor_recovery_s", "survivors' recovery (median)"),
        ("step_s", "one training step (before the kill)"),
        ("recovery_cpu_s_median", "recovery CPU per member (median)"),
    )
    for key, label in series:
        if key not in sc:  # results of an older run
            continue
        values = [float(v) for v in sc[key]]
        if all(v != v for v in values):  # all NaN: in place nothing is restored; no empty legend entry
            continue
        line = ax.plot(sc["world_sizes"], values, marker="o", label=label)[0]
        if key == "mttr_s" and sc.get("mttr_s_runs"):  # every run, around its median
            xs = [w for w, runs in zip(sc["world_sizes"], sc["mttr_s_runs"], strict=False) for _ in runs]
            ys = [float(v) for runs in sc["mttr_s_runs"] for v in runs]
            ax.scatter(xs, ys, s=12, color=line.get_color(), alpha=0.5, label="MTTR of each run")
            eq = sc.get("equal_cpu_per_rank") or {}
            if eq.get("pinned_world_sizes"):  # half the sizes on half the cores: the full sizes' CPU per rank
                label = f"MTTR on {eq['pinned_cores']} of {eq['cores']} cores (median)"
                ax.plot(
                    eq["pinned_world_sizes"],
                    eq["pinned_mttr_s"],
                    ls="--",
                    marker="s",
                    color=line.get_color(),
                    label=label,
                )
    ax.set_xlabel("world size (local ranks)")
    ax.set_ylabel("seconds")
    ax.set_xticks(sc["world_sizes"])
    ax.set_title("torchrig: recovery costs against world size")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0))  # beside: no point hidden
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


def _opt(value: object) -> str:
    """A ratio, or "-" for a figure an older run did not record."""
    return f"{value:.2f}" if isinstance(value, (int, float)) else "-"
