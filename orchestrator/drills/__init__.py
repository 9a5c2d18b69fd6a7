"""Fault-tolerance drills: run a job, inject a fault, let it recover, compare with a reference, judge.

Public surface: `run_drill`, `DrillOptions`, `DrillReport`, `SCENARIOS`.
"""

from orchestrator.drills.plan import DrillOptions
from orchestrator.drills.report import DrillReport
from orchestrator.drills.runner import run_drill
from orchestrator.drills.scenarios import SCENARIOS

__all__ = ["SCENARIOS", "DrillOptions", "DrillReport", "run_drill"]
