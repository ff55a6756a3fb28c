"""The report as a person sees it: the page opened in a real headless Chromium, its layout measured.

A copy of the page gets two probes: an error listener at the top of ``<head>`` (script errors and
resources that fail to load) and, at the end of ``<body>``, a script that measures what the
browser drew (each plot's lines, its tick labels, its legend, the headline's place) and writes it
into the DOM, which ``--dump-dom`` prints. The report itself has no script.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess

import pytest

from agentrl.report import render_report

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--enable-logging=stderr", "--v=0")

ERRORS = """<script>window.__errors = [];
addEventListener("error", e => __errors.push(e.message || ("failed to load " + (e.target.src || e.target.href))), true);
</script>"""

PROBE = """<script>
const box = e => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
const plots = [...document.querySelectorAll("svg.plot")].map(svg => ({
  title: svg.getAttribute("aria-label"),
  scale: svg.getBoundingClientRect().width / svg.viewBox.baseVal.width,  // rendered pixels per SVG unit
  tickFont: Math.min(...[...svg.querySelectorAll("text.tick")].map(t => parseFloat(t.getAttribute("font-size")))),
  frame: box(svg), heading: box(svg.querySelector("text")),
  area: box(svg.querySelector("rect.area")),
  lines: [...svg.querySelectorAll("polyline.series")].map(p => [p.dataset.key, p.getTotalLength(), box(p)]),
  bars: [...svg.querySelectorAll("rect.bar")].map(r => [r.dataset.key, box(r)]),
  legend: [...svg.querySelectorAll(".legend-entry")].map(g => [g.textContent, box(g)]),
  xticks: [...svg.querySelectorAll("text.tick.x")].map(t => [t.textContent, box(t)]),
  yticks: [...svg.querySelectorAll("text.tick.y")].map(t => [t.textContent, box(t)]),
}));
const first = document.querySelector("h1").nextElementSibling;
const out = document.createElement("pre");
out.id = "probe";
out.textContent = JSON.stringify({errors: window.__errors, plots, first: first.className, firstBox: box(first),
                                  grid: box(document.querySelector(".plots")), window: innerWidth,
                                  startup: [...document.querySelectorAll("table.startup tr")].map(r => r.innerText),
                                  headline: [...document.querySelectorAll("table.headline tr")].map(r => r.innerText)});
document.body.appendChild(out);
</script>"""


def metric_rows():
    rows = []
    for step in range(21):
        row = {"step": step, "reward/mean": step / 20, "success_rate": step / 25, "tool_use_rate": min(1.0, step / 15),
               "finish/stop": 0.8, "finish/length": 0.15, "finish/tool_error": 0.05, "tool_errors/bad_json": max(0.0, 3 - step / 5)}
        if step % 5 == 0:
            row.update({"val/reward/mean": step / 25, "val/success_rate": step / 25, "val/tool_use_rate": step / 20})
        rows.append(row)
    return rows


SUMMARY = {"algorithm": "grpo", "run_dir": "runs/x", "command": "agentrl train trainer.total_steps=20",
           "heldout_success_before": 0.125, "heldout_tool_use_before": 0.0, "startup/tokenizer_s": 0.4, "startup/model_load_s": 1.3,
           "startup/total_s": 1.7,
           "heldout_success_after": 0.6875, "heldout_tool_use_after": 0.9375, "steps": 20, "restarts": 0, "wall_s": 187.3}


def open_in_chromium(page: str, tmp_path) -> tuple[dict, str]:
    probed = page.replace("<head>", "<head>" + ERRORS, 1).replace("</body>", PROBE + "</body>", 1)
    path = tmp_path / "report.html"
    path.write_text(probed)
    done = subprocess.run([CHROMIUM, *FLAGS, f"--window-size={WINDOW[0]},{WINDOW[1]}", f"--user-data-dir={tmp_path / 'profile'}",
                           "--dump-dom", path.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.search(r'<pre id="probe">(.*?)</pre>', done.stdout, re.S)
    assert found, f"the probe did not run; Chromium said:\n{done.stderr[-3000:]}"
    return json.loads(html.unescape(found[1])), done.stderr


WINDOW = (1920, 1080)  # a wide window: the plots must fill its width


def fills_the_width_readably(probe: dict) -> None:
    """The plots fill the page's width, a row at a time, and no text of theirs is drawn under 12 px."""
    grid = probe["grid"]
    assert grid[2] - grid[0] > 0.9 * probe["window"]
    rows: dict[float, list] = {}
    for plot in probe["plots"]:
        rows.setdefault(round(plot["frame"][1]), []).append(plot["frame"])
    full = [frames for frames in rows.values() if len(frames) == len(next(iter(rows.values())))]
    for frames in full:  # every full row spans the grid, within the boxes' padding
        assert min(f[0] for f in frames) - grid[0] < 12 and grid[2] - max(f[2] for f in frames) < 12, frames
    assert len(next(iter(rows.values()))) >= 2  # a wide window gets several columns
    for plot in probe["plots"]:
        assert plot["scale"] >= 1 and plot["tickFont"] * plot["scale"] >= 12, (plot["title"], plot["scale"])


def overlaps(a, b) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian: apt-get install -y chromium)")
def test_the_report_opens_in_chromium_without_errors_headline_first_and_its_plots_drawn_readably(scripted_store, tmp_path):
    page = render_report(metric_rows(), list(scripted_store.iter_trajectories(limit=2)), "run", summary=SUMMARY)
    probe, log = open_in_chromium(page, tmp_path)

    assert probe["errors"] == []
    assert not [line for line in log.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    # the result the run was for comes first: held-out success and tool use, before and after
    assert probe["first"] == "result"
    assert probe["headline"][1:] == ["held-out success\t12.5%\t68.8%\t+56.2 points",
                                     "held-out tool use\t0.0%\t93.8%\t+93.8 points"]
    assert [p["title"] for p in probe["plots"]] == ["reward (mean)", "success rate", "tool-use rate (share of trajectories with a call)",
                                                     "tool errors by kind (per step)", "finish reasons (fraction)"]
    fills_the_width_readably(probe)
    assert probe["startup"] == ["tokenizer\t0.4 s", "model load\t1.3 s", "total\t1.7 s"]
    # tool errors are events: a bar at each step with errors (bad_json: steps 0-14), no line joining them
    [errors] = [p for p in probe["plots"] if p["title"] == "tool errors by kind (per step)"]
    assert errors["lines"] == [] and len(errors["bars"]) == 15 and {key for key, _ in errors["bars"]} == {"tool_errors/bad_json"}
    assert all(errors["area"][0] < bar[0] and bar[2] < errors["area"][2] and bar[3] <= errors["area"][3] + 1 for _, bar in errors["bars"])
    for plot in probe["plots"]:
        area = plot["area"]
        assert area[2] - area[0] > 300 and area[3] - area[1] > 100, plot["title"]
        for key, length, line in plot["lines"]:  # drawn, inside the axes
            assert length > 100, (plot["title"], key)
            assert area[0] - 1 <= line[0] and line[2] <= area[2] + 1 and area[1] - 1 <= line[1] and line[3] <= area[3] + 1, key
        # one legend entry per line (or per key of bars), none over the plotting area
        keys = [key for key, _, _ in plot["lines"]] or list(dict.fromkeys(key for key, _ in plot["bars"]))
        assert [text for text, _ in plot["legend"]] == keys
        assert not [text for text, legend in plot["legend"] if overlaps(legend, area)], plot["title"]
        # the x axis labelled along its length, left to right, below the axis, labels apart
        labels = [float(text) for text, _ in plot["xticks"]]
        assert labels == [0, 5, 10, 15, 20], plot["title"]
        boxes = [b for _, b in plot["xticks"]]
        assert all(b[1] >= area[3] for b in boxes)
        assert all(left[2] < right[0] for left, right in zip(boxes, boxes[1:]))
        assert len(plot["yticks"]) >= 3 and all(b[2] <= area[0] for _, b in plot["yticks"])


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian: apt-get install -y chromium)")
def test_an_async_runs_staleness_histogram_draws_its_bars_inside_the_axes_with_the_legend_below(tmp_path):
    rows = [{"step": s, "reward/mean": 0.5, "async/staleness_hist/0": float(8 - s % 5), "async/staleness_hist/1": float(s % 5),
             "async/staleness_mean": (s % 5) / 8, "async/staleness_max": float(s % 5 > 0), "async/trainer_idle_fraction": 0.2,
             "engine/busy_fraction": 0.7, "timing/weight_sync_s": 0.01, "async/dropped_groups": 0.0, "async/in_flight_groups": 4.0,
             "engine/interrupted_requests": 1.0, "engine/resumed_requests": 1.0} for s in range(1, 21)]
    page = render_report(rows, [], "async", filtered="--split train", whole_run_keys={"async/staleness_mean", "async/staleness_max"})
    probe, _ = open_in_chromium(page, tmp_path)
    assert probe["errors"] == []
    # a filtered report says so first, in view at the top of the page
    assert probe["first"] == "filtered" and probe["firstBox"][3] < 200
    fills_the_width_readably(probe)
    [histogram] = [p for p in probe["plots"] if p["title"] == "staleness histogram per step (trajectories)"]
    area = histogram["area"]
    assert len(histogram["bars"]) == 40 and {key for key, _ in histogram["bars"]} == {"async/staleness_hist/0", "async/staleness_hist/1"}
    for key, bar in histogram["bars"]:
        assert area[0] < bar[0] and bar[2] < area[2] and area[1] - 1 <= bar[1] and bar[3] <= area[3] + 1, key
    # one column a step: the bars of a step share their left edge, the columns stand apart
    lefts = sorted({round(bar[0], 1) for _, bar in histogram["bars"]})
    width = histogram["bars"][0][1][2] - histogram["bars"][0][1][0]
    assert len(lefts) == 20 and width > 4 and all(b - a > width for a, b in zip(lefts, lefts[1:]))
    assert [text for text, _ in histogram["legend"]] == ["staleness 0 (on-policy)", "staleness 1"]
    assert all(p["heading"][2] <= p["frame"][2] for p in probe["plots"]), [p["title"] for p in probe["plots"]]  # titles whole
    assert not [text for text, legend in histogram["legend"] if overlaps(legend, area)]
    assert [text for text, _ in histogram["xticks"]] == ["5", "10", "15", "20"]
    for plot in probe["plots"]:  # the async line plots: drawn inside their axes, legend below
        box = plot["area"]
        for key, length, line in plot["lines"]:
            assert length > 100, (plot["title"], key)
            assert box[0] - 1 <= line[0] and line[2] <= box[2] + 1 and box[1] - 1 <= line[1] and line[3] <= box[3] + 1, key
        assert not [text for text, legend in plot["legend"] if overlaps(legend, plot["area"])], plot["title"]
