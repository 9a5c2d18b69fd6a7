"""A campaign's report card as one self-contained HTML page.

Everything is inline (CSS, SVG drawings; no script, font or image is fetched), and the page's
Content-Security-Policy forbids any fetch, so it opens the same from a CI artifact, an e-mail or a
laptop without network. Links go to the case directories (relative to the page) and their logs.
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from orchestrator.drills.report import fault_text

__all__ = ["render_html"]

_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"

_STATE_LABEL = {
    "passed": "PASS",
    "failed": "FAIL",
    "inconclusive": "INCONCLUSIVE",
    "error": "ERROR",
    "skipped": "SKIP",
    "not-run": "NOT RUN",
}
_STATE_COLOR = {
    "passed": "#1a7f37",
    "failed": "#cf222e",
    "inconclusive": "#8250df",
    "error": "#9a6700",
    "skipped": "#8c959f",
    "not-run": "#afb8c1",
}

_STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px;color:#1f2328;max-width:1200px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #d0d7de}
.verdict{padding:2px 10px;border-radius:12px;color:#fff;font-size:15px;vertical-align:middle}
.meta{color:#59636e;margin:2px 0}
table{border-collapse:collapse;margin:6px 0}
th,td{border:1px solid #d0d7de;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f6f8fa}
table.matrix td.cell{text-align:center;min-width:90px}
table.matrix td.cell a{color:#fff;text-decoration:none;font-weight:600}
table.matrix td.cell small{display:block;color:#fff;opacity:.9;font-size:11px}
td.num{text-align:right;font-variant-numeric:tabular-nums}
details{border:1px solid #d0d7de;border-radius:6px;margin:6px 0;padding:4px 10px}
details summary{cursor:pointer;font-weight:600}
ul.checks{margin:4px 0;padding-left:18px} li.bad{color:#cf222e} li.ok{color:#1a7f37}
.links a{margin-right:12px} .dim{color:#59636e}
svg text{font:11px system-ui,sans-serif;fill:#59636e}
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}{unit}"
    return f"{value}{unit}"


def _href(path: str | None, out_dir: str | None) -> str | None:
    """A link to `path`: relative to the page when it lies below the out directory, else a file URI.

    Run directories are named by whoever ran them: a relative link starts with `./` and is
    percent-encoded, so no name reads as a scheme (`javascript:alert(1)`) or leaves the attribute.
    """
    if not path:
        return None
    absolute = Path(path).absolute()
    if out_dir:
        try:
            relative = absolute.relative_to(Path(out_dir).absolute()).as_posix()
        except ValueError:
            pass
        else:
            return "./" + quote(relative, errors="surrogateescape")
    return absolute.as_uri()  # percent-encoded too, and always file://


def _anchor(case: dict[str, Any]) -> str:
    return f"case-{case['scenario']}-seed{case['seed']}"


# -- drawings ---------------------------------------------------------------------------------------------
def _nice_max(value: float) -> float:
    if value <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        if value <= step * power:
            return float(step * power)
    return float(10 * power)


def _strip_plot(title: str, rows: Sequence[tuple[str, list[tuple[float, str]], float | None]], unit: str) -> str:
    """One row per scenario: a dot per case (coloured by state), a tick at the median."""
    width, left, right, row_h = 640, 190, 20, 22
    height = 30 + row_h * len(rows)
    top = max((v for _, vals, _ in rows for v, _ in vals), default=0.0)
    scale_max = _nice_max(top)
    span = width - left - right

    def x(v: float) -> float:
        return left + span * v / scale_max

    parts = [f'<svg width="{width}" height="{height}" role="img" aria-label="{_e(title)}">']
    for i in range(5):
        v = scale_max * i / 4
        parts.append(f'<line x1="{x(v):.1f}" y1="4" x2="{x(v):.1f}" y2="{height - 22}" stroke="#eaeef2"/>')
        parts.append(f'<text x="{x(v):.1f}" y="{height - 8}" text-anchor="middle">{v:g}{_e(unit)}</text>')
    for i, (name, values, median) in enumerate(rows):
        y = 14 + i * row_h
        parts.append(f'<text x="{left - 8}" y="{y + 4}" text-anchor="end">{_e(name)}</text>')
        if not values:
            parts.append(f'<text x="{left + 4}" y="{y + 4}">no data</text>')
        for v, state in values:
            color = _STATE_COLOR.get(state, "#57606a")
            parts.append(
                f'<circle cx="{x(v):.1f}" cy="{y}" r="4.5" fill="{color}" fill-opacity=".75">'
                f"<title>{v:g}</title></circle>"
            )
        if median is not None:
            parts.append(
                f'<line x1="{x(median):.1f}" y1="{y - 8}" x2="{x(median):.1f}" y2="{y + 8}" '
                'stroke="#1f2328" stroke-width="2"/>'
            )
    parts.append("</svg>")
    return "".join(parts)


def _polylines(
    xs: Sequence[float | None],
    ys: Sequence[float | None],
    fx: Callable[[float], float],
    fy: Callable[[float], float],
    color: str,
    step: bool,
) -> str:
    """Lines through (x, y), broken where either is None (a restart between two records)."""
    out: list[list[str]] = []
    seg: list[str] = []
    for xv, yv in zip(xs, ys, strict=False):
        if xv is None or yv is None:
            if seg:
                out.append(seg)
            seg = []
            continue
        if step and seg:
            seg.append(f"{fx(xv):.1f},{seg[-1].split(',')[1]}")
        seg.append(f"{fx(xv):.1f},{fy(yv):.1f}")
    if seg:
        out.append(seg)
    return "".join(
        f'<polyline points="{" ".join(s)}" fill="none" stroke="{color}" stroke-width="1.6"/>' for s in out if s
    )


def _timeline(tl: dict[str, Any] | None) -> str:
    """Samples/s (blue, left axis) and world size (orange, right axis) over time; faults in red."""
    if not tl:
        return '<p class="dim">no timeline (the run directory is gone)</p>'
    width, height, left, right, top, bottom = 620, 166, 52, 40, 10, 42
    end = max(float(tl.get("end_s") or 0.0), 1e-6)
    sps = [v for v in tl.get("samples_per_s", []) if v is not None]
    sizes = [v for v in tl.get("world_size", []) if v is not None]
    y1max = _nice_max(max(sps, default=0.0))
    y2max = max(max(sizes, default=1.0), 1.0)

    def fx(v: float) -> float:
        return left + (width - left - right) * v / end

    def fy1(v: float) -> float:
        return height - bottom - (height - bottom - top) * v / y1max

    def fy2(v: float) -> float:
        return height - bottom - (height - bottom - top) * v / (y2max * 1.15)

    parts = [f'<svg width="{width}" height="{height}" role="img" aria-label="throughput and world size">']
    parts.append(
        f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{height - top - bottom}" '
        'fill="none" stroke="#d0d7de"/>'
    )
    for i in range(3):
        v = y1max * i / 2
        parts.append(f'<text x="{left - 4}" y="{fy1(v) + 4:.1f}" text-anchor="end">{v:g}</text>')
    for i in range(5):
        v = end * i / 4
        parts.append(f'<text x="{fx(v):.1f}" y="{height - bottom + 14}" text-anchor="middle">{v:.0f} s</text>')
    parts.append(f'<text x="{width - right + 4}" y="{fy2(y2max) + 4:.1f}">{y2max:g}</text>')
    parts.append(f'<text x="{width - right + 4}" y="{fy2(0) + 4:.1f}">0</text>')
    for marker in tl.get("restarts", []):
        x = fx(float(marker["t"]))
        parts.append(
            f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{height - bottom}" stroke="#8c959f" '
            f'stroke-dasharray="2,3"><title>{_e(marker["label"])}</title></line>'
        )
    for marker in tl.get("faults", []):
        x = fx(float(marker["t"]))
        parts.append(
            f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{height - bottom}" stroke="#cf222e" '
            f'stroke-width="1.5" stroke-dasharray="5,3"><title>{_e(marker["label"])}</title></line>'
        )
    parts.append(_polylines(tl.get("t", []), tl.get("samples_per_s", []), fx, fy1, "#0969da", step=False))
    parts.append(_polylines(tl.get("world_size_t", []), tl.get("world_size", []), fx, fy2, "#bc4c00", step=True))
    legend = height - 4
    parts.append(
        f'<text x="{left}" y="{legend}" style="fill:#0969da">— samples/s (left)</text>'
        f'<text x="{left + 120}" y="{legend}" style="fill:#bc4c00">— world size (right)</text>'
        f'<text x="{left + 250}" y="{legend}" style="fill:#cf222e">┆ fault</text>'
        f'<text x="{left + 310}" y="{legend}">┆ restart</text>'
    )
    parts.append("</svg>")
    return "".join(parts)


# -- sections ----------------------------------------------------------------------------------------------
def _cell(case: dict[str, Any] | None) -> str:
    if case is None:  # an interrupted campaign: running it again with the same --out fills it in
        return '<td class="cell dim">not yet run</td>'
    state = case["state"]
    report = case.get("report") or {}
    detail = ""
    if report:
        detail = f"MTTR {_fmt(report.get('mttr_seconds'), ' s')} · lost {_fmt(report.get('lost_steps'))}"
    elif case.get("reason"):
        detail = case["reason"]
    title = case.get("reason") or "; ".join(c["name"] for c in case.get("failed_checks", [])) or state
    return (
        f'<td class="cell {_e(state)}" style="background:{_STATE_COLOR.get(state, "#57606a")}" title="{_e(title)}">'
        f'<a href="#{_e(_anchor(case))}">{_STATE_LABEL.get(state, state)}</a><small>{_e(detail)}</small></td>'
    )


def _matrix(data: dict[str, Any]) -> str:
    campaign = data["campaign"]
    seeds = campaign["seeds"]
    by_key = {(c["scenario"], c["seed"]): c for c in data["cases"]}
    head = "".join(f"<th>seed {_e(s)}</th>" for s in seeds)
    rows = []
    for scenario in campaign["scenarios"]:
        agg = data["scenarios"].get(scenario, {})
        rate = agg.get("pass_rate")
        rate_text = f"{agg.get('passed', 0)}/{agg.get('ran', 0)}" if rate is not None else "-"
        cells = "".join(_cell(by_key.get((scenario, s))) for s in seeds)
        rows.append(f'<tr><th scope="row">{_e(scenario)}</th>{cells}<td class="num">{rate_text}</td></tr>')
    return (
        f'<table class="matrix" id="matrix"><thead><tr><th>scenario</th>{head}<th>passed</th></tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table>"
    )


def _aggregates(data: dict[str, Any]) -> str:
    rows = []
    for scenario, agg in data["scenarios"].items():
        mttr, lost = agg["mttr_s"], agg["lost_steps"]
        rate = "-" if agg["pass_rate"] is None else f"{100 * agg['pass_rate']:.0f}%"
        paths = ", ".join(f"{k} x{v}" for k, v in sorted(agg["recovery_paths"].items())) or "-"
        note = agg.get("skip_reason") or ""
        rows.append(
            f"<tr><th scope='row'>{_e(scenario)}</th><td class='num'>{rate}</td>"
            f"<td class='num'>{_fmt(mttr['median'])}</td><td class='num'>{_fmt(mttr['p90'])}</td>"
            f"<td class='num'>{_fmt(mttr['max'])}</td><td class='num'>{_fmt(lost['median'])}</td>"
            f"<td class='num'>{_fmt(lost['max'])}</td><td>{_e(paths)}</td><td class='dim'>{_e(note)}</td></tr>"
        )
    return (
        "<table class='aggregates'><thead><tr><th>scenario</th><th>pass rate</th><th>MTTR median (s)</th>"
        "<th>MTTR p90 (s)</th><th>MTTR max (s)</th><th>lost steps median</th><th>lost steps max</th>"
        f"<th>recovery path</th><th>skipped because</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
    )


def _distributions(data: dict[str, Any]) -> str:
    mttr_rows, lost_rows = [], []
    for scenario, agg in data["scenarios"].items():
        cases = [c for c in data["cases"] if c["scenario"] == scenario and c.get("report")]
        mttr = [
            (float(c["report"]["mttr_seconds"]), c["state"])
            for c in cases
            if c["report"].get("mttr_seconds") is not None
        ]
        lost = [
            (float(c["report"]["lost_steps"]), c["state"]) for c in cases if c["report"].get("lost_steps") is not None
        ]
        mttr_rows.append((scenario, mttr, agg["mttr_s"]["median"]))
        lost_rows.append((scenario, lost, agg["lost_steps"]["median"]))
    return (
        "<h3>MTTR (fault -> first step after recovery)</h3>"
        + _strip_plot("MTTR per scenario", mttr_rows, " s")
        + "<h3>Lost steps (fault step - resumed step)</h3>"
        + _strip_plot("lost steps per scenario", lost_rows, "")
    )


def _case(case: dict[str, Any], out_dir: str | None) -> str:
    state = case["state"]
    report = case.get("report") or {}
    label = _STATE_LABEL.get(state, state)
    opened = " open" if state in ("failed", "inconclusive", "error") else ""
    earlier = " · from an earlier run" if case.get("resumed") else ""
    head = (
        f'<summary><span style="color:{_STATE_COLOR.get(state, "#57606a")}">{label}</span> '
        f"{_e(case['scenario'])} seed {_e(case['seed'])}"
        f'<span class="dim"> · {_fmt(case.get("duration_s"), " s")}{earlier}</span></summary>'
    )
    body = []
    if case.get("reason"):
        body.append(f"<p>{_e(case['reason'])}</p>")
    if report:
        facts = [
            ("fault", fault_text(report)),
            ("resumed from step", _fmt(report.get("resumed_from_step"))),
            ("lost steps", _fmt(report.get("lost_steps"))),
            ("MTTR", _fmt(report.get("mttr_seconds"), " s")),
            ("recovery path", _fmt(report.get("recovery_path"))),
            ("world sizes", " -> ".join(map(str, report.get("world_sizes") or [])) or "-"),
            ("status", _fmt(report.get("status"))),
        ]
        body.append("<table>" + "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in facts) + "</table>")
        checks = "".join(
            f'<li class="{"ok" if c.get("passed") else "bad"}">{"ok" if c.get("passed") else "FAILED"}: '
            f"{_e(c.get('name'))} <span class='dim'>({_e(c.get('detail'))})</span></li>"
            for c in report.get("checks", [])
        )
        body.append(f'<ul class="checks">{checks}</ul>')
        body.append(_timeline(case.get("timeline")))
        links = []
        run_dir = report.get("run_dir")
        for text, target in (
            (
                "report.json",
                _href(str(Path(out_dir or ".") / case["dir"] / "report.json"), out_dir) if case.get("dir") else None,
            ),
            ("run directory", _href(run_dir, out_dir)),
            ("node 0 log", _href(str(Path(run_dir) / "logs" / "node0.log"), out_dir) if run_dir else None),
            ("events", _href(str(Path(run_dir) / "events.jsonl"), out_dir) if run_dir else None),
            ("reference run", _href(report.get("reference_run_dir"), out_dir)),
        ):
            if target:
                links.append(f'<a href="{_e(target)}">{_e(text)}</a>')
        body.append(f'<p class="links">{"".join(links)}</p>')
    return f'<details id="{_e(_anchor(case))}"{opened}>{head}{"".join(body)}</details>'


def render_html(data: dict[str, Any]) -> str:
    """The report card of a campaign's `report.json` document (`CampaignResult.to_dict()`)."""
    campaign = data["campaign"]
    counts = data["counts"]
    verdict = data["verdict"]
    color = _STATE_COLOR["passed" if verdict == "pass" else "failed"]
    out_dir = campaign.get("out_dir") or os.getcwd()
    summary = ", ".join(f"{n} {state}" for state, n in counts.items() if n)
    refs = ", ".join(
        f'world size {_e(ws)}: <a href="{_e(_href(d, out_dir))}">{_e(d)}</a>'
        for ws, d in sorted(campaign.get("references", {}).items())
    )
    order = {name: i for i, name in enumerate(campaign["scenarios"])}
    runnable = sorted(
        (c for c in data["cases"] if c["state"] != "skipped"), key=lambda c: (order.get(c["scenario"], 0), c["seed"])
    )
    cases = "".join(_case(c, out_dir) for c in runnable)
    skipped = [c for c in data["cases"] if c["state"] == "skipped"]
    skipped_html = ""
    if skipped:
        items = "".join(f"<li>{_e(c['scenario'])} seed {_e(c['seed'])}: {_e(c['reason'])}</li>" for c in skipped)
        skipped_html = f"<h3>Skipped</h3><ul>{items}</ul>"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{_CSP}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>torchrig drill campaign {_e(campaign["job"])}: {verdict.upper()}</title>
<style>{_STYLE}</style></head>
<body>
<h1>Drill campaign <code>{_e(campaign["job"])}</code>
<span class="verdict" style="background:{color}">{verdict.upper()}</span></h1>
<p class="meta">job file {_e(campaign.get("job_file") or "-")} · backend {_e(campaign["backend"])} ·
{len(campaign["scenarios"])} scenarios x {len(campaign["seeds"])} seeds · {_e(summary)} ·
{_fmt(campaign.get("wall_s"), " s")} wall ({_fmt(campaign.get("cases_s"), " s")} in cases, earlier runs included)</p>
<p class="meta">references: {refs or "-"}</p>
<h2>Verdicts</h2>
{_matrix(data)}
<h2>Per scenario</h2>
{_aggregates(data)}
<h2>Distributions</h2>
{_distributions(data)}
<h2>Cases</h2>
{cases}
{skipped_html}
</body></html>
"""
