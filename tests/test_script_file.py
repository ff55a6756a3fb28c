"""engine=scripted from the command line: the script file format, its errors, and a real rollout."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from agentrl.agent.script_file import load_script, require_script_rows
from agentrl.errors import ConfigError


def _write(tmp_path, text):
    path = tmp_path / "script.jsonl"
    path.write_text(text)
    return path


def test_script_file_reads_text_and_token_answers_skipping_blanks_and_comments(tmp_path):
    path = _write(tmp_path, '# smoke test\n{"row": "a:0", "answers": ["#### 4", [5, 6]]}\n\n{"row": "a:1", "answers": ["x"]}\n')
    assert load_script(path) == {"a:0": ["#### 4", [5, 6]], "a:1": ["x"]}


@pytest.mark.parametrize("line, message", [
    ('{"row": "a:0", "answers": ["x"]', r"script.jsonl:2: not JSON \(Expecting ',' delimiter at column 32\)"),
    ('{"row": "a:0"}', r"script.jsonl:2: a line is an object with exactly the keys row and answers, got \['row'\]"),
    ('["a:0"]', r"script.jsonl:2: a line is an object with exactly the keys row and answers, got list"),
    ('{"row": 3, "answers": ["x"]}', r"script.jsonl:2: row must be a non-empty string \(a row id\), got 3"),
    ('{"row": "a:0", "answers": []}', r"script.jsonl:2: answers must be a non-empty list, got \[\]"),
    ('{"row": "a:0", "answers": ["x", [1, -2]]}', r"script.jsonl:2: answers\[1\] must be text or a list of token ids, got \[1, -2\]"),
    ('{"row": "a:1", "answers": ["x"]}', r"script.jsonl:2: row 'a:1' is scripted twice"),
])
def test_a_bad_line_is_refused_naming_file_and_line(tmp_path, line, message):
    path = _write(tmp_path, '{"row": "a:1", "answers": ["y"]}\n' + line + "\n")
    with pytest.raises(ConfigError, match=message) as info:
        load_script(path)
    assert info.value.problems[0][0] == "engine.script"


def test_missing_file_empty_file_and_unscripted_rows_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"nope.jsonl: cannot read the script file"):
        load_script(tmp_path / "nope.jsonl")
    with pytest.raises(ConfigError, match=r"script.jsonl: the script has no lines"):
        load_script(_write(tmp_path, "# nothing\n"))
    with pytest.raises(ConfigError, match=r"s.jsonl: no line for the dataset rows 'b:0', 'b:2'"):
        require_script_rows({"b:1": ["x"]}, ["b:0", "b:1", "b:2"], "s.jsonl")


def _rollout(tmp_path, *overrides):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "rollout", "data.task_train_size=2", "rollout.n=2", "logging.progress=false",
         f"trainer.runs_root={tmp_path / 'runs'}", "trainer.run_name=scripted", *overrides],
        env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )


def test_rollout_engine_scripted_answers_from_the_script_file_without_a_model(tmp_path, tiny_tokenizer):
    from agentrl.data.rollout_store import RolloutStore

    _write(tmp_path, '{"row": "agentrl/arith:0", "answers": ["#### 4"]}\n{"row": "agentrl/arith:1", "answers": [[7, 8, 9]]}\n')
    done = _rollout(tmp_path, "engine=scripted", "engine.script=script.jsonl")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout[: done.stdout.rindex("}") + 1])
    assert summary["trajectories"] == 4 and summary["finish_reasons"] == {"stop": 2, "length": 2}
    trajectories = list(RolloutStore(tmp_path / "runs" / "scripted" / "rollouts").iter_trajectories())
    end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    by_row = {t.row_id: t for t in trajectories}
    newline = tiny_tokenizer.encode("\n", add_special_tokens=False)
    # the scripted text, the end-of-turn token the engine appends, then the template's line break (not sampled)
    scripted = tiny_tokenizer.encode("#### 4", add_special_tokens=False) + [end]
    assert by_row["agentrl/arith:0"].response_ids == scripted + newline
    assert by_row["agentrl/arith:0"].response_mask == [1] * len(scripted) + [0] * len(newline)
    assert by_row["agentrl/arith:0"].logprobs[: len(scripted)] == [-0.5] * len(scripted)
    assert by_row["agentrl/arith:1"].response_ids[:3] == [7, 8, 9]
    assert by_row["agentrl/arith:1"].response_mask[:3] == [1, 1, 1]


def test_rollout_engine_scripted_refuses_a_bad_script_before_any_trajectory(tmp_path):
    _write(tmp_path, '{"row": "agentrl/arith:0", "answers": ["#### 4"]}\n{"row": oops}\n')
    done = _rollout(tmp_path, "engine=scripted", "engine.script=script.jsonl")
    assert done.returncode != 0
    assert "engine.script: script.jsonl:2: not JSON" in done.stderr
    assert not (tmp_path / "runs" / "scripted" / "rollouts").exists() or not any((tmp_path / "runs" / "scripted" / "rollouts").iterdir())
    missing = _rollout(tmp_path, "engine=scripted")
    assert missing.returncode != 0 and "engine.script: engine=scripted needs a script file" in missing.stderr


def test_train_refuses_the_scripted_engine_naming_rollout(tmp_path):
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", "engine=scripted", "engine.script=x.jsonl",
                           f"trainer.runs_root={tmp_path}"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode != 0
    assert "engine.backend: scripted answers from a script and has no weights to train" in done.stderr
