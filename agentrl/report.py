"""A static HTML report: the run's result, plots over steps and sample trajectories, turn by turn.

One self-contained page, no network resources and no plotting library. It opens with what the
run was for (held-out success and tool use before and after, the command, its wall time); each
plot is an inline SVG drawn here, with labelled ticks along both axes and its legend below the
axes, in a grid whose columns fill the window's width (text never under 12 px); counts of events
per step (tool errors by kind, dropped groups, interrupted requests) are bars, not lines joining
steps. The start-up phases follow the plots as a table of seconds, then the raw summary.
Trajectories are shown token by token; a sampled token (trained on, mask 1) sits on white, an
observed one (prompt, tool results, user turns, template glue: mask 0) on grey, and hovering a token shows its id and logprob. An asynchronous run (``rollout.max_staleness``
> 0) adds the staleness of the trained samples, per step as stacked bars (trajectories at each
staleness 0..eta) and as mean and max, the trainer's idle and the engine's busy share of each
step, the weight sync's seconds, the groups dropped as stale and in flight, and the requests that
partial rollouts interrupted and resumed. ``agentrl replay report`` and the
quickstart's ``report.html`` both use :func:`render_report`.
"""

from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Collection, Sequence

from agentrl.trajectory import Trajectory

__all__ = ["render_report", "PLOTS", "Plot"]

Decode = Callable[[list[int]], str]


@dataclass(frozen=True, slots=True)
class Plot:
    """One plot: the metric keys drawn together, and key prefixes whose every key is drawn.
    ``events``: the values count events of a step (errors, dropped groups), drawn as bars, not
    as lines joining the steps."""

    title: str
    keys: tuple[str, ...] = ()
    prefixes: tuple[str, ...] = ()
    events: bool = False
    suffixes: tuple[str, ...] = ("",)  # of the prefixes' keys, those ending so

    def series_keys(self, available: Sequence[str]) -> list[str]:
        found = [k for k in self.keys if k in available]
        found += sorted(k for k in available if k.startswith(self.prefixes) and k.endswith(self.suffixes) and k not in found
                        ) if self.prefixes else []
        return found


PLOTS: tuple[Plot, ...] = (
    Plot("reward (mean)", ("reward/mean", "val/reward/mean")),
    Plot("success rate", ("success_rate", "val/success_rate")),
    Plot("reward by role (several agents in one episode: docs/roles.md)", prefixes=("role/", "val/role/"), suffixes=("/reward",)),
    Plot("assistant turns per trajectory", ("turns/mean", "val/turns/mean")),
    Plot("tool calls per trajectory", ("tool_calls/mean", "val/tool_calls/mean")),
    Plot("tool-use rate (share of trajectories with a call)", ("tool_use_rate", "val/tool_use_rate")),
    Plot("success after a first answer judged wrong (interaction tasks)",
         ("retry/second_attempt_success", "val/retry/second_attempt_success", "val/source/agentrl/arith_retry_after_wrong/success_rate")),
    Plot("tool errors by kind (per step)", prefixes=("tool_errors/",), events=True),
    # agentrl.agent.call_stats: calls malformed among all calls, turns with the format's call marker and no call
    Plot("tool-call parse rate", ("tool_calls/malformed_rate", "tool_calls/unparsed_turn_rate",
                                  "val/tool_calls/malformed_rate", "val/tool_calls/unparsed_turn_rate")),
    Plot("per tool: calls and mean ToolResult.metrics (per step)", prefixes=("tool/",)),
    Plot("response length (tokens)", ("response_length/mean", "val/response_length/mean")),
    Plot("finish reasons (fraction)", prefixes=("finish/",)),
    Plot("SFT loss", ("sft/loss",)),
    Plot("logprob mismatch |Δ| (engine vs trainer)", ("logprob_mismatch/mean", "replay/logprob_mismatch/mean",
                                                      "health/logprob_mismatch")),
    # the run's health measures (trainer/health.py): shares of groups alike, dropped as stale, tool calls failing
    Plot("run health (shares per step)", ("health/uniform_groups", "health/stale_groups", "tool_calls/malformed_rate"),
         prefixes=("health/tool_error_rate/",)),
    # asynchronous training (rollout.max_staleness > 0); the staleness histogram per step comes first
    Plot("staleness of the trained samples (policy versions)", ("async/staleness_mean", "async/staleness_max")),
    Plot("time shares of the step: trainer idle, engine busy", ("async/trainer_idle_fraction", "engine/busy_fraction")),
    Plot("weight sync (s)", ("timing/weight_sync_s",)),
    Plot("groups dropped as stale and in flight (per step)", ("async/dropped_groups", "async/in_flight_groups"), events=True),
    Plot("partial rollouts: requests interrupted and resumed (per step)", ("engine/interrupted_requests", "engine/resumed_requests"),
         events=True),
)
STALENESS = "staleness of the trained samples (policy versions)"
WHOLE_RUN = " (whole run, unfiltered)"  # the legend's mark of a filtered report's metrics.jsonl series
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")


# ----------------------------------------------------------------------------- plots


def _series(rows: Sequence[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    """``key``'s values by step; a step logged twice (a run killed after logging a step and resumed
    from an earlier checkpoint logs it again) shows the later value, the one training went on from."""
    points: dict[float, float] = {}
    for row in rows:
        x, y = row.get("step"), row.get(key)
        if isinstance(x, (int, float)) and isinstance(y, (int, float)) and math.isfinite(float(y)):
            points[float(x)] = float(y)
    return sorted(points.items())


def _nice_ticks(lo: float, hi: float, *, integers: bool = False, count: int = 6) -> list[float]:
    """About ``count`` round values (1, 2, 2.5 or 5 times a power of ten apart) covering [lo, hi]."""
    if hi <= lo:
        hi = lo + 1
    raw = (hi - lo) / (count - 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in ((1, 2, 5, 10) if integers else (1, 2, 2.5, 5, 10)) if m * magnitude >= raw)
    if integers:
        step = max(step, 1.0)
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [round(k * step, 12) for k in range(first, last + 1)]


# The plots' geometry, in SVG user units. A plot is drawn WIDTH wide and scaled to its grid cell,
# which is never narrower (the page's grid: columns of at least PLOT_MIN_PX), so text drawn at
# TICK_FONT or more is never shown smaller than that many pixels; a wide window gets more columns.
WIDTH, LEFT, RIGHT, TOP, PLOT_H = 560, 62, 16, 28, 190
TICK_FONT, LABEL_FONT, LEGEND_FONT, TITLE_FONT, LEGEND_ROW = 12, 13, 13, 15, 18
PLOT_MIN_PX = WIDTH + 12  # the plot box's border and padding


def _frame(title: str, xs: list[float], ys: list[float], legend: int, x_label: str, *, pad: float = 0.0):
    """A plot's frame: title, axes with labelled ticks (``pad``: the x axis runs that far past the
    first and last x, for bars) and
    room for ``legend`` entries below the axes. Returns the SVG parts so far, the x and y scales,
    where the legend starts and the left edge."""
    w, left, right, top, plot_h = WIDTH, LEFT, RIGHT, TOP, PLOT_H
    x_ticks = _nice_ticks(min(xs), max(xs), integers=all(x == int(x) for x in xs))
    y_ticks = _nice_ticks(min(ys + [0.0]), max(ys + [0.0]))
    x0, x1, y0, y1 = x_ticks[0], x_ticks[-1], y_ticks[0], y_ticks[-1]
    if pad:  # bars: the axis runs half a bar's room past the first and last, ticks inside it
        x0, x1 = min(xs) - pad, max(xs) + pad
        x_ticks = [x for x in x_ticks if x0 <= x <= x1]
    bottom_axis = top + plot_h
    legend_top = bottom_axis + 48
    h = legend_top + LEGEND_ROW * legend

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * (w - left - right)

    def sy(y: float) -> float:
        return bottom_axis - (y - y0) / (y1 - y0) * plot_h

    out = [f'<svg class="plot" viewBox="0 0 {w} {h}" role="img" aria-label="{html.escape(title)}">',
           f'<text x="{left}" y="18" font-size="{TITLE_FONT}" font-weight="bold">{html.escape(title)}</text>',
           f'<rect class="area" x="{left}" y="{top}" width="{w - left - right}" height="{plot_h}" fill="none"/>']
    for y in y_ticks:
        out.append(f'<line x1="{left}" y1="{sy(y):.1f}" x2="{w - right}" y2="{sy(y):.1f}" stroke="#eee"/>')
        out.append(f'<text class="tick y" x="{left - 6}" y="{sy(y) + 4:.1f}" font-size="{TICK_FONT}" text-anchor="end">{y:g}</text>')
    for x in x_ticks:
        out.append(f'<line x1="{sx(x):.1f}" y1="{bottom_axis}" x2="{sx(x):.1f}" y2="{bottom_axis + 4}" stroke="#999"/>')
        out.append(f'<text class="tick x" x="{sx(x):.1f}" y="{bottom_axis + 17}" font-size="{TICK_FONT}" text-anchor="middle">{x:g}</text>')
    out.append(f'<line x1="{left}" y1="{bottom_axis}" x2="{w - right}" y2="{bottom_axis}" stroke="#999"/>')
    out.append(f'<line x1="{left}" y1="{top}" x2="{left}" y2="{bottom_axis}" stroke="#999"/>')
    out.append(f'<text class="axis-label" x="{(left + w - right) / 2:.1f}" y="{bottom_axis + 34}" font-size="{LABEL_FONT}" '
               f'text-anchor="middle">{html.escape(x_label)}</text>')
    return out, sx, sy, legend_top, left


def _legend(out: list[str], entries: list[tuple[str, str]], legend_top: float, left: float, *, swatch: str) -> None:
    """One legend entry a series, below the axes: (label, colour), marked with a line or a box."""
    for i, (label, color) in enumerate(entries):
        row = legend_top + LEGEND_ROW * i
        mark = (f'<line x1="{left}" y1="{row - 5}" x2="{left + 18}" y2="{row - 5}" stroke="{color}" stroke-width="2"/>'
                if swatch == "line" else f'<rect x="{left + 4}" y="{row - 11}" width="11" height="11" fill="{color}"/>')
        out.append(f'<g class="legend-entry">{mark}<text x="{left + 24}" y="{row}" font-size="{LEGEND_FONT}" '
                   f'fill="{color}">{html.escape(label)}</text></g>')


def _svg(title: str, series: dict[str, list[tuple[float, float]]], x_label: str = "step", whole_run: Collection[str] = ()) -> str:
    """A line plot: labelled ticks along both axes, the legend below the axes (never over the lines);
    a key in ``whole_run`` is labelled so in a filtered report."""
    points = [p for values in series.values() for p in values]
    out, sx, sy, legend_top, left = _frame(title, [p[0] for p in points], [p[1] for p in points], len(series), x_label)
    for i, (name, values) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in values)
        out.append(f'<polyline class="series" data-key="{html.escape(name)}" fill="none" stroke="{color}" stroke-width="2" points="{coords}"/>')
        out.extend(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{color}"><title>{html.escape(name)} {html.escape(x_label)} {x:g}: {y:.4g}</title></circle>'
                   for x, y in values)
    _legend(out, [(name + (WHOLE_RUN if name in whole_run else ""), COLORS[i % len(COLORS)]) for i, name in enumerate(series)],
            legend_top, left, swatch="line")
    out.append("</svg>")
    return "".join(out)


def _bar_width(sx: Callable[[float], float], xs: list[float]) -> float:
    """The room of one step's column of bars: most of the smallest gap between steps, at most 24."""
    gap = min((b - a for a, b in zip(xs, xs[1:])), default=1.0)
    return min(0.7 * (sx(xs[0] + gap) - sx(xs[0])), 24.0)


def _event_bars(title: str, series: dict[str, list[tuple[float, float]]], x_label: str = "step",
                whole_run: Collection[str] = ()) -> str:
    """Counts of events per step (errors, dropped groups, interrupted requests): one bar a key
    and step, the keys of a step side by side, nothing where nothing happened, so steps are
    never joined as if the count ran on between them."""
    xs = sorted({x for values in series.values() for x, _ in values})
    ys = [y for values in series.values() for _, y in values]
    out, sx, sy, legend_top, left = _frame(title, xs, ys, len(series), x_label, pad=0.5)
    column = _bar_width(sx, xs)
    width = column / len(series)
    for i, (name, values) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        for x, y in values:
            if y == 0:
                continue
            top, bottom = sorted((sy(y), sy(0.0)))
            out.append(f'<rect class="bar" data-key="{html.escape(name)}" x="{sx(x) - column / 2 + i * width:.1f}" y="{top:.1f}" '
                       f'width="{width:.1f}" height="{bottom - top:.1f}" fill="{color}">'
                       f'<title>{html.escape(x_label)} {x:g} · {html.escape(name)}: {y:g}</title></rect>')
    _legend(out, [(name + (WHOLE_RUN if name in whole_run else ""), COLORS[i % len(COLORS)]) for i, name in enumerate(series)],
            legend_top, left, swatch="box")
    out.append("</svg>")
    return "".join(out)


def _stacked_bars(title: str, columns: dict[float, list[tuple[str, str, float]]], x_label: str = "step") -> str:
    """Stacked bars, one a step: ``columns[x]`` holds (key, legend label, value) bottom to top,
    the same keys in every column; the legend (one entry a key) below the axes."""
    xs = sorted(columns)
    totals = [sum(v for _, _, v in columns[x]) for x in xs]
    keys = list(dict.fromkeys((key, label) for x in xs for key, label, _ in columns[x]))
    out, sx, sy, legend_top, left = _frame(title, xs, totals, len(keys), x_label, pad=0.5)
    width = _bar_width(sx, xs)
    color = {key: COLORS[i % len(COLORS)] for i, (key, _) in enumerate(keys)}
    for x in xs:
        base = 0.0
        for key, label, value in columns[x]:
            y_top, y_bottom = sy(base + value), sy(base)
            out.append(f'<rect class="bar" data-key="{html.escape(key)}" x="{sx(x) - width / 2:.1f}" y="{y_top:.1f}" '
                       f'width="{width:.1f}" height="{y_bottom - y_top:.1f}" fill="{color[key]}">'
                       f'<title>{html.escape(x_label)} {x:g} · {html.escape(label)}: {value:g}</title></rect>')
            base += value
    _legend(out, [(label, color[key]) for key, label in keys], legend_top, left, swatch="box")
    out.append("</svg>")
    return "".join(out)


STALENESS_HIST = "async/staleness_hist/"


def _staleness_histogram(rows: Sequence[dict[str, Any]]) -> str | None:
    """Asynchronous runs (``rollout.max_staleness`` > 0): per step, the trained trajectories at
    each staleness 0..eta (``async/staleness_hist/<k>``), stacked."""
    columns: dict[float, list[tuple[str, str, float]]] = {}
    for row in rows:
        hist = sorted((int(k[len(STALENESS_HIST):]), k) for k in row if k.startswith(STALENESS_HIST)
                      and k[len(STALENESS_HIST):].isdigit())
        step = row.get("step")
        if hist and isinstance(step, (int, float)):
            columns[float(step)] = [(key, f"staleness {k}" + (" (on-policy)" if k == 0 else ""), float(row[key])) for k, key in hist]
    if not columns:
        return None
    return _stacked_bars("staleness histogram per step (trajectories)", columns)


def _plots(rows: Sequence[dict[str, Any]], whole_run: Collection[str] = ()) -> list[str]:
    available = sorted({k for row in rows for k in row})
    svgs = []
    for plot in PLOTS:
        if plot.title == STALENESS and (histogram := _staleness_histogram(rows)) is not None:
            svgs.append(histogram)  # an asynchronous run's staleness: the histogram per step, then mean and max
        series = {key: values for key in plot.series_keys(available) if (values := _series(rows, key))}
        if series:
            svgs.append((_event_bars if plot.events else _svg)(plot.title, series, whole_run=whole_run))
    return svgs


# ----------------------------------------------------------------------------- trajectories


def _tokens(ids: Sequence[int], mask: Sequence[int], logprobs: Sequence[float], decode: Decode | None) -> str:
    spans = []
    for i, token in enumerate(ids):
        sampled = bool(mask[i])
        text = decode([token]) if decode is not None else f"{token} "
        tip = f"id {token} · logprob {logprobs[i]:.4f}" if sampled else f"id {token} · observed (masked)"
        spans.append(f'<span class="t {"s" if sampled else "m"}" title="{tip}">{html.escape(text)}</span>')
    return "".join(spans)


def _calls_html(t: Trajectory, turn_index: int) -> str:
    items = []
    for c in t.tool_calls:
        if c.turn != turn_index:
            continue
        error = f' <b class="err">{html.escape(c.error)}</b>' if c.error else ""
        reward = f" · reward {c.reward:g}" if c.reward is not None else ""
        reward += "".join(f" · {html.escape(k)} {v:g}" for k, v in sorted(c.metrics.items()))
        result = c.result if len(c.result) <= 400 else c.result[:400] + "…"
        items.append(f"<li><code>{html.escape(str(c.name))}({html.escape(str(c.arguments))})</code>{error}{reward}"
                     f" → <code>{html.escape(result)}</code></li>")
    return f'<ul class="calls">{"".join(items)}</ul>' if items else ""


def _trajectory_html(t: Trajectory, decode: Decode | None) -> str:
    sampled = sum(t.response_mask)
    head = (f"<h3>{html.escape(t.row_id)} #{t.sample_index} · reward {t.reward:g} · {html.escape(t.finish_reason)}</h3>"
            f'<p class="meta">group {html.escape(t.group_id)} · {html.escape(t.data_source)} · loop {html.escape(t.agent_name)}'
            f" · policy version {t.policy_version} · ground truth {html.escape(str(t.ground_truth))}"
            f" · {len(t.prompt_ids)} prompt tokens, {sampled} sampled and {len(t.response_ids) - sampled} observed response tokens</p>")
    prompt = _tokens(t.prompt_ids, [0] * len(t.prompt_ids), [0.0] * len(t.prompt_ids), decode)
    parts = [f'<details><summary>prompt ({len(t.prompt_ids)} tokens)</summary><div class="turn observed">{prompt}</div></details>']
    position = 0
    for k, turn in enumerate(t.turns):
        if turn.start > position:  # glue between turns (none in practice, but never hidden)
            parts.append(_glue(t, position, turn.start, decode))
        ids = t.response_ids[turn.start : turn.end]
        kind = "sampled" if turn.role == "assistant" else "observed"
        reward = f" · turn reward {turn.reward:g}" if turn.reward is not None else ""
        body = _tokens(ids, t.response_mask[turn.start : turn.end], t.logprobs[turn.start : turn.end], decode)
        parts.append(f'<div class="turn {kind}"><div class="role">{turn.role} · tokens [{turn.start}, {turn.end}){reward}</div>'
                     f'<div class="toks">{body}</div>{_calls_html(t, k)}</div>')
        position = turn.end
    if position < len(t.response_ids):
        parts.append(_glue(t, position, len(t.response_ids), decode))
    if t.reward_info:
        info = ", ".join(f"{html.escape(str(k))}: {html.escape(str(v))}" for k, v in t.reward_info.items())
        parts.append(f'<p class="meta">reward info: {info}</p>')
    return f'<section class="traj">{head}{"".join(parts)}</section>'


def _glue(t: Trajectory, start: int, end: int, decode: Decode | None) -> str:
    body = _tokens(t.response_ids[start:end], t.response_mask[start:end], t.logprobs[start:end], decode)
    return f'<div class="turn observed"><div class="role">template · tokens [{start}, {end})</div><div class="toks">{body}</div></div>'


# ----------------------------------------------------------------------------- the page


HEADLINE = (("held-out success", "heldout_success"), ("held-out tool use", "heldout_tool_use"))


def _share(value: Any) -> str:
    return f"{100 * value:.1f}%" if isinstance(value, (int, float)) else "—"


def _change(before: Any, after: Any) -> str:
    if not (isinstance(before, (int, float)) and isinstance(after, (int, float))):
        return ""
    return f"{100 * (after - before):+.1f} points"


def _duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{seconds:g} s"


def _headline(summary: dict[str, Any]) -> str:
    """What the run came for: held-out success and tool use before and after training (per data
    source when there are several), then the command and its wall time."""
    rows = [(label, summary.get(f"{key}_before"), summary.get(f"{key}_after")) for label, key in HEADLINE
            if f"{key}_before" in summary or f"{key}_after" in summary]
    before_by, after_by = summary.get("heldout_by_source_before") or {}, summary.get("heldout_by_source_after") or {}
    rows += [(f"held-out success · {source}", before_by.get(source), after_by.get(source))
             for source in sorted(set(before_by) | set(after_by))]
    before_by, after_by = summary.get("heldout_by_role_before") or {}, summary.get("heldout_by_role_after") or {}
    rows += [(f"held-out reward · role {role}", before_by.get(role), after_by.get(role)) for role in sorted(set(before_by) | set(after_by))]
    run = []
    if summary.get("command"):
        run.append(f"<code>{html.escape(str(summary['command']))}</code>")
    if isinstance(summary.get("wall_s"), (int, float)):
        run.append(f"wall time {_duration(summary['wall_s'])}")
    run += [f"{html.escape(str(summary[k]))} {label}" for k, label in (("steps", "steps"), ("algorithm", "advantages"))
            if summary.get(k) is not None]
    if not rows and not run:
        return ""
    cells = "".join(f'<tr><th scope="row">{html.escape(label)}</th><td>{_share(before)}</td><td class="after">{_share(after)}</td>'
                    f"<td>{_change(before, after)}</td></tr>" for label, before, after in rows)
    table = (f'<table class="headline"><tr><th></th><th>before training</th><th>after training</th><th>change</th></tr>{cells}</table>'
             if rows else "")
    return f'<section class="result">{table}<p class="run">{" · ".join(run)}</p></section>'


def _stopped(summary: dict[str, Any]) -> str:
    """A run that stopped early (``summary["stopped"]``: a health check, trainer/health.py, or a
    rollout's failures above ``trainer.max_failure_rate``): why, first."""
    stop = summary.get("stopped")
    if not isinstance(stop, dict):
        return ""
    by = f" by {stop['key']}" if stop.get("key") else ""
    return (f'<section class="stopped err"><h2>Stopped after {html.escape(str(stop.get("step")))} steps'
            f'{html.escape(by)}</h2><p>{html.escape(str(stop.get("reason", "")))}</p></section>')


def _filtered(filters: str | None, whole_run: Collection[str]) -> str:
    """A filtered report's banner: which trajectories the page shows, and what is not filtered."""
    if not filters:
        return ""
    rest = (f", except the series marked “{WHOLE_RUN.strip(' ()')}”: the trainer's figures from metrics.jsonl, over every "
            "trajectory of each step" if whole_run else "")
    return (f'<p class="filtered"><b>Filtered: <code>{html.escape(filters)}</code>.</b> The plots and samples are drawn from the '
            f"stored trajectories that pass these filters{rest}.</p>")


STARTUP = "startup/"  # trainer/startup.py: startup/<phase>_s, then startup/total_s


def _startup_table(summary: dict[str, Any]) -> str:
    """Where the start-up went: each phase before the first step by name, in seconds, and the total."""
    phases = [(k[len(STARTUP):].removesuffix("_s").replace("_", " "), v) for k, v in summary.items()
              if k.startswith(STARTUP) and k != f"{STARTUP}total_s" and isinstance(v, (int, float))]
    total = summary.get(f"{STARTUP}total_s")
    if not phases and not isinstance(total, (int, float)):
        return ""
    rows = "".join(f'<tr><th scope="row">{html.escape(name)}</th><td>{seconds:.1f} s</td></tr>' for name, seconds in phases)
    if isinstance(total, (int, float)):
        rows += f'<tr class="total"><th scope="row">total</th><td>{total:.1f} s</td></tr>'
    return f'<h2>Start-up (before the first step)</h2><table class="startup">{rows}</table>'


def _summary_table(summary: dict[str, Any]) -> str:
    cells = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(json.dumps(v) if isinstance(v, (dict, list)) else str(v))}</td></tr>"
                    for k, v in summary.items() if not k.startswith(STARTUP))
    return f'<h2>Run summary (summary.json)</h2><table class="summary">{cells}</table>'


def render_report(
    metrics_rows: Sequence[dict[str, Any]],
    trajectories: Sequence[Trajectory],
    title: str,
    *,
    decode: Decode | None = None,
    summary: dict[str, Any] | None = None,
    filtered: str | None = None,
    whole_run_keys: Collection[str] = (),
) -> str:
    """The report page: the headline from ``summary`` (held-out success and tool use before and
    after, the command and its wall time), the plots over steps, the whole summary, then sample
    trajectories. ``metrics_rows`` are dicts with a ``step`` (as in ``metrics.jsonl``);
    ``decode(ids) -> str`` renders tokens as text (without it, token ids are shown).
    ``filtered`` (the filters, as given: ``--split train --min-reward 0.5``) marks a report of
    some trajectories only: a banner under the title says so, and the series of
    ``whole_run_keys`` (the trainer's figures, which no filter reaches) are labelled as the whole run's."""
    plots = _plots(metrics_rows, whole_run_keys)
    headline = _headline(summary or {})
    summary_html = _startup_table(summary) + _summary_table(summary) if summary else ""
    plots_html = "".join(f'<div class="plotbox">{svg}</div>' for svg in plots) or "<p>No metrics over steps.</p>"
    samples = "".join(_trajectory_html(t, decode) for t in trajectories) or "<p>No trajectories.</p>"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 24px; color: #222; }}
.plots {{ display: grid; grid-template-columns: repeat(auto-fill, minmax({PLOT_MIN_PX}px, 1fr)); gap: 12px; }}
.plotbox {{ border: 1px solid #ddd; padding: 4px; }} svg.plot {{ display: block; width: 100%; height: auto; }}
.startup th {{ text-align: left; font-weight: normal; padding: 2px 14px 2px 0; }} .startup td {{ text-align: right; }}
.startup tr.total th, .startup tr.total td {{ font-weight: bold; border-top: 1px solid #999; }}
.traj {{ border-top: 2px solid #ccc; margin-top: 18px; }} .meta {{ color: #555; font-size: 13px; }}
.turn {{ border-left: 4px solid #1f77b4; padding: 2px 8px; margin: 6px 0; }} .turn.observed {{ border-color: #999; }}
.role {{ font-size: 12px; font-weight: bold; color: #444; }} .toks {{ font-family: monospace; white-space: pre-wrap; }}
.t.s {{ background: #fff; }} .t.m {{ background: #e2e2e2; color: #555; }} .t:hover {{ outline: 1px solid #d62728; }}
.err {{ color: #d62728; }} .calls {{ font-size: 13px; margin: 2px 0; }} .summary td {{ padding: 2px 10px; border-bottom: 1px solid #ddd; }}
.legend span {{ padding: 0 6px; border: 1px solid #ccc; }}
.headline {{ border-collapse: collapse; font-size: 16px; }} .headline th, .headline td {{ padding: 4px 14px; text-align: right; border-bottom: 1px solid #ddd; }}
.filtered {{ background: #fff3cd; border: 2px solid #e0a800; padding: 8px 12px; font-size: 16px; }}
.headline th[scope=row] {{ text-align: left; }} .headline td.after {{ font-weight: bold; }} .run {{ color: #444; }}
</style></head><body>
<h1>{html.escape(title)}</h1>{_filtered(filtered, whole_run_keys)}{_stopped(summary or {})}{headline}
<h2>Over steps{" · filtered" if filtered else ""}</h2><div class="plots">{plots_html}</div>
{summary_html}
<h2>Sample trajectories</h2>
<p class="legend"><span class="t s">sampled (trained on)</span> <span class="t m">observed (masked: prompt, tool results, user turns, template)</span>
 hover a token for its id and logprob</p>
{samples}
</body></html>
"""
