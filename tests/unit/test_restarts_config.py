"""`RestartsConfig.in_place` and `.standby_nodes`: the one home of "in place on / effective spare nodes",
and the modules that used to spell the rule themselves agreeing with it."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.backends.local_plan import standby_nodes as local_standby_nodes
from orchestrator.compile._common import inplace_store_env
from orchestrator.compile.pytorchjob import spare_nodes
from orchestrator.loader import load_spec
from training.config import RestartsConfig

REPO = Path(__file__).resolve().parents[2]

# mode, spares, spareNodes -> in_place, standby_nodes
TABLE = [
    ("auto", 1, 0, True, 0),
    ("auto", 1, 2, True, 2),
    ("auto", 0, 2, False, 0),
    ("inplace", 3, 1, True, 1),
    ("inplace", 0, 1, False, 0),
    ("restart", 1, 2, False, 0),
    ("restart", 0, 0, False, 0),
    ("inplace", 64, 64, True, 64),
]


@pytest.mark.parametrize(("mode", "spares", "spare_nodes_", "in_place", "standby"), TABLE)
def test_in_place_and_standby_nodes(mode: str, spares: int, spare_nodes_: int, in_place: bool, standby: int) -> None:
    r = RestartsConfig.model_validate({"mode": mode, "spares": spares, "spareNodes": spare_nodes_})
    assert r.in_place is in_place
    assert r.standby_nodes == standby


@pytest.mark.parametrize(("mode", "spares", "spare_nodes_", "in_place", "standby"), TABLE)
def test_the_compilers_and_the_local_backend_read_it(
    mode: str, spares: int, spare_nodes_: int, in_place: bool, standby: int
) -> None:
    overrides = [
        "spec.nodes.min=2",
        "spec.nodes.max=2",
        f"spec.restarts.mode={mode}",
        f"spec.restarts.spares={spares}",
        f"spec.restarts.spareNodes={spare_nodes_}",
    ]
    spec = load_spec(REPO / "examples" / "digits-ddp.yaml", overrides)
    assert spare_nodes(spec, elastic=False) == standby
    assert spare_nodes(spec, elastic=True) == 0  # an elastic job's operator replaces a lost node itself
    assert local_standby_nodes(spec) == standby
    assert bool(inplace_store_env(spec)) is in_place
    warned = any(w.startswith("spec.restarts.spareNodes: has no effect") for w in spec.warnings())
    assert warned == (spare_nodes_ > 0 and not in_place)
