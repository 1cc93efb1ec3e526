"""A study's report: `<study dir>/report.md` and a self-contained `report.html`.

Both hold the trials ranked by the metric (completed first, best first, then pruned and
failed), the best configuration, whether the hypothesis held, and what crashed and how it was
handled; the HTML page adds each trial's reward curve (`reward/mean` per batch, from its step
log) side by side as inline SVG, so the page needs nothing beside it.

    rows = trial_rows(storage_url(study_dir), study.name)
    write_report(study, study_dir, rows)
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jetctl.controller.plot import read_reward_points
from jetctl.research.study import Study
from jetctl.rundir import RunPaths


@dataclass
class TrialRow:
    number: int
    state: str  # COMPLETE | PRUNED | FAIL | RUNNING | WAITING
    params: dict[str, Any]
    value: float | None  # the metric Optuna was told (None unless complete)
    metric: float | None  # the metric the run dir had when it ended (any state)
    outcome: str
    reason: str
    steps: int
    resumes: int
    base: bool
    run_dir: str
    events: list[str] = field(default_factory=list)
    planner: str | None = None  # the planner's reasoning, when it proposed this trial
    cost: tuple[float, float] | None = None  # (CPU s, reported USD) from its run's ledger


def trial_rows(storage: str, name: str) -> list[TrialRow]:
    from jetctl.research.runner import import_optuna

    optuna = import_optuna()
    ostudy = optuna.load_study(study_name=name, storage=storage)
    rows = []
    for t in ostudy.get_trials(deepcopy=False):
        attrs = t.user_attrs
        rows.append(TrialRow(
            number=t.number, state=t.state.name, params=dict(t.params), value=t.value,
            metric=attrs.get("metric"), outcome=attrs.get("outcome", t.state.name.lower()),
            reason=attrs.get("reason", ""), steps=int(attrs.get("steps", 0)),
            resumes=int(attrs.get("resumes", 0)), base=bool(attrs.get("base", False)),
            run_dir=str(attrs.get("run_dir", "")), events=list(attrs.get("events", [])),
            planner=attrs.get("planner"),
            cost=tuple(attrs["cost"]) if attrs.get("cost") is not None else None))
    return rows


def ranked(rows: list[TrialRow], maximize: bool) -> list[TrialRow]:
    """Completed trials best first, then the others by the metric they reached."""
    def key(r: TrialRow) -> tuple[int, float]:
        done = 0 if r.state == "COMPLETE" and r.value is not None else 1
        score = r.value if r.value is not None else r.metric
        if score is None:
            return done, float("inf")
        return done, -score if maximize else score
    return sorted(rows, key=key)


def hypothesis_verdict(study: Study, rows: list[TrialRow]) -> tuple[bool | None, str]:
    """(held, why); None when no trial completed or the hypothesis names no test."""
    spec = study.spec
    maximize = spec.metric.direction == "maximize"
    done = [r for r in ranked(rows, maximize) if r.state == "COMPLETE" and r.value is not None]
    if not done:
        return None, "no trial completed: undecided"
    best = done[0]
    assert best.value is not None
    checks: list[tuple[bool, str]] = []
    if spec.hypothesis.metric_at_least is not None:
        bar = spec.hypothesis.metric_at_least
        ok = best.value >= bar if maximize else best.value <= bar
        checks.append((ok, (f"the best trial ({best.number}) reached {best.value:.3f} against "
                       f"the bar {bar:g}")))
    if spec.hypothesis.beats_base_by is not None:
        # the best trial other than the base recipe's against the base recipe's
        base = next((r for r in done if r.base), None)
        other = next((r for r in done if not r.base), None)
        if base is None or base.value is None or other is None or other.value is None:
            checks.append((False, "the base recipe's trial or every other trial did not complete"))
        else:
            margin = other.value - base.value if maximize else base.value - other.value
            ok = margin >= spec.hypothesis.beats_base_by
            checks.append((ok, (f"the best other trial ({other.number}, {other.value:.3f}) "
                                f"against the base recipe's ({base.number}, {base.value:.3f}): "
                                f"margin {margin:+.3f}, needed {spec.hypothesis.beats_base_by:g}")))
    if not checks:
        return None, "the hypothesis names no test (metric_at_least or beats_base_by)"
    return all(ok for ok, _ in checks), "; ".join(why for _, why in checks)


def _cost(cost: tuple[float, float] | None, i: int) -> str:
    if cost is None:
        return "-"
    return f"{cost[0]:.0f}" if i == 0 else f"{cost[1]:.4f}"


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _params(p: dict[str, Any]) -> str:
    return ", ".join(f"{k.rsplit('.', 1)[-1]}={v:.3g}" if isinstance(v, float) else
                     f"{k.rsplit('.', 1)[-1]}={v}" for k, v in p.items())


def render_markdown(study: Study, rows: list[TrialRow]) -> str:
    spec = study.spec
    order = ranked(rows, spec.metric.direction == "maximize")
    held, why = hypothesis_verdict(study, rows)
    verdict = {True: "held", False: "did not hold", None: "undecided"}[held]
    out = [f"# Study {study.name} (jetctl research, experimental)", "",
           f"- recipe: `{spec.study.recipe}`", (f"- metric: {spec.metric.label} "
           f"({spec.metric.direction})"), f"- hypothesis: {spec.hypothesis.statement}",
           f"- verdict: **{verdict}**: {why}", ""]
    best = next((r for r in order if r.state == "COMPLETE"), None)
    if best is not None:
        out += ["## Best configuration", "", (f"trial {best.number}, {spec.metric.label} = "
                f"{_fmt(best.value)}:"), ""]
        out += [f"- `{k}`: {v}" for k, v in best.params.items()] + [""]
    out += ["## Trials (ranked by the metric)", "",
            "| rank | trial | params | metric | state | outcome | steps | resumes | CPU s | USD |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(order, 1):
        base = " (base)" if r.base else ""
        out.append(f"| {i} | {r.number}{base} | {_params(r.params)} | "
                   f"{_fmt(r.value if r.value is not None else r.metric)} | {r.state} | "
                   f"{r.outcome} | {r.steps} | {r.resumes} | {_cost(r.cost, 0)} | "
                   f"{_cost(r.cost, 1)} |")
    out += ["", "## Crashes and interventions", ""]
    events = [(r.number, e) for r in sorted(rows, key=lambda r: r.number) for e in r.events]
    out += [f"- trial {n}: {e}" for n, e in events] or ["- none"]
    planned = [r for r in sorted(rows, key=lambda r: r.number) if r.planner is not None]
    if planned:
        out += ["", "## Proposed by the planner", ""]
        out += [f"- trial {r.number} ({_params(r.params)}): "
                f"{' '.join((r.planner or '').split()) or '(no reasoning given)'}" for r in planned]
    return "\n".join(out) + "\n"


def _svg(points: list[tuple[float, float]], title: str, w: int = 260, h: int = 150) -> str:
    pad = 24
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
            f'viewBox="0 0 {w} {h}"><rect width="{w}" height="{h}" fill="#fafafa" '
            f'stroke="#ccc"/><text x="6" y="14" font-size="11">{html.escape(title)}</text>')
    if not points:
        return head + f'<text x="{w // 3}" y="{h // 2}" font-size="11">no steps</text></svg>'
    n = max(len(points) - 1, 1)
    coords = " ".join(f"{pad + (w - 2 * pad) * i / n:.1f},{h - pad - (h - 2 * pad) * y:.1f}"
                      for i, (_, y) in enumerate(points))
    axis = (f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="#999"/>'
            f'<text x="2" y="{h - pad}" font-size="9">0</text>'
            f'<text x="2" y="{pad + 3}" font-size="9">1</text>'
            f'<text x="{w - pad - 30}" y="{h - 6}" font-size="9">{len(points)} batches</text>')
    return head + axis + f'<polyline fill="none" stroke="#1f6feb" points="{coords}"/></svg>'


def render_html(study: Study, rows: list[TrialRow]) -> str:
    md = render_markdown(study, rows)
    curves = []
    for r in sorted(rows, key=lambda r: r.number):
        path = RunPaths(Path(r.run_dir)).steps_log(study.spec.metric.model)
        points = read_reward_points(path) if r.run_dir and path.exists() else []
        pts = [(float(p.batch), min(max(p.reward, 0.0), 1.0)) for p in points]
        curves.append(_svg(pts, f"trial {r.number} ({r.outcome}): {_params(r.params)}"))
    body = []
    for line in md.splitlines():
        if line.startswith("# "):
            body.append(f"<h1>{html.escape(line[2:])}</h1>")
        elif line.startswith("## "):
            body.append(f"<h2>{html.escape(line[3:])}</h2>")
        elif line.startswith("|---"):
            continue
        elif line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            tag = "th" if cells[0] == "rank" else "td"
            body.append("<tr>" + "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in cells) + "</tr>")
        elif line.startswith("- "):
            body.append(f"<li>{html.escape(line[2:]).replace('**', '')}</li>")
        elif line:
            body.append(f"<p>{html.escape(line)}</p>")
    text = "\n".join(body).replace("<tr><th>", "<table><tr><th>", 1)
    text = _close_table(text)
    return ("<!doctype html><html><head><meta charset='utf-8'><title>study "
            f"{html.escape(study.name)}</title><style>body{{font-family:sans-serif;margin:2em}}"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px}"
            ".curves{display:flex;flex-wrap:wrap;gap:8px}</style></head><body>"
            f"{text}<h2>Reward curves (reward/mean per batch)</h2><div class='curves'>"
            f"{''.join(curves)}</div></body></html>\n")


def _close_table(text: str) -> str:
    lines = text.split("\n")
    last = max((i for i, ln in enumerate(lines) if ln.startswith("<tr>")), default=None)
    if last is not None:
        lines[last] += "</table>"
    return "\n".join(lines)


def write_report(study: Study, study_dir: Path, rows: list[TrialRow]) -> tuple[Path, Path]:
    md, page = study_dir / "report.md", study_dir / "report.html"
    md.write_text(render_markdown(study, rows))
    page.write_text(render_html(study, rows))
    return md, page
