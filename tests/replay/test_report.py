"""The HTML report: inline-SVG plots over steps and trajectories token by token."""

from __future__ import annotations

import json
import re

from agentrl.replay.cli import cli_main
from agentrl.report import render_report


def metric_rows():
    return [{"step": s, "reward/mean": s / 4, "val/reward/mean": 0.5, "success_rate": s / 8, "turns/mean": 2.0,
             "tool_calls/mean": 1.0, "tool_errors/bad_json": 3 - s, "tool_errors/timeout": 1.0, "response_length/mean": 40.0,
             "finish/stop": 0.75, "finish/length": 0.25, "actor/pg_loss": 0.1, "tool/python/calls": 2.0,
             "tool/python/exit_code": 0.5, "tool_use_rate": s / 3, "val/retry/second_attempt_success": 0.25 * s}
            for s in range(4)]


def test_report_plots_every_metric_family_over_steps_without_network_resources(scripted_store):
    trajectories = list(scripted_store.iter_trajectories(limit=2))
    page = render_report(metric_rows(), trajectories, "run <x>")
    titles = re.findall(r'<svg class="plot"[^>]*aria-label="([^"]*)"', page)
    assert titles == ["reward (mean)", "success rate", "assistant turns per trajectory", "tool calls per trajectory",
                      "tool-use rate (share of trajectories with a call)",
                      "success after a first answer judged wrong (interaction tasks)", "tool errors by kind (per step)", "per tool: calls and mean ToolResult.metrics (per step)",
                      "response length (tokens)", "finish reasons (fraction)"]
    keys = re.findall(r'<polyline class="series" data-key="([^"]*)"', page)
    assert {"reward/mean", "val/reward/mean", "finish/stop", "finish/length",
            "tool/python/calls", "tool/python/exit_code", "tool_use_rate", "val/retry/second_attempt_success"} <= set(keys)
    # counts of events are bars, none where the count is 0 (bad_json: 3, 2, 1, 0), never a line joining the steps
    assert not {"tool_errors/bad_json", "tool_errors/timeout"} & set(keys)
    bars = re.findall(r'<rect class="bar" data-key="(tool_errors/[^"]*)"[^>]*><title>step (\d) · [^:]*: ([^<]*)</title>', page)
    assert bars == [("tool_errors/bad_json", "0", "3"), ("tool_errors/bad_json", "1", "2"), ("tool_errors/bad_json", "2", "1")] + [
        ("tool_errors/timeout", str(s), "1") for s in range(4)]
    # reward/mean rises from the bottom left to the top right of its plot (y grows downwards in SVG)
    points = re.search(r'data-key="reward/mean"[^>]*points="([^"]*)"', page)[1].split()
    ys = [float(p.split(",")[1]) for p in points]
    assert len(ys) == 4 and ys == sorted(ys, reverse=True)
    assert "<title>run &lt;x&gt;</title>" in page
    assert not re.search(r"(src|href)=\"?(https?:)?//", page) and "<script" not in page


def test_report_shows_each_token_as_sampled_or_masked_turn_by_turn(scripted_store, tiny_tokenizer):
    [t] = scripted_store.iter_trajectories(limit=1)
    page = render_report([], [t], "r", decode=tiny_tokenizer.decode)
    section = page[page.index('<section class="traj">'):]
    assert section.count('class="t s"') == sum(t.response_mask)
    assert section.count('class="t m"') == len(t.prompt_ids) + len(t.response_mask) - sum(t.response_mask)
    roles = re.findall(r'<div class="role">(\w+) · tokens \[(\d+), (\d+)\)', section)
    assert roles == [(x.role, str(x.start), str(x.end)) for x in t.turns] + [("template", str(t.turns[-1].end), str(len(t.response_ids)))]
    assert f'title="id {t.response_ids[0]} · logprob -0.5000"' in section
    assert "&lt;tool_call&gt;" in section and "<tool_call>" not in section  # model text is escaped
    assert "<code>calculator({&#x27;expression&#x27;: &#x27;12 * 34&#x27;})</code> → <code>408</code>" in section
    assert f"{t.row_id} #0 · reward 1 · stop" in section


def test_report_command_plots_the_stored_steps_and_the_runs_metrics(scripted_store, tmp_path, capsys):
    (scripted_store.root.parent / "metrics.jsonl").write_text('{"step": 1, "actor/pg_loss": 0.5, "logprob_mismatch/mean": 0.001}\n')
    out = tmp_path / "report.html"
    assert cli_main(["report", str(scripted_store.root.parent), "--output", str(out), "--samples", "2"]) == 0
    assert capsys.readouterr().out.strip() == f"report: {out}"
    page = out.read_text()
    keys = set(re.findall(r'data-key="([^"]*)"', page))
    assert {"reward/mean", "val/reward/mean", "finish/stop", "finish/interaction_done", "logprob_mismatch/mean"} <= keys
    # samples come from the last stored step (the validation step 2 of one row)
    assert page.count('<section class="traj">') == 1 and "r0 #0" in page


def test_a_filtered_report_says_so_and_draws_only_the_trainers_own_metrics_from_metrics_jsonl(scripted_store, tmp_path):
    logged = [{"step": s, "reward/mean": 0.123, "val/reward/mean": 0.777, "tool_use_rate": 0.321, "actor/pg_loss": 0.5,
               "logprob_mismatch/mean": 0.001 * (s + 1)} for s in range(3)]
    (scripted_store.root.parent / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in logged))
    out = tmp_path / "report.html"
    assert cli_main(["report", str(scripted_store.root.parent), "--output", str(out), "--split", "train", "--min-reward", "1"]) == 0
    page = out.read_text()
    body = page[page.index("<body>"):]
    assert body.index("<h1>") < body.index('<p class="filtered"><b>Filtered: <code>--split train --min-reward 1</code>.</b>') \
        < body.index("<h2>Over steps · filtered</h2>")
    assert "except the series marked “whole run, unfiltered”: the trainer's figures from metrics.jsonl" in body
    # the curves over trajectories are the filtered ones': every trained trajectory kept has reward 1
    assert set(re.findall(r"<title>reward/mean step (\d+): ([^<]*)</title>", page)) == {("0", "1"), ("1", "1")}
    assert "0.123" not in page and "0.321" not in page and "val/" not in page
    legend = re.findall(r'<g class="legend-entry">.*?<text[^>]*>([^<]*)</text></g>', page)
    assert "logprob_mismatch/mean (whole run, unfiltered)" in legend and "reward/mean" in legend
    # unfiltered, the same run's report has no banner and marks nothing
    assert cli_main(["report", str(scripted_store.root.parent), "--output", str(out)]) == 0
    assert 'class="filtered"' not in out.read_text() and "unfiltered" not in out.read_text()


def test_report_shows_each_calls_tool_metrics(scripted_store):
    [t] = scripted_store.iter_trajectories(limit=1)
    assert t.tool_calls, "the scripted store's first trajectory makes a tool call"
    t.tool_calls[0].metrics = {"wall_s": 0.25, "exit_code": 0.0}
    page = render_report([], [t], "r")
    assert " · exit_code 0 · wall_s 0.25 → " in page


def test_the_headline_comes_first_with_held_out_success_and_tool_use_before_and_after_and_the_raw_summary_after_the_plots():
    summary = {"algorithm": "grpo", "run_dir": "runs/x", "command": "agentrl train data=arith_retry", "heldout_success_before": 0.125,
               "heldout_tool_use_before": 0.0, "startup/imports_and_config_s": 2.96, "startup/tokenizer_s": 0.4,
               "startup/total_s": 3.36, "heldout_success_after": 0.6875, "heldout_tool_use_after": None,
               "heldout_by_source_before": {"agentrl/arith": 0.25}, "heldout_by_source_after": {"agentrl/arith": 0.75},
               "steps": 20, "wall_s": 187.3}
    page = render_report(metric_rows(), [], "run", summary=summary)
    body = page[page.index("<body>"):]
    assert body.index("<h1>run</h1>") < body.index('<section class="result">') < body.index("<h2>Over steps</h2>") \
        < body.index("<h2>Run summary (summary.json)</h2>") < body.index("<h2>Sample trajectories</h2>")
    rows = re.findall(r'<tr><th scope="row">([^<]*)</th><td>([^<]*)</td><td class="after">([^<]*)</td><td>([^<]*)</td></tr>', body)
    assert rows == [("held-out success", "12.5%", "68.8%", "+56.2 points"), ("held-out tool use", "0.0%", "—", ""),
                    ("held-out success · agentrl/arith", "25.0%", "75.0%", "+50.0 points")]
    assert '<p class="run"><code>agentrl train data=arith_retry</code> · wall time 3 min 7 s · 20 steps · grpo advantages</p>' in body
    raw = body[body.index("<h2>Run summary"):]
    assert '<td>{&quot;agentrl/arith&quot;: 0.25}</td>' in raw and "startup/" not in body
    # the start-up phases by name, in seconds, before the raw summary
    startup = body[body.index("<h2>Start-up (before the first step)</h2>"):body.index("<h2>Run summary")]
    assert re.findall(r'<tr[^>]*><th scope="row">([^<]*)</th><td>([^<]*)</td></tr>', startup) == [
        ("imports and config", "3.0 s"), ("tokenizer", "0.4 s"), ("total", "3.4 s")]
    # a report without a run's summary (agentrl replay report) has no headline
    assert 'class="result"' not in render_report(metric_rows(), [], "run")


def test_plots_label_the_x_axis_along_its_length_and_keep_the_legend_below_the_axes():
    rows = [{"step": s, "reward/mean": s / 20, "val/reward/mean": 0.5} for s in range(1, 21)]
    page = render_report(rows, [], "r")
    svg = page[page.index('aria-label="reward (mean)"'):]
    svg = svg[:svg.index("</svg>")]
    assert re.findall(r'<text class="tick x"[^>]*>([^<]*)</text>', svg) == ["0", "5", "10", "15", "20"]
    assert re.findall(r'<text class="tick y"[^>]*>([^<]*)</text>', svg) == ["0", "0.2", "0.4", "0.6", "0.8", "1"]
    area = re.search(r'<rect class="area" x="([\d.]+)" y="([\d.]+)" width="([\d.]+)" height="([\d.]+)"', svg)
    bottom = float(area[2]) + float(area[4])
    legend = re.findall(r'<g class="legend-entry">.*?<text x="[\d.]+" y="([\d.]+)"[^>]*>([^<]*)</text></g>', svg)
    assert [name for _, name in legend] == ["reward/mean", "val/reward/mean"]
    assert all(float(y) > bottom + 20 for y, _ in legend)  # below the tick labels and the axis label
    ys = [float(p.split(",")[1]) for p in re.search(r'data-key="reward/mean"[^>]*points="([^"]*)"', svg)[1].split()]
    assert max(ys) <= bottom and min(ys) >= float(area[2])


def async_rows():
    """Three steps of an asynchronous run at eta = 1: 8 trained trajectories a step."""
    hist = [(8, 0), (5, 3), (2, 6)]
    return [{"step": s + 1, "reward/mean": 0.5, "async/staleness_hist/0": float(h0), "async/staleness_hist/1": float(h1),
             "async/staleness_mean": h1 / 8, "async/staleness_max": float(h1 > 0), "async/trainer_idle_fraction": 0.1 * s,
             "engine/busy_fraction": 0.9 - 0.1 * s, "timing/weight_sync_s": 0.01, "async/dropped_groups": float(s == 2),
             "async/in_flight_groups": 4.0, "engine/interrupted_requests": 2.0 * s, "engine/resumed_requests": 2.0 * s}
            for s, (h0, h1) in enumerate(hist)]


def test_an_async_runs_report_stacks_each_steps_staleness_histogram_and_plots_its_async_metrics():
    page = render_report(async_rows(), [], "async")
    titles = re.findall(r'<svg class="plot"[^>]*aria-label="([^"]*)"', page)
    assert titles == ["reward (mean)", "staleness histogram per step (trajectories)",
                      "staleness of the trained samples (policy versions)", "time shares of the step: trainer idle, engine busy",
                      "weight sync (s)", "groups dropped as stale and in flight (per step)",
                      "partial rollouts: requests interrupted and resumed (per step)"]
    keys = set(re.findall(r'<polyline class="series" data-key="([^"]*)"', page))
    assert {"async/staleness_mean", "async/staleness_max", "async/trainer_idle_fraction", "engine/busy_fraction",
            "timing/weight_sync_s"} <= keys
    # counts per step are bars side by side: one group dropped at step 3 alone, 4 in flight at each step
    events = set(re.findall(r'<rect class="bar" data-key="((?:async/(?:dropped|in_flight)_groups|engine/\w+_requests))"[^>]*>'
                            r'<title>step (\d) · [^:]*: ([^<]*)</title>', page))
    assert {(k, s, v) for k, s, v in events if k == "async/dropped_groups"} == {("async/dropped_groups", "3", "1")}
    assert {(s, v) for k, s, v in events if k == "async/in_flight_groups"} == {("1", "4"), ("2", "4"), ("3", "4")}
    assert {(s, v) for k, s, v in events if k == "engine/interrupted_requests"} == {("2", "2"), ("3", "4")}
    assert not keys & {k for k, _, _ in events}
    svg = page[page.index('aria-label="staleness histogram per step'):]
    svg = svg[:svg.index("</svg>")]
    area = [float(v) for v in re.search(r'<rect class="area" x="([\d.]+)" y="([\d.]+)" width="([\d.]+)" height="([\d.]+)"', svg).groups()]
    bottom = area[1] + area[3]
    bars = re.findall(r'<rect class="bar" data-key="async/staleness_hist/(\d)" x="([\d.]+)" y="([\d.]+)" width="([\d.]+)" '
                      r'height="([\d.]+)"[^>]*><title>step (\d) · staleness \d[^:]*: (\d+)</title>', svg)
    assert [(k, step, count) for k, _, _, _, _, step, count in bars] == [
        ("0", "1", "8"), ("1", "1", "0"), ("0", "2", "5"), ("1", "2", "3"), ("0", "3", "2"), ("1", "3", "6")]
    assert re.findall(r'<text class="tick y"[^>]*>([^<]*)</text>', svg) == ["0", "2", "4", "6", "8"]
    assert re.findall(r'<text class="tick x"[^>]*>([^<]*)</text>', svg) == ["1", "2", "3"]
    unit = area[3] / 8  # the y axis runs 0..8 trajectories
    for i in range(0, len(bars), 2):  # staleness 0 stands on the axis, staleness 1 on top of it
        (_, x0, y0, w0, h0, _, c0), (_, x1, y1, w1, h1, _, c1) = bars[i], bars[i + 1]
        assert abs(float(h0) - int(c0) * unit) < 0.1 and abs(float(h1) - int(c1) * unit) < 0.1
        assert abs(float(y0) + float(h0) - bottom) < 0.1 and abs(float(y1) + float(h1) - float(y0)) < 0.1
        assert x0 == x1 and w0 == w1 and area[0] < float(x0) and float(x0) + float(w0) < area[0] + area[2]
    legend = re.findall(r'<g class="legend-entry">.*?<text x="[\d.]+" y="([\d.]+)"[^>]*>([^<]*)</text></g>', svg)
    assert [name for _, name in legend] == ["staleness 0 (on-policy)", "staleness 1"]
    assert all(float(y) > bottom + 20 for y, _ in legend)
    # a synchronous run's metrics have none of it
    assert "staleness" not in render_report(metric_rows(), [], "sync")


def test_a_step_logged_again_after_a_resume_is_drawn_once_with_its_later_values():
    """A run killed after logging step 2 but before its checkpoint logs step 2 again when resumed
    from step 1: the plot and the histogram show the resumed run's step 2."""
    first, again = async_rows()[:2], async_rows()[1:]
    again[0] = {**again[0], "reward/mean": 0.75, "async/staleness_hist/0": 4.0, "async/staleness_hist/1": 4.0}
    page = render_report(first + again, [], "resumed")
    points = re.search(r'data-key="reward/mean"[^>]*points="([^"]*)"', page)[1].split()
    assert len(points) == 3  # steps 1, 2, 3
    assert re.findall(r"<title>step 2 · staleness \d[^:]*: (\d+)</title>", page) == ["4", "4"]


def test_the_trainers_later_record_of_a_step_wins_and_the_stores_figures_stay():
    """A run resumed before resume set the killed run's rows aside has step 2 twice in
    metrics.jsonl, the killed run's first: the report takes the resumed run's."""
    from agentrl.replay.cli import join_run_metrics

    store_rows = [{"step": 1, "reward/mean": 0.25}, {"step": 2, "reward/mean": 0.75}]
    logged = [{"step": 1, "actor/pg_loss": 0.1}, {"step": 2, "actor/pg_loss": 4.0, "critic/vf_loss": 9.0},
              {"step": 2, "actor/pg_loss": -4.0, "reward/mean": 0.0}, {"step": 3, "actor/pg_loss": 0.3}]
    assert join_run_metrics(store_rows, logged) == [
        {"step": 1, "reward/mean": 0.25, "actor/pg_loss": 0.1},
        {"step": 2, "reward/mean": 0.75, "actor/pg_loss": -4.0, "critic/vf_loss": 9.0},
        {"step": 3, "actor/pg_loss": 0.3},
    ]
    assert store_rows[1] == {"step": 2, "reward/mean": 0.75}  # the caller's rows are not changed
