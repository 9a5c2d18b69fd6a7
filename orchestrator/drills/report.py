"""The drill report: JSON for scripts, a verdict table for people, a plot of the timeline."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.drills.history import RunHistory
from orchestrator.errors import EXIT_FAILED, EXIT_INCONCLUSIVE, EXIT_OK
from training.contract import DrillEventKind, write_json

__all__ = ["Check", "DrillReport", "Verdict", "fault_text", "plot_report", "render_table"]


@dataclass
class Check:
    """One line of the verdict: what was required, what was seen, pass or fail."""

    name: str
    passed: bool
    detail: str


class _Checks:
    """Checks that all must pass: shared by a judge's `Verdict` and the whole `DrillReport`."""

    checks: list[Check]

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    def check(self, name: str, passed: bool, detail: str) -> None:
        self.checks.append(Check(name, bool(passed), detail))


@dataclass
class Verdict(_Checks):
    """What a scenario's judge concluded: checks (all must pass) and notes for people."""

    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        self.notes.append(text)

    def add(self, other: Verdict) -> None:
        """Append another verdict's checks and notes (a scenario extending its base's judge)."""
        self.checks += other.checks
        self.notes += other.notes


@dataclass
class DrillReport(_Checks):
    """One drill's account: what ran, where the fault struck, how the job recovered, and the verdict.

    The verdict is `pass` (every check passed), `fail`, or `inconclusive` when the drill proved nothing
    either way (`inconclusive` holds why: its fault struck a job that had already finished). An
    inconclusive report keeps its checks for people to read, but never passes.
    """

    scenario: str
    backend: str
    seed: int
    recovered: bool = False
    fault_step: int | None = None
    fault_rank: int | None = None
    fault_node: int | None = None  # kill-node, partition, a deleted pod: the node's index (no one rank)
    resumed_from_step: int | None = None
    lost_steps: int | None = None
    mttr_seconds: float | None = None
    # "inplace" (a spare, no restore) | "inplace-rollback" (after an SDC: a spare in the suspect's rank, every
    # member reloaded the newest certified checkpoint in place) | "restart" (the group, from a checkpoint;
    # "ray-restart": Ray Train's)
    recovery_path: str | None = None
    restored_from: list[dict[str, Any]] = field(default_factory=list)
    final_params_match_reference: bool | None = None
    final_loss: float | None = None
    reference_final_loss: float | None = None
    params_sha256: str | None = None
    reference_params_sha256: str | None = None
    world_sizes: list[int] = field(default_factory=list)
    status: str = "unknown"
    group_restarts: int | None = None  # the run's worker group restarts (`summary.json` `restarts`)
    run_dir: str = ""
    reference_run_dir: str | None = None
    damage: dict[str, Any] | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    inconclusive: str | None = None  # why the drill proved nothing (None: its checks decide)

    @property
    def passed(self) -> bool:
        """Every check passed and the drill was not inconclusive."""
        return self.inconclusive is None and super().passed

    @property
    def verdict(self) -> str:
        """`pass`, `fail` or `inconclusive`."""
        if self.inconclusive is not None:
            return "inconclusive"
        return "pass" if self.passed else "fail"

    @property
    def exit_code(self) -> int:
        """`torchrig drill`'s exit code: 0 pass, 1 fail, 6 inconclusive (`orchestrator.errors`)."""
        return {"pass": EXIT_OK, "inconclusive": EXIT_INCONCLUSIVE}.get(self.verdict, EXIT_FAILED)

    def add(self, verdict: Verdict) -> None:
        """Take a judge's checks and notes into the report."""
        self.checks += verdict.checks
        self.notes += verdict.notes

    def event_times(self, kind: DrillEventKind) -> list[float]:
        """Times of the timeline entries of one drill event kind."""
        return [float(e["time"]) for e in self.events if e.get("event") == kind]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["verdict"] = self.verdict
        return data

    def write(self, path: str | Path) -> None:
        write_json(path, self.to_dict())


def fault_text(report: dict[str, Any]) -> str:
    """Where the fault struck, from a report's dict: `step 23, rank 1`, `step 23, node 1` for a node fault,
    or `step 23, every process` for one that struck them all (a preemption of the whole job)."""
    node, rank = report.get("fault_node"), report.get("fault_rank")
    where = f"node {node}" if node is not None else f"rank {rank}" if rank is not None else "every process"
    return f"step {report.get('fault_step')}, {where}"


def render_table(report: DrillReport) -> Any:
    """A rich Table of the verdict (imported lazily: rich is only needed for people)."""
    from rich.markup import escape
    from rich.table import Table

    verdict = {
        "pass": "[bold green]PASS[/]",
        "fail": "[bold red]FAIL[/]",
        "inconclusive": f"[bold yellow]INCONCLUSIVE[/] ({escape(report.inconclusive or '')})",
    }[report.verdict]
    table = Table(title=f"drill {report.scenario} on {report.backend} (seed {report.seed}): {verdict}")
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail", overflow="fold")
    for c in report.checks:
        table.add_row(c.name, "[green]ok[/]" if c.passed else "[red]FAILED[/]", c.detail)
    facts = [
        ("fault", fault_text(report.to_dict())),
        ("recovery", report.recovery_path or "-"),
        ("resumed from step", str(report.resumed_from_step)),
        ("lost steps", str(report.lost_steps)),
        ("MTTR", f"{report.mttr_seconds:.2f} s" if report.mttr_seconds is not None else "-"),
        ("world sizes", " -> ".join(map(str, report.world_sizes)) or "-"),
        ("final loss", f"{report.final_loss} (reference {report.reference_final_loss})"),
        ("run dir", report.run_dir),
    ]
    for name, value in facts:
        table.add_row(f"[dim]{name}[/]", "", value)
    return table


def plot_report(report: DrillReport, history: RunHistory, path: str | Path) -> None:
    """The drilled run drawn as `torchrig report --plot` draws any run (`orchestrator.plot`), with the
    drill's injected faults marked and its verdict in the title (PNG)."""
    from orchestrator.plot import plot_run

    verdict = report.verdict.upper()
    mttr = f", MTTR {report.mttr_seconds:.1f} s" if report.mttr_seconds is not None else ""
    plot_run(
        history,
        path,
        fault_times=report.event_times(DrillEventKind.FAULT_INJECTED),
        title=f"torchrig drill {report.scenario}: {verdict}{mttr}",
    )
