"""A static HTML report of a run: plots over steps and sample trajectories, turn by turn.

No network resources and no plotting library: the plots are inline SVG polylines. Sampled
tokens are shown on a white background, observed (masked) tokens on grey, so what the policy
was trained on is visible at a glance.
"""

from __future__ import annotations

import html
import math
from typing import Any, Sequence

from agentrl.trajectory import Trajectory

__all__ = ["render_report", "PLOTS"]

# (title, metric keys drawn together)
PLOTS: list[tuple[str, list[str]]] = [
    ("reward", ["reward/mean", "val/reward/mean"]),
    ("success rate", ["success_rate", "val/success_rate"]),
    ("assistant turns per trajectory", ["turns/mean", "val/turns/mean"]),
    ("tool calls per trajectory", ["tool_calls/mean", "val/tool_calls/mean"]),
    ("tool errors by kind", ["tool_errors/bad_json", "tool_errors/unknown_tool", "tool_errors/invalid_arguments",
                             "tool_errors/tool_exception", "tool_errors/timeout"]),
    ("response length (tokens)", ["response_length/mean", "val/response_length/mean"]),
    ("finish reasons (fraction)", ["finish/stop", "finish/length", "finish/response_budget", "finish/max_assistant_turns"]),
    ("SFT loss", ["sft/loss"]),
    ("engine vs trainer logprob |Δ|", ["logprob_mismatch/mean"]),
]
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]


def _plot(title: str, series: dict[str, list[tuple[float, float]]]) -> str:
    points = [p for values in series.values() for p in values]
    if not points:
        return ""
    w, h, pad = 420, 220, 36
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys + [0.0]), max(ys)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y1 = y0 + 1

    def sx(x: float) -> float:
        return pad + (x - x0) / (x1 - x0) * (w - 2 * pad)

    def sy(y: float) -> float:
        return h - pad - (y - y0) / (y1 - y0) * (h - 2 * pad)

    parts = [f'<svg width="{w}" height="{h}" role="img" aria-label="{html.escape(title)}">',
             f'<text x="{pad}" y="16" font-size="13" font-weight="bold">{html.escape(title)}</text>',
             f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="#999"/>',
             f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="#999"/>',
             f'<text x="2" y="{sy(y1) + 4:.0f}" font-size="10">{y1:.3g}</text>',
             f'<text x="2" y="{sy(y0) + 4:.0f}" font-size="10">{y0:.3g}</text>',
             f'<text x="{pad}" y="{h - 8}" font-size="10">step {x0:g}</text>',
             f'<text x="{w - pad - 40}" y="{h - 8}" font-size="10">step {x1:g}</text>']
    for i, (name, values) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in values)
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{coords}"/>')
        for x, y in values:
            parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2" fill="{color}"/>')
        parts.append(f'<text x="{w - pad - 150}" y="{30 + 13 * i}" font-size="10" fill="{color}">{html.escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _trajectory_html(t: Trajectory, decode) -> str:
    rows = []
    for k, turn in enumerate(t.turns):
        ids = t.response_ids[turn.start : turn.end]
        text = decode(ids) if decode is not None else " ".join(map(str, ids))
        style = "sampled" if turn.role == "assistant" else "observed"
        reward = f" · turn reward {turn.reward:g}" if turn.reward is not None else ""
        rows.append(f'<div class="turn {style}"><b>{turn.role}</b> [{turn.start}, {turn.end}){reward}<pre>{html.escape(text)}</pre></div>')
    calls = "".join(
        f"<li><code>{html.escape(str(c.name))}({html.escape(str(c.arguments))})</code> → {html.escape(c.result[:200])}"
        f"{' <b>' + html.escape(c.error) + '</b>' if c.error else ''}</li>"
        for c in t.tool_calls
    )
    head = (f"<h3>{html.escape(t.row_id)} #{t.sample_index} · reward {t.reward:g} · {html.escape(t.finish_reason)}"
            f" · ground truth {html.escape(str(t.ground_truth))}</h3>")
    return f'<section class="traj">{head}{"".join(rows)}{"<ul>" + calls + "</ul>" if calls else ""}</section>'


def render_report(metrics_rows: Sequence[dict[str, Any]], trajectories: Sequence[Trajectory], title: str,
                  *, decode=None, summary: dict[str, Any] | None = None) -> str:
    """The report page. ``decode(ids) -> str`` renders tokens as text (else ids are shown)."""
    plots = []
    for plot_title, keys in PLOTS:
        series = {}
        for key in keys:
            values = [(float(r["step"]), float(r[key])) for r in metrics_rows
                      if key in r and isinstance(r[key], (int, float)) and math.isfinite(float(r[key]))]
            if values:
                series[key] = values
        svg = _plot(plot_title, series)
        if svg:
            plots.append(f'<div class="plot">{svg}</div>')
    summary_html = ""
    if summary:
        items = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>" for k, v in summary.items())
        summary_html = f"<table>{items}</table>"
    samples = "".join(_trajectory_html(t, decode) for t in trajectories)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 24px; }} .plots {{ display: flex; flex-wrap: wrap; gap: 12px; }}
.turn {{ border-left: 4px solid #1f77b4; padding: 2px 8px; margin: 4px 0; }}
.turn.observed {{ border-color: #999; background: #eee; }} pre {{ white-space: pre-wrap; margin: 2px 0; }}
table td {{ padding: 2px 10px; border-bottom: 1px solid #ddd; }}
</style></head><body>
<h1>{html.escape(title)}</h1>{summary_html}
<h2>Over steps</h2><div class="plots">{"".join(plots)}</div>
<h2>Sample trajectories</h2><p>Sampled (trained) tokens on white; observed tokens (tool results, user turns) on grey.</p>
{samples}
</body></html>
"""
