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
out.textContent = JSON.stringify({errors: window.__errors, plots, first: first.className,
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
           "heldout_success_before": 0.125, "heldout_tool_use_before": 0.0, "startup/tokenizer_s": 0.4,
           "heldout_success_after": 0.6875, "heldout_tool_use_after": 0.9375, "steps": 20, "restarts": 0, "wall_s": 187.3}


def open_in_chromium(page: str, tmp_path) -> tuple[dict, str]:
    probed = page.replace("<head>", "<head>" + ERRORS, 1).replace("</body>", PROBE + "</body>", 1)
    path = tmp_path / "report.html"
    path.write_text(probed)
    done = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", path.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.search(r'<pre id="probe">(.*?)</pre>', done.stdout, re.S)
    assert found, f"the probe did not run; Chromium said:\n{done.stderr[-3000:]}"
    return json.loads(html.unescape(found[1])), done.stderr


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
    for plot in probe["plots"]:
        area = plot["area"]
        assert area[2] - area[0] > 300 and area[3] - area[1] > 100, plot["title"]
        for key, length, line in plot["lines"]:  # drawn, inside the axes
            assert length > 100, (plot["title"], key)
            assert area[0] - 1 <= line[0] and line[2] <= area[2] + 1 and area[1] - 1 <= line[1] and line[3] <= area[3] + 1, key
        # one legend entry per line, none over the plotting area
        assert [text for text, _ in plot["legend"]] == [key for key, _, _ in plot["lines"]]
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
    probe, _ = open_in_chromium(render_report(rows, [], "async"), tmp_path)
    assert probe["errors"] == []
    [histogram] = [p for p in probe["plots"] if p["bars"]]
    assert histogram["title"] == "staleness histogram per step (trajectories)"
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
