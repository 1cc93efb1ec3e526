"""The explorer's HTML: server-rendered pages, inline SVG charts, no script but a little
plain JavaScript (auto-refresh). Every value from a store is escaped."""

from __future__ import annotations

import math
from html import escape
from typing import Any
from urllib.parse import quote

from jetctl.view.stores import FATES, GroupFilter, GroupRow, OpenedGroup, Texts, Trace

STYLE = """
body{font:14px system-ui,sans-serif;margin:1em 2em;color:#222}
a{color:#0645ad}table{border-collapse:collapse}td,th{padding:2px 8px;border-bottom:1px solid #ddd;
text-align:left;vertical-align:top}.members{display:flex;gap:1em;align-items:flex-start}
.member{flex:1;min-width:18em;border:1px solid #ccc;padding:.5em;overflow-wrap:anywhere}
.turn{margin:.4em 0;padding:.3em;border-left:3px solid #999}.env{background:#f4f4f4;
white-space:pre-wrap}.tok{white-space:pre-wrap;border-radius:2px}.tok.masked{outline:1px dashed #999}
.bar{fill:#4a7}.curve{fill:none;stroke-width:2}.note{color:#a50}form.filters input{width:7em}
"""
REFRESH_JS = """
const box=document.getElementById('live');
if(box){box.checked=sessionStorage.getItem('live')==='1';
box.onchange=()=>sessionStorage.setItem('live',box.checked?'1':'0');
setInterval(()=>{if(box.checked)location.reload()},10000);}
"""
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def page(title: str, body: str) -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(title)}</title>"
            f"<style>{STYLE}</style></head><body><p><a href='/'>overview</a></p>"
            f"<h1>{escape(title)}</h1>{body}<script>{REFRESH_JS}</script></body></html>")


def group_link(g: GroupRow) -> str:
    return f"<a class='group-link' href='/group/{quote(g.model)}/{quote(g.id)}'>{escape(g.id)}</a>"


def step_link(model: str, step: int | None) -> str:
    if step is None:
        return "-"
    return f"<a class='step-link' href='/step/{quote(model)}/{step}'>{step}</a>"


def group_table(rows: list[GroupRow]) -> str:
    head = ("<tr><th>group</th><th>model</th><th>task</th><th>members</th><th>reward</th>"
            "<th>oldest version</th><th>lag</th><th>revisions</th><th>fate</th><th>step</th></tr>")
    body = "".join(
        f"<tr class='group' data-fate='{escape(g.state)}'><td>{group_link(g)}</td>"
        f"<td>{escape(g.model)}</td><td>{escape(g.task)}</td><td>{g.n_trajectories}</td>"
        f"<td class='reward'>{g.reward_mean:.3f}</td><td>{g.min_version}</td>"
        f"<td>{'' if g.lag is None else g.lag}</td><td>{escape(', '.join(g.revisions))}</td>"
        f"<td class='fate'>{escape(g.fate)}</td><td>{step_link(g.model, g.step)}</td></tr>"
        for g in rows
    )
    return f"<p>{len(rows)} groups</p><table id='groups'>{head}{body}</table>"


def filter_form(f: GroupFilter, tasks: list[str]) -> str:
    def opt(value: str, chosen: str | None) -> str:
        sel = " selected" if value == (chosen or "") else ""
        return f"<option value='{escape(value)}'{sel}>{escape(value) or 'any'}</option>"

    def num(name: str, value: float | None) -> str:
        v = "" if value is None else escape(str(value))
        return f"<input name='{name}' id='{name}' value='{v}' inputmode='decimal'>"

    return (
        "<form class='filters' method='get' action='/'>"
        f"task <select name='task' id='task'>{opt('', None)}"
        f"{''.join(opt(t, f.task) for t in tasks)}</select> "
        f"fate <select name='fate' id='fate'>{opt('', None)}"
        f"{''.join(opt(x, f.fate) for x in FATES)}</select> "
        f"reward {num('reward_min', f.reward_min)} to {num('reward_max', f.reward_max)} "
        f"version {num('version_min', f.version_min)} to {num('version_max', f.version_max)} "
        f"revision <input name='revision' id='revision' value='{escape(f.revision or '')}'> "
        f"text <input name='search' id='search' value='{escape(f.search or '')}'> "
        "<button id='apply' type='submit'>filter</button></form>"
    )


def curve_svg(model: str, tasks: dict[str, dict[str, Any]]) -> str:
    """Reward per step of each task; each point links to the step's groups."""
    points = [(p["step"], p["reward"]) for t in tasks.values() for p in t["curve"]]
    if not points:
        return "<p>no trained groups yet</p>"
    w, h, pad = 560, 200, 30
    s0, s1 = min(p[0] for p in points), max(p[0] for p in points)
    r0, r1 = min(p[1] for p in points), max(p[1] for p in points)
    sx = (w - 2 * pad) / max(s1 - s0, 1)
    sy = (h - 2 * pad) / (r1 - r0 if r1 > r0 else 1.0)
    parts, legend = [], []
    for color, (task, t) in zip(COLORS * 10, sorted(tasks.items())):
        xy = [(pad + (p["step"] - s0) * sx, h - pad - (p["reward"] - r0) * sy) for p in t["curve"]]
        parts.append(f"<polyline class='curve' stroke='{color}' points='"
                     + " ".join(f"{x:.1f},{y:.1f}" for x, y in xy) + "'/>")
        for (x, y), p in zip(xy, t["curve"]):
            parts.append(
                f"<a href='/step/{quote(model)}/{p['step']}'><circle cx='{x:.1f}' cy='{y:.1f}' "
                f"r='4' fill='{color}'><title>{escape(task)} step {p['step']}: reward "
                f"{p['reward']:.3f} ({p['groups']} groups)</title></circle></a>")
        legend.append(f"<span style='color:{color}'>&#9632; {escape(task)}</span>")
    axes = (f"<text x='{pad}' y='{h - 8}'>step {s0}</text><text x='{w - pad - 60}' "
            f"y='{h - 8}'>step {s1}</text><text x='2' y='{pad - 10}'>reward {r1:.2f}</text>"
            f"<text x='2' y='{h - pad + 14}'>{r0:.2f}</text>")
    return (f"<svg class='reward-curve' width='{w}' height='{h}'>{axes}{''.join(parts)}</svg>"
            f"<p>{' '.join(legend)}</p>")


def histogram_svg(counts: dict[int, int]) -> str:
    if not counts:
        return "<p>-</p>"
    w, h = 24, 80
    top = max(counts.values())
    lags = range(min(counts), max(counts) + 1)
    bars = "".join(
        f"<rect class='bar' x='{i * w + 2}' y='{h - 20 - (counts.get(lag, 0) / top) * (h - 30):.1f}'"
        f" width='{w - 4}' height='{(counts.get(lag, 0) / top) * (h - 30):.1f}'>"
        f"<title>lag {lag}: {counts.get(lag, 0)} groups</title></rect>"
        f"<text x='{i * w + 6}' y='{h - 5}'>{lag}</text>"
        for i, lag in enumerate(lags)
    )
    return f"<svg class='staleness' width='{len(lags) * w + 4}' height='{h}'>{bars}</svg>"


def overview(views: list[dict[str, Any]], rows: list[GroupRow], f: GroupFilter,
             tasks: list[str]) -> str:
    parts = ["<p><label><input type='checkbox' id='live'> refresh every 10 s</label></p>"]
    for v in views:
        share = "-" if v["skipped_share"] is None else f"{100 * v['skipped_share']:.0f}%"
        rate = "-" if v["trajectories_per_s"] is None else f"{v['trajectories_per_s']:.2f}"
        tok = "-" if v["tokens_per_s"] is None else f"{v['tokens_per_s']:.0f}"
        parts.append(
            f"<h2>model {escape(v['model'])}</h2><p>version {v['version']} after "
            f"{v['steps']} step rows; skipped for zero variance: {share} of consumed groups; "
            f"throughput {rate} trajectories/s, {tok} trained tokens/s (last step)</p>"
            + curve_svg(v["model"], v["tasks"]))
        rows_html = "".join(
            f"<tr><td>{escape(task)}</td><td>"
            + ", ".join(f"{escape(k)} {n}" for k, n in sorted(t["fates"].items()))
            + f"</td><td>{histogram_svg(t['staleness'])}</td></tr>"
            for task, t in sorted(v["tasks"].items()))
        parts.append("<table class='tasks'><tr><th>task</th><th>groups by fate</th>"
                     f"<th>staleness (step - oldest version) of trained groups</th></tr>"
                     f"{rows_html}</table>")
    parts.append("<h2>groups</h2>" + filter_form(f, tasks) + group_table(rows))
    return "".join(parts)


def _heat(logprob: float) -> str:
    """Token background: white at logprob 0 (certain), red as it falls (p = e^logprob)."""
    p = math.exp(max(logprob, -20.0))
    return f"rgb(255,{int(140 + 115 * p)},{int(140 + 115 * p)})"


def member_html(t: Any, advantage: float, trained: bool, texts: Texts) -> str:
    """One trajectory (`jetctl.types.Trajectory`) turn by turn: what the env said, then what
    the model wrote, token by token."""
    turns, seen = [], 0
    for i, c in enumerate(t.calls):
        prompt = list(c.prompt_ids)
        new = prompt[seen:] if i else prompt
        label = "prompt" if i == 0 else "tool results / environment"
        turns.append(f"<div class='turn env'><b>{label}</b> ({len(new)} tokens)\n"
                     f"{escape(texts.text(new))}</div>")
        pieces = texts.pieces(list(c.completion_ids))
        toks = "".join(
            f"<span class='tok{'' if trained else ' masked'}' data-mask='{int(trained)}' "
            f"style='background:{_heat(lp)}' title='logprob {lp:.3f}'>{escape(piece)}</span>"
            for piece, lp in zip(pieces, c.completion_logprobs))
        kind = "tool call" if c.finish_reason == "tool_calls" else c.finish_reason
        turns.append(
            f"<div class='turn'><b>assistant</b>, model version {c.model_version}, "
            f"<span class='count'>{len(c.completion_ids)}</span> tokens ({escape(kind)})<br>"
            f"{toks}</div>")
        seen = len(prompt) + len(c.completion_ids)
    error = f"<p class='note'>error: {escape(t.error)}</p>" if t.error else ""
    return (
        f"<div class='member' id='m-{escape(t.id)}'><p><a href='/trace/{quote(t.id)}'>"
        f"{escape(t.id)}</a><br>reward {t.reward:.3f}, advantage {advantage:+.3f}, "
        f"status {escape(t.status)}, trained (mask) {'yes' if trained else 'no'}<br>"
        f"node {escape(t.client_id) or '?'}, revision {escape(t.client_revision) or '?'}, "
        f"role {escape(t.role)}, task row {escape(t.task_id)}</p>{error}{''.join(turns)}</div>")


def group_page(g: OpenedGroup, texts: Texts, lag_now: int | None) -> str:
    r = g.row
    facts = (
        f"<table class='facts'><tr><td>model</td><td>{escape(r.model)}</td></tr>"
        f"<tr><td>task</td><td>{escape(r.task)}</td></tr>"
        f"<tr><td>fate</td><td class='fate'>{escape(r.fate)}"
        + (" (skipped for zero variance: no gradient)" if g.zero_variance and
           r.state == "trained" else "")
        + f"</td></tr><tr><td>step</td><td>{step_link(r.model, r.step)}</td></tr>"
        f"<tr><td>oldest call version</td><td>{r.min_version}</td></tr>"
        f"<tr><td>staleness</td><td>{'' if r.lag is None else r.lag}"
        + ("" if lag_now is None else f" (now {lag_now} behind the server)")
        + f"</td></tr><tr><td>revisions</td><td>{escape(', '.join(r.revisions))}</td></tr>"
        f"<tr><td>mean reward</td><td>{r.reward_mean:.3f}</td></tr></table>")
    if g.group is None:
        return facts + ("<p class='note'>its members are no longer stored: the store drops a "
                        "group's tokens once a checkpoint holds its step, or when it is "
                        "refused. Trajectory ids: "
                        + ", ".join(f"<a href='/trace/{quote(i)}'>{escape(i)}</a>"
                                    for i in r.trajectory_ids) + "</p>")
    note = f"<p class='note'>{escape(texts.problem)}: token ids shown</p>" if texts.problem else ""
    members = "".join(member_html(m.trajectory, m.advantage, m.trained, texts) for m in g.members)
    return (facts + f"<p>advantages: {escape(g.advantage_name)}; token colour: logprob "
            "(white = probability 1, red = low); dashed = not trained (mask 0)</p>"
            + note + f"<div class='members'>{members}</div>")


def step_page(model: str, step: int, row: dict[str, float] | None, groups: list[GroupRow]) -> str:
    keys = ("reward/mean", "loss", "groups", "groups/skipped", "staleness/mean", "num_tokens",
            "timing/train_s")
    facts = "<p>no step row for this step in the step log</p>" if row is None else (
        "<table class='step'>" + "".join(
            f"<tr><td>{k}</td><td>{row[k]:.4g}</td></tr>" for k in keys if k in row) + "</table>")
    return facts + f"<h2>groups marked trained at step {step}</h2>" + group_table(groups)


def trace_page(t: Trace) -> str:
    cells = [
        ("model", escape(t.model) or "?"),
        ("group", group_link(t.row) if t.row else "-"),
        ("task", (escape(t.row.task) if t.row else "?") + (f" row {escape(t.task_id)}"
                                                           if t.task_id else "")),
        ("node", escape(t.node) or "?"), ("revision", escape(t.revision) or "?"),
        ("versions per turn", escape(", ".join(map(str, t.versions))) or "?"),
        ("status", escape(t.status + (f": {t.error}" if t.error else "")) or "-"),
        ("admission", escape(t.verdict) or "?"),
        ("trained at step", step_link(t.model, t.step)),
        ("first checkpoint holding it", escape(t.checkpoint) or "-"),
    ]
    rows = "".join(f"<tr><td>{k}</td><td class='{k.split()[0]}'>{v}</td></tr>" for k, v in cells)
    notes = "".join(f"<p class='note'>{escape(n)}</p>" for n in t.notes)
    return f"<table class='trace'>{rows}</table>{notes}"

