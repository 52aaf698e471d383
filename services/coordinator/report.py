"""``flowgrpo report RUN_DIR [RUN_DIR ...]``: one self-contained HTML page of one or more runs
(overlaid), written to ``<first run_dir>/report.html`` (or ``--out``). Nothing is fetched when it
is viewed: plotly.js, the data and the image grids are inside the page.

Top to bottom: the summary (the reward's first and last quarter, against the control when one of
the runs has lr = 0), the optimised reward alone on its axis with the control beside it and the
paired gain, a verifiable task's held-out accuracy per category, every scorer's % change on its
own axis (weight 0: watched, not optimised), every metric as a small panel by section with one
smoothing slider (metrics flat throughout, such as a sync run's log-prob gap and lag, listed
instead of plotted), each validation prompt written above its image at the first and the last
validation side by side, the training grids with each cell's prompt and reward, the run
metadata (``sessions.jsonl``: command, version, commit, host, times) and the config as a diff
against its recipe (``recipe.yaml``) and between the runs. What to show is
:mod:`.report_data`; this module writes the page."""

from __future__ import annotations

import html
import json
import math
from importlib import resources
from pathlib import Path
from typing import Any

from flowgrpo.services.coordinator.report_data import (
    Grid,
    Panel,
    Run,
    Section,
    accuracy_panels,
    config_diff,
    grid_cells,
    grids,
    headline,
    load_runs,
    metadata_rows,
    paired_gain,
    scorer_panels,
    sections,
    summary_rows,
)

REPORT_FILE = "report.html"
STYLE = """body{font-family:system-ui,sans-serif;max-width:1280px;margin:1.5em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:.2em .5em;text-align:left;
vertical-align:top}th{background:#f4f4f4}code,.mono{font-family:ui-monospace,monospace;font-size:.9em}
.wide{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:.8em}
.small{display:grid;grid-template-columns:repeat(auto-fill,minmax(380px,1fr));gap:.6em}
.box{border:1px solid #e4e4e4;border-radius:4px;padding:.2em}.panel{height:250px}.wide .panel{height:360px}
.ptitle{font-family:ui-monospace,monospace;font-size:.85em;padding:.2em .4em;font-weight:600}
.note{color:#555;font-size:.9em}img{max-width:100%;image-rendering:pixelated}
.bar{position:sticky;top:0;background:#fff;padding:.4em 0;border-bottom:1px solid #ddd;z-index:10}
details{margin:.4em 0}summary{cursor:pointer;font-weight:600}
.cells{display:grid;grid-template-columns:repeat(auto-fill,minmax(240px,1fr));gap:.6em}
.cell{margin:0;border:1px solid #e4e4e4;border-radius:4px;padding:.3em}.cell figcaption{font-size:.9em;
min-height:2.4em}.cell div:first-of-type{display:grid;grid-template-columns:1fr 1fr;gap:.2em}
pre{background:#f6f6f6;padding:1em;overflow:auto;font-size:.8em;max-height:40em}"""
# first in the page: every error and console.error is kept, and shown in <body data-errors> (the
# browser test reads it); an error still reaches the console as before
CATCH = r"""
window.reportErrors = [];
window.addEventListener('error', e => window.reportErrors.push(String(e.message)));
const consoleError = console.error;
console.error = (...args) => { window.reportErrors.push(args.map(String).join(' ')); consoleError(...args); };
"""
SCRIPT = r"""
const DATA = JSON.parse(document.getElementById('report-data').textContent);
const COLORS = ['#1f77b4', '#d62728', '#2ca02c', '#9467bd', '#ff7f0e', '#17becf', '#8c564b', '#e377c2'];
let weight = 0.6;
function ema(ys) {  // TensorBoard's debiased exponential moving average; gaps stay gaps
  if (weight <= 0) return ys;
  let last = 0, n = 0;
  return ys.map(y => { if (y === null) return null; last = last * weight + (1 - weight) * y; n++;
                       return last / (1 - Math.pow(weight, n)); });
}
function traces(spec) {
  const out = [];
  spec.traces.forEach((t, i) => {
    const color = COLORS[(t.color ?? i) % COLORS.length];
    const line = {color: color, dash: t.dash || 'solid', width: 2};
    if (t.lo) {
      out.push({x: t.x, y: t.lo, mode: 'lines', line: {width: 0}, hoverinfo: 'skip', showlegend: false});
      out.push({x: t.x, y: t.hi, mode: 'lines', fill: 'tonexty', fillcolor: 'rgba(31,119,180,0.15)',
                line: {width: 0}, name: 'min-max', hoverinfo: 'skip'});
    }
    const smoothed = t.smooth && weight > 0;
    if (smoothed) out.push({x: t.x, y: t.y, mode: 'lines', line: {color: color, width: 1}, opacity: 0.3,
                            hoverinfo: 'skip', showlegend: false});
    out.push({x: t.x, y: smoothed ? ema(t.y) : t.y, mode: t.mode, name: t.name, line: line,
              marker: {size: 6}, customdata: t.y,
              hovertemplate: smoothed ? '%{y:.4g} (raw %{customdata:.4g})' : '%{y:.4g}'});
  });
  return out;
}
function layout(spec) {
  return {margin: {l: 55, r: 10, t: 8, b: 30}, hovermode: 'x unified', yaxis: {title: {text: spec.y}},
          showlegend: spec.traces.length > 1, legend: {orientation: 'h', y: -0.12, font: {size: 10}}};
}
function draw(el) {
  const spec = DATA.panels[+el.dataset.panel];
  Plotly.react(el, traces(spec), layout(spec), {displaylogo: false, responsive: true});
  el.dataset.drawn = '1';
}
function visible(el) { for (let d = el.closest('details'); d; d = d.parentElement.closest('details'))
                         if (!d.open) return false; return true; }
function drawVisible() { document.querySelectorAll('.panel').forEach(el => {
                           if (!el.dataset.drawn && visible(el)) draw(el); });
                         const drawn = document.querySelectorAll('.panel[data-drawn]').length;
                         document.body.dataset.drawn = drawn;
                         document.body.dataset.errors = JSON.stringify(window.reportErrors); }
document.querySelectorAll('details').forEach(d => d.addEventListener('toggle', drawVisible));
const slider = document.getElementById('smoothing');
slider.addEventListener('input', () => {
  weight = +slider.value; document.getElementById('smoothing-value').textContent = weight.toFixed(2);
  document.querySelectorAll('.panel[data-drawn]').forEach(draw);
});
document.querySelectorAll('.train-grids').forEach(box => {
  const grids = DATA.train_grids[+box.dataset.run], range = box.querySelector('input');
  const show = () => { const g = grids[+range.value];
    box.querySelector('img').src = 'data:image/png;base64,' + g.png;
    box.querySelector('.step').textContent = 'step ' + g.step;
    box.querySelector('tbody').innerHTML = g.cells.map((c, i) =>
      `<tr><td>${Math.floor(i / g.columns) + 1}, ${i % g.columns + 1}</td><td></td><td>${
       c.reward === null || c.reward === undefined ? '' : c.reward.toPrecision(6)}</td></tr>`).join('');
    box.querySelectorAll('tbody tr').forEach((tr, i) => tr.children[1].textContent = g.cells[i].prompt); };
  range.addEventListener('input', show); show();
});
drawVisible();
"""


def write_report(run_dirs: str | Path | list[str | Path], out: str | Path | None = None) -> Path:
    """Render the report of one run, or of several overlaid; returns the file written."""
    dirs = [run_dirs] if isinstance(run_dirs, str | Path) else list(run_dirs)
    if not dirs:
        raise ValueError("report needs at least one run folder")
    runs = load_runs(dirs)
    page = render(runs)
    path = Path(out) if out is not None else runs[0].dir / REPORT_FILE
    path.write_text(page, encoding="utf-8")
    return path


def render(runs: list[Run]) -> str:
    panels: list[Panel] = []
    body = [
        f"<h1>{html.escape(' vs '.join(r.label for r in runs))}</h1>",
        _table("", [r.label for r in runs], summary_rows(runs)),
        _smoothing_bar(),
        "<h2>The optimised reward</h2>",
        _panels([p for p in (headline(runs), paired_gain(runs)) if p is not None], panels, "wide"),
        _accuracy(runs, panels),
        "<h2>Each scorer, as % change from its first step</h2>",
        "<p class='note'>Each on its own axis. A weight-0 scorer is watched, not optimised: the "
        "optimised one rising while a watched one drifts is what reward hacking looks like.</p>",
        _panels(scorer_panels(runs), panels, "small"),
        "<h2>Every metric, by section</h2>",
        "".join(_section(s, panels) for s in sections(runs)),
        "<h2>Samples</h2>",
        "".join(_samples(run, i, open_=i == 0) for i, run in enumerate(runs)),
        "<h2>The run</h2>",
        _table("", [r.label for r in runs], metadata_rows(runs)),
        "<h2>Config: what differs from the recipe</h2>",
        "".join(_config(run) for run in runs),
        _between(runs),
    ]
    data = {"panels": panels, "train_grids": [[_grid_json(g) for g in grids(r, "train")] for r in runs]}
    title = html.escape(f"FlowGRPO report: {', '.join(r.label for r in runs)}")
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title><style>{STYLE}</style>"
        f"<script>{CATCH}</script><script>{_plotly_js()}</script></head><body>{''.join(body)}"
        f"<script type='application/json' id='report-data'>{_json(data)}</script>"
        f"<script>{SCRIPT}</script></body></html>\n"
    )


def _plotly_js() -> str:
    """plotly.js as the plotly package ships it (its `package_data`): nothing fetched at view time."""
    return (resources.files("plotly") / "package_data" / "plotly.min.js").read_text(encoding="utf-8")


def _json(data: Any) -> str:
    """JSON safe inside a <script> element (no ``</``), NaN as null."""
    return json.dumps(_finite(data), separators=(",", ":")).replace("</", "<\\/").replace("<!--", "<\\!--")


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _panels(specs: list[Panel], panels: list[Panel], kind: str) -> str:
    """Placeholders the script draws into (when visible: a folded section is drawn when opened)."""
    divs = []
    for spec in specs:
        panels.append(spec)
        note = f"<div class='note'>{html.escape(spec['note'])}</div>" if spec.get("note") else ""
        title = html.escape(spec["title"])
        divs.append(f"<div class='box'><div class='ptitle'>{title}</div><div class='panel' "
                    f"data-panel='{len(panels) - 1}' data-title='{title}'></div>{note}</div>")  # fmt: skip
    return f"<div class='{kind}'>{''.join(divs)}</div>"


def _section(section: Section, panels: list[Panel]) -> str:
    folded = section.name in ("timestamp_s", "publication", "training") or not section.panels
    opened = "" if folded else " open"
    flat = ""
    if section.flat:
        rows = "".join(f"<tr><td class='mono'>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>"
                       for k, v in section.flat)  # fmt: skip
        flat = f"<table class='flat'>{rows}</table>"
        if section.panels:  # beside plots: folded once more; a section of flat ones only shows them
            summary = f"{len(section.flat)} flat throughout, not plotted"
            flat = f"<details><summary>{summary}</summary>{flat}</details>"
    count = f"{len(section.panels)} plotted" + (f", {len(section.flat)} flat" if section.flat else "")
    return (f"<details class='section'{opened}><summary>{html.escape(section.name)} ({count})</summary>"
            f"{_panels(section.panels, panels, 'small')}{flat}</details>")  # fmt: skip


def _accuracy(runs: list[Run], panels: list[Panel]) -> str:
    specs = accuracy_panels(runs)
    if not specs:
        return ""
    return ("<h2>Held-out accuracy, by category</h2><p class='note'>The verifier's all-or-nothing "
            "score on the validation prompts (combinations no training prompt has), in %; a "
            "control (lr=0) is dashed.</p>" + _panels(specs, panels, "small"))  # fmt: skip


def _smoothing_bar() -> str:
    return ("<div class='bar'>smoothing <input type='range' id='smoothing' min='0' max='0.99' "
            "step='0.01' value='0.6'> <span id='smoothing-value'>0.60</span> <span class='note'>(x: the "
            "step; an exponential moving average as TensorBoard's; the raw curve stays faint behind; "
            "drag to zoom, double-click to reset)</span></div>")  # fmt: skip


def _samples(run: Run, index: int, open_: bool) -> str:
    val, train = grids(run, "val"), grids(run, "train")
    parts = [
        f"<details class='samples'{' open' if open_ else ''}><summary>{html.escape(run.label)}</summary>"
    ]
    if val:
        first, last = val[0], val[-1]
        parts.append(
            "<h3>Validation</h3><p class='note'>The same prompts and the same initial noise every "
            "time (ODE sampling): what differs between the grids is what the policy learnt.</p>"
        )
        if last is not first and [c["prompt"] for c in first.cells] == [c["prompt"] for c in last.cells]:
            parts.append(_before_after(first, last))
        else:  # one validation, or grids of other prompts: each as it is
            shown = [first] if last is first else [first, last]
            parts.append("".join(_grid_figure(g) + _cell_table(g) for g in shown))
        between = val[1:-1]
        if between:
            inner = "".join(_grid_figure(g) + _cell_table(g) for g in between)
            parts.append(
                f"<details><summary>{len(between)} validation(s) in between</summary>{inner}</details>"
            )
    else:
        parts.append("<p>No validation in this run (schedule.eval_every=0 or not reached).</p>")
    if train:
        parts.append(
            f"<h3>Training samples</h3><div class='train-grids' data-run='{index}'>"
            f"<input type='range' min='0' max='{len(train) - 1}' value='{len(train) - 1}' style='width:60%'> "
            f"<b class='step'></b> <span class='note'>({len(train)} steps' grids)</span><br>"
            "<img alt='training samples'><table><thead><tr><th>row, column</th><th>prompt</th>"
            "<th>reward</th></tr></thead><tbody></tbody></table></div>"
        )
    return "".join(parts) + "</details>"


def _before_after(first: Grid, last: Grid) -> str:
    """Each validation prompt written above its image at the first step and at the last, side by
    side, with the reward under each."""
    cards = [
        "<figure class='cell'>"
        f"<figcaption>{html.escape(a['prompt'])}</figcaption>"
        f"<div><img alt='step {first.step}' src='data:image/png;base64,{image_a}'>"
        f"<img alt='step {last.step}' src='data:image/png;base64,{image_b}'></div>"
        f"<div class='note'>{_reward(a)} &rarr; {_reward(b)}</div></figure>"
        for a, b, image_a, image_b in zip(
            first.cells, last.cells, grid_cells(first), grid_cells(last), strict=True
        )
    ]
    return (
        f"<p class='note'>Left: step {first.step}; right: step {last.step}; under each pair, "
        f"the rewards.</p><div class='cells'>{''.join(cards)}</div>"
    )


def _grid_figure(grid: Grid) -> str:
    label = "before training" if grid.step == 0 else f"after step {grid.step}"
    source = f"data:image/png;base64,{grid.png_base64}"
    return (f"<figure><figcaption><b>Step {grid.step}</b> ({label})</figcaption>"
            f"<img alt='validation at step {grid.step}' src='{source}'></figure>")  # fmt: skip


def _cell_table(grid: Grid) -> str:
    """Each cell's prompt and reward at ``grid``'s step."""
    if not grid.cells:
        return ""
    head = ["row, column", "prompt", f"reward at step {grid.step}"]
    rows = [
        "<tr>" + "".join(f"<td>{c}</td>" for c in (f"{i // grid.columns + 1}, {i % grid.columns + 1}",
                                                   html.escape(cell["prompt"]), _reward(cell))) + "</tr>"
        for i, cell in enumerate(grid.cells)
    ]  # fmt: skip
    return "<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>" + "".join(rows) + "</table>"


def _reward(cell: dict[str, Any]) -> str:
    return "" if cell.get("reward") is None else format(cell["reward"], "+.6g")


def _grid_json(grid: Grid) -> dict[str, Any]:
    return {"step": grid.step, "png": grid.png_base64, "columns": grid.columns, "cells": grid.cells}


def _table(corner: str, columns: list[str], rows: list[tuple[str, list[str]]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in [corner, *columns])
    body = "".join(
        f"<tr><th>{html.escape(what)}</th>" + "".join(f"<td>{html.escape(v)}</td>" for v in vals) + "</tr>"
        for what, vals in rows
    )
    return f"<table class='summary'><tr>{head}</tr>{body}</table>"


def _config(run: Run) -> str:
    full = html.escape((run.dir / "config.yaml").read_text())
    folded = f"<details><summary>the resolved config (config.yaml)</summary><pre>{full}</pre></details>"
    if run.recipe is None:
        note = "no recipe.yaml in the folder (a run from before it was written): the whole config below"
        return f"<h3>{html.escape(run.label)}</h3><p class='note'>{note}</p>{folded}"
    rows = config_diff(run.recipe, run.config)
    return f"<h3>{html.escape(run.label)}</h3>" + _diff_table(rows, "recipe", "this run") + folded


def _between(runs: list[Run]) -> str:
    if len(runs) < 2:
        return ""
    parts = ["<h2>Config: what differs between the runs</h2>"]
    for run in runs[1:]:
        rows = [r for r in config_diff(runs[0].config, run.config) if r[0] not in ("run_dir", "name")]
        parts.append(f"<h3>{html.escape(run.label)} against {html.escape(runs[0].label)}</h3>")
        parts.append(_diff_table(rows, runs[0].label, run.label))
    return "".join(parts)


def _diff_table(rows: list[tuple[str, str, str]], left: str, right: str) -> str:
    if not rows:
        return "<p>No difference.</p>"
    body = "".join(
        f"<tr><td class='mono'>{html.escape(k)}</td><td class='mono'>{html.escape(a)}</td>"
        f"<td class='mono'>{html.escape(b)}</td></tr>"
        for k, a, b in rows
    )
    return (f"<table class='diff'><tr><th>key</th><th>{html.escape(left)}</th><th>{html.escape(right)}</th>"
            f"</tr>{body}</table>")  # fmt: skip
