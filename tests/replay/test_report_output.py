"""``agentrl replay report RUN`` without ``--output`` writes the run directory's report.html."""

from __future__ import annotations

import shutil

from agentrl.replay.cli import cli_main


def test_report_writes_the_run_directorys_report_html_by_default(scripted_store, tmp_path, capsys):
    run = scripted_store.root.parent  # the store is <run>/rollouts
    for given in (run, scripted_store.root):  # the run directory or its rollouts/
        assert cli_main(["report", str(given), "--samples", "0"]) == 0
        assert capsys.readouterr().out.strip() == f"report: {run / 'report.html'}"
    assert "<svg" in (run / "report.html").read_text()
    # a store outside a run directory (rescore's output): the report goes in its own folder
    rescored = shutil.copytree(scripted_store.root, tmp_path / "rescored")
    assert cli_main(["report", str(rescored), "--samples", "0"]) == 0
    assert capsys.readouterr().out.strip() == f"report: {rescored / 'report.html'}"
