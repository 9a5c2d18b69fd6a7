"""The bench's plumbing without running a benchmark: the section registry, `run_sections`, the report
writer (latest.json / latest.md / scaling.png) and the digits job file with `--set` overrides."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from bench import report
from bench.__main__ import main, merge_changes, run_sections
from bench.common import digits_spec_file
from bench.sections import SECTIONS, Section
from bench.sections.exporter import publish as publish_exporter
from orchestrator.loader import load_spec

# latest.json's keys, in the order docs/performance.md and earlier runs know them.
SECTION_NAMES = [
    "overhead",
    "checkpoint_stall",
    "checkpoint_write",
    "restore",
    "checkpoint_commit",
    "mttr",
    "inplace_scale",
    "exporter",
    "scaling",
    "gpu",
    "preempt",
    "startup",
    "sdc",
]


def fake_results() -> dict[str, Any]:
    spread = {"median": 1.0, "min": 0.9, "max": 1.1, "spread_pct": 10.0, "n": 2.0}
    return {
        "timestamp": "2026-01-01T00:00:00Z",
        "machine": {"cpus": 2, "gpu": None, "python": "3.11.7"},
        "quick": True,
        "errors": {"gpu": "Traceback ...\nRuntimeError: boom"},
        "exporter_overhead_ratio": 0.0042,
        "overhead": {
            "torchrig_samples_per_s": 990.0,
            "bare_ddp_samples_per_s": 1000.0,
            "ratio": 0.99,
            "ratio_stats": spread,
        },
        "checkpoint_stall": {
            "50MB": {
                "torchrig_blocked_s": 0.03,
                "torch_save_s": 0.04,
                "dcp_save_s": 0.1,
                "dcp_async_blocked_s": 0.02,
                "memcpy_s": 0.025,
                "ratio_vs_torch_save": 0.75,
                "ratio_vs_memcpy": 1.2,
                "torchrig_write_MBps": 300.0,
                "dd_write_MBps": 600.0,
                "write_ratio_vs_dd": 0.5,
            }
        },
        "checkpoint_write": {"500MB": {"torchrig_MBps": 850.0, "dd_MBps": 1000.0, "ratio_vs_dd": 0.85}},
        "restore": {"500MB": {"torchrig_MBps": 400.0, "cat_MBps": 1000.0, "ratio_vs_read": 0.4}},
        "checkpoint_commit": {"state_MB": 8, "idle_s": 0.1, "busy_s": 0.12, "busy_over_idle": 1.2},
        "mttr": {
            "torchrig_s": 2.0,
            "torchrun_naive_s": 3.0,
            "ray_train_s": None,
            "speedup_vs_fastest_peer": 1.5,
            "lost_steps": {"torchrig": 5, "torchrun_naive": 5, "ray_train": None},
        },
        "scaling": {
            "world_sizes": [2, 4],
            "save_s": [0.1, 0.2],
            "restore_s": [0.05, 0.1],
            "mttr_s": [3.0, 6.0],
            "mttr_s_runs": [[3.0, 2.5, 3.5], [6.0, 7.0, 5.5]],
            "mttr_ratio_max_vs_min": 2.0,
            "recovery_paths": [["inplace"], ["inplace", "restart"]],
            "survivor_phases_median": [{}, {"left": 0.02, "formed": 0.07, "state": 0.2}],
            "survivor_recovery_s": [0.1, 0.12],
            "survivor_recovery_ratio_max_vs_min": 1.2,
            "step_s": [0.01, 0.02],
            "equal_cpu_per_rank": {
                "cores": 2,
                "pinned_cores": 1,
                "pinned_world_sizes": [2],
                "pinned_mttr_s": [5.0],
                "pinned_mttr_s_runs": [[5.0]],
                "doublings": [{"world_sizes": [2, 4], "ranks_per_core": 2.0, "ratio": 1.2}],
                "mttr_ratio_max_vs_min": 1.2,
            },
        },
        "startup": {
            "steps": 300,
            "torchrig_wall": {**spread, "median": 15.0},
            "torchrig_first_step": {**spread, "median": 9.5},
            "torchrig_teardown": {**spread, "median": 1.25},
            "torchrun_naive_wall": {**spread, "median": 10.0},
            "wall_ratio_vs_torchrun": 1.5,
        },
        "sdc": {
            "overhead": {
                "step_s_off": {**spread, "median": 0.02},
                "step_s_every_step": {**spread, "median": 0.0202},
                "step_s_default": {**spread, "median": 0.02001},
                "check_s": 0.0002,
                "check_ratio_of_a_step": 0.01,
                "default_every": 20,
                "default_overhead_ratio": 0.0005,
                "default_overhead_ratio_direct": 0.0005,
            },
            "fingerprint_tinygpt": {
                "fingerprint_s": 0.003,
                "fingerprint_ratio_of_a_step": 0.02,
                "fingerprint_ns_per_word": 1.5,
            },
            "detection": {
                "every": 20,
                "flip_step": 23,
                "detected_step": 40,
                "steps_to_detection": 17,
                "seconds_to_detection": 0.5,
            },
            "recompute": {
                "step_s_off": {**spread, "median": 0.02},
                "step_s_every_step": {**spread, "median": 0.03},
                "check_s": 0.01,
                "check_ratio_of_a_step": 0.5,
                "default_every": 100,
                "default_overhead_ratio": 0.005,
                "default_overhead_ratio_direct": 0.01,
            },
            "recompute_detection": {
                "every": 0,
                "flip_step": 23,
                "detected_step": 23,
                "steps_to_detection": 0,
                "seconds_to_detection": 0.02,
                "detail": "recompute: rank(s) 1 disagree",
            },
        },
    }


def test_registry_has_every_section_in_run_order() -> None:
    assert list(SECTIONS) == SECTION_NAMES
    assert all(name == section.name for name, section in SECTIONS.items())


def test_exporter_publishes_its_headline_at_the_top_level() -> None:
    results: dict[str, Any] = {}
    SECTIONS["exporter"].store(results, {"overhead_ratio": 0.003, "on_step_us": 11.0})
    assert results == {"exporter_overhead_ratio": 0.003, "exporter": {"overhead_ratio": 0.003, "on_step_us": 11.0}}
    assert SECTIONS["exporter"].publish is publish_exporter
    results = {}
    SECTIONS["scaling"].store(results, {"world_sizes": [2]})
    assert results == {"scaling": {"world_sizes": [2]}}


def test_run_sections_records_values_and_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(quick: bool) -> dict[str, Any]:
        raise RuntimeError("no disk")

    monkeypatch.setitem(SECTIONS, "ok", Section("ok", lambda quick: {"quick_seen": quick}))
    monkeypatch.setitem(SECTIONS, "bad", Section("bad", boom))
    previous = {"errors": {"ok": "an old failure"}, "mttr": {"kept": True}}
    results = run_sections(["ok", "bad"], True, previous)
    assert results["ok"] == {"quick_seen": True}
    assert "ok" not in results["errors"] and "RuntimeError: no disk" in results["errors"]["bad"]
    assert results["mttr"] == {"kept": True}  # sections not run keep their last figures
    assert results["quick"] is True and set(results["machine"]) == {"cpus", "gpu", "python"}


def test_unknown_section_is_refused_with_the_valid_names(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--only", "overhead,nope"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown sections ['nope']" in err and "valid: " + ", ".join(SECTION_NAMES) in err


def test_report_writes_json_markdown_and_plot(tmp_path: Path) -> None:
    results = fake_results()
    md_path = report.write_report(results, tmp_path)
    assert json.loads((tmp_path / "latest.json").read_text()) == results
    assert report.read_previous(tmp_path) == results
    md = md_path.read_text()
    assert md.startswith("# torchrig benchmarks (2026-01-01T00:00:00Z, 2 CPUs)\n")
    for row in (
        "| 2 ranks, gloo | 990 | 1000 | 0.990 (spread 10.0%) |",
        "| 50MB | 0.030 s | 0.040 s | 0.100 s | 0.020 s | 0.025 s | 0.750 | 1.20 |",
        "| 50MB | 300 | 600 | 0.50 |",
        "| 500MB | 850 | 1000 | 0.85 |",
        "| 500MB | 400 | 1000 | 0.40 |",
        "| 8 MB state | 0.100 s | 0.120 s | 1.20 |",
        "| torchrig in place (warm spare) | 2.00 s | 5 |",
        "| Ray Train FailureConfig | n/a | None |",
        "Speed-up against the fastest peer: 1.50x (target >= 2x).",
        "Exporter overhead: 0.420% of step time (target < 0.15%).",
        "| 4 | 0.200 | 0.100 | 6.000 | 6.000, 7.000, 5.500 | 0.120 | 0.020 | nan |",
        "The survivors' own recovery, largest/smallest world size: 1.20x.",
        "MTTR largest/smallest world size: 2.00x (target <= 1.5x; inplace, restart).",
        "- 4 ranks, survivor phases ended at (s): left 0.020, formed 0.070, state 0.200",
        "At equal CPU per rank (half of each world size pinned to 1 of the 2 cores: 2 ranks 5.000 s), doubling "
        "the world size changes the MTTR by 2 -> 4 ranks at 2 ranks per core: 1.20x; their product, "
        "largest/smallest world size with the same CPU per rank: **1.20x**.",
        "| torchrig run | 15.00 | 9.50 | 1.25 |",
        "| torchrun + naive loop | 10.00 | | |",
        "torchrig over torchrun, wall: 1.50x.",
        "- section `gpu` failed: `RuntimeError: boom`",
        "| median | 0.0200 | 0.0202 | 0.0200 |",
        "One check (fingerprint + all-gather): 0.200 ms, 1.00% of a step; at the default every 20 steps: 0.050%",
        "Flip to detection: 17 steps, 0.500 s (flip at step 23, check every 20).",
        "| median | 0.0200 | 0.0300 |",
        "One recompute check (a neighbour's forward and backward, two fingerprints, an all-gather): 10.000 ms, "
        "50.0% of a step; at the default every 100 steps: 0.50% (measured directly, side by side: 1.00%)",
        "to detection: 0 steps, 0.020 s; recompute: rank(s) 1 disagree.",
    ):
        assert row in md, row
    assert (tmp_path / "scaling.png").read_bytes().startswith(b"\x89PNG")


def test_scaling_at_equal_cpu_per_rank_runs_half_of_each_size_on_half_the_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each drill of the pinned series runs with the affinity its processes inherit: half the cores."""
    from bench.sections import scaling

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: affinity[0])
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cores: affinity.__setitem__(0, set(cores)))
    affinity = [{0, 1, 2, 3}]
    seen: list[tuple[int, set[int]]] = []

    def drill(w: int) -> dict[str, Any]:
        seen.append((w, set(affinity[0])))
        return {"mttr": {2: 0.2, 4: 0.3}[w]}

    monkeypatch.setattr(scaling, "_one_drill", drill)
    got = scaling._equal_cpu_per_rank([2, 4, 8], [0.1, 0.2, 0.33], repeats=2)
    assert seen == [(2, {0, 1}), (4, {0, 1})] * 2 and affinity[0] == {0, 1, 2, 3}  # restored afterwards
    assert got is not None and got["pinned_world_sizes"] == [2, 4] and got["pinned_mttr_s"] == [0.2, 0.3]
    assert [d["world_sizes"] for d in got["doublings"]] == [[2, 4], [4, 8]]
    assert [round(d["ratio"], 3) for d in got["doublings"]] == [1.0, 1.1]  # 0.2/0.2, 0.33/0.3
    assert [d["ranks_per_core"] for d in got["doublings"]] == [1.0, 2.0]
    assert round(got["mttr_ratio_max_vs_min"], 3) == 1.1
    affinity[0] = {0}  # one core: nothing to halve
    assert scaling._equal_cpu_per_rank([2, 4], [0.1, 0.2], repeats=1) is None


def test_report_of_an_empty_run_has_only_its_header(tmp_path: Path) -> None:
    results = {"timestamp": "t", "machine": {"cpus": 1}, "errors": {}}
    report.write_report(results, tmp_path)
    assert (tmp_path / "latest.md").read_text() == "# torchrig benchmarks (t, 1 CPUs)\n\n"
    assert not (tmp_path / "scaling.png").exists()


def test_digits_spec_file_applies_overrides_like_the_cli(tmp_path: Path) -> None:
    path = digits_spec_file(
        tmp_path, ["spec.training.steps=7", "spec.metrics.enabled=false", "spec.checkpoint.every.steps=70"]
    )
    assert path == tmp_path / "bench-digits.yaml"
    spec = load_spec(path)
    assert spec.name == "bench-digits"
    assert spec.spec.training.steps == 7 and spec.spec.metrics.enabled is False
    assert spec.spec.checkpoint.every.steps == 70


def test_a_run_replaces_only_what_it_changed_so_a_concurrent_runs_sections_survive() -> None:
    before = {"timestamp": "t0", "startup": {"ratio": 1.5}, "sdc": {"x": 1}, "errors": {"gpu": "no GPU", "sdc": "old"}}
    # Meanwhile another `python -m bench --only startup` wrote its figures to the file.
    latest = {**before, "timestamp": "t1", "startup": {"ratio": 1.12}, "runs": {"startup": {"quick": False}}}
    after = {
        **before,
        "timestamp": "t2",
        "sdc": {"x": 2},
        "errors": {"gpu": "no GPU"},
        "runs": {"sdc": {"quick": True}},
    }
    merged = merge_changes(latest, before, after)
    assert merged["startup"] == {"ratio": 1.12}  # the other run's section, not this run's stale copy
    assert merged["sdc"] == {"x": 2} and merged["timestamp"] == "t2"
    assert merged["errors"] == {"gpu": "no GPU"}  # this run's section no longer fails
    assert merged["runs"] == {"startup": {"quick": False}, "sdc": {"quick": True}}


def test_each_section_records_when_it_ran_and_whether_quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(SECTIONS, "ok", Section("ok", lambda quick: {"quick_seen": quick}))
    results = run_sections(["ok"], True, {"runs": {"mttr": {"timestamp": "old", "quick": False}}})
    assert results["runs"]["ok"]["quick"] is True and results["runs"]["mttr"] == {"timestamp": "old", "quick": False}
