"""The campaign report card links run directories named by whoever ran them: no name may become a
`javascript:` link or leave its attribute (issue 33, item 7)."""

from __future__ import annotations

import copy
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.drills.campaign import CampaignOptions, parse_scenarios, parse_seeds, run_campaign
from orchestrator.drills.campaign_html import render_html
from orchestrator.loader import load_spec
from tests.fixtures.campaign import FakeDrill
from tests.fixtures.common import REPO

HOSTILE = ["javascript:alert(1)", 'x" onmouseover="alert(1)', "<script>alert(1)</script>", "a b?c#d%e", "data:,x"]


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.hrefs += [value or "" for name, value in attrs if tag == "a" and name == "href"]


@pytest.fixture(scope="module")
def campaign(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A campaign's report.json document (one case), made by the real campaign code with a fake drill."""
    out = tmp_path_factory.mktemp("campaign") / "out"
    spec = load_spec(REPO / "examples" / "digits-ddp.yaml")
    options = CampaignOptions(scenarios=parse_scenarios("kill-worker"), seeds=parse_seeds(1, None), out_dir=str(out))
    return run_campaign(spec, options, drill=FakeDrill()).to_dict()


def _with_run_named(data: dict[str, Any], name: str) -> tuple[str, list[str]]:
    """The page when the reference run, a case's run and the case's folder are all called `name`."""
    data = copy.deepcopy(data)
    out = Path(data["campaign"]["out_dir"])
    data["campaign"]["references"] = {"2": str(out / name)}
    case = next(c for c in data["cases"] if c.get("report"))
    case["dir"] = name
    case["report"]["run_dir"] = str(out / name)
    case["report"]["reference_run_dir"] = str(out / "refs" / name)
    page = render_html(data)
    parser = _Links()
    parser.feed(page)
    return page, parser.hrefs


def _assert_safe(page: str, hrefs: list[str], name: str) -> None:
    assert "<script" not in page.lower()
    relative = [h for h in hrefs if not h.startswith(("#", "file://"))]
    assert len(relative) >= 5, hrefs  # references, report.json, run directory, its log and events, reference run
    for href in hrefs:
        assert href.startswith(("./", "#", "file://")), href
        assert not any(c in href for c in "\"'<> \t\n"), href  # percent-encoded: nothing leaves the attribute
    for href in relative:
        assert unquote(href, errors="surrogateescape").startswith("./")
    assert any(name in unquote(h) for h in relative)  # the link still leads to the run


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_run_directory_names_become_safe_relative_links(campaign: dict[str, Any], name: str) -> None:
    page, hrefs = _with_run_named(campaign, name)
    _assert_safe(page, hrefs, name)
    assert "javascript:" not in "".join(hrefs).lower()


@settings(max_examples=100, deadline=None)
@given(st.text(st.characters(blacklist_characters="/\x00", blacklist_categories=("Cs",)), min_size=1, max_size=30))
def test_any_name_yields_a_dot_slash_link_with_nothing_unescaped(campaign: dict[str, Any], name: str) -> None:
    if name in (".", ".."):
        return  # no folder of a campaign is named so
    page, hrefs = _with_run_named(campaign, name)
    _assert_safe(page, hrefs, name)
    # a scheme can only start a link at its very beginning: every relative one starts with "./"
    assert not any(h.lower().startswith(("javascript:", "data:", "vbscript:")) for h in hrefs)
