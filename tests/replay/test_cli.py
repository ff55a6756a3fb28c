"""`agentrl replay show` and `agentrl replay rerun` on a store written by the real agent layer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from agentrl.replay.cli import cli_main, parse_steps


def test_show_prints_turns_tool_calls_rewards_and_marks_masked_tokens(scripted_store, tiny_model_dir, capsys):
    code = cli_main(["show", str(scripted_store.root), "--tokenizer", str(tiny_model_dir), "--step", "1",
                     "--data-source", "other/src", "--limit", "1"])
    assert code == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "═ train step 1 · r1 #0 · reward 1 · finish interaction_done"
    assert out[1] == "  group train1/1:r1 · other/src · loop tool_agent · policy version 0 · ground truth '12'"
    assert out[2] == "  tokens: prompt 162, response 77 (33 sampled, 44 observed)"
    assert out[3] == "  sampled at weight version: v0 ×33"
    assert out[4] == "  tool calls: 1 parsed, 0 malformed; 0 of 3 assistant turns with a call marker and no call read"
    assert out[5:10] == [
        "  ── assistant [0, 23) 23 sampled tokens",
        "    │ <tool_call>↵",
        '    │ {"name": "calculator", "arguments": {"expression": "7 + 5"}}↵',
        "    │ </tool_call><|im_end|>",
        """    ⮑ call calculator({"expression": "7 + 5"}) → '12'""",
    ]
    assert out[10] == "  ── tool [23, 38) 15 observed tokens (masked)"
    assert "    ┆ 12↵" in out
    assert "  ── assistant [38, 43) 5 sampled tokens · turn reward 0" in out
    assert "    ┆ Your response is incorrect! You need to reflect on your answer and try again.<|im_end|>↵" in out
    assert "  ── assistant [71, 76) 5 sampled tokens · turn reward 1" in out
    at = out.index("  ── template [76, 77) observed (masked)")  # then the interaction's final reply, not in the tokens
    assert out[at:at + 6] == ["  ── template [76, 77) observed (masked)", "    ┆ ↵",
                              "  ── user: the episode's last message, after its last turn (not in the tokens)",
                              "    ┆ Your response is correct!", '  reward info: {"interaction_score": 1.0}', ""]
    assert out[-2:] == ["all shown: tool calls: 1 parsed, 0 malformed; 0 of 3 assistant turns with a call marker and no call read",
                        "1 trajectory shown"]


def test_show_without_a_tokenizer_shows_token_ids(scripted_store, capsys):
    assert cli_main(["show", str(scripted_store.root), "--split", "val", "--min-reward", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("(no tokenizer: showing token ids; pass --tokenizer PATH for text)\n═ val step 2 · r0 #0")
    assert out.rstrip().endswith("all shown: tool calls: 1 parsed, 0 malformed; 0 of 2 assistant turns with a call marker "
                                 "and no call read\n1 trajectory shown")


def test_step_ranges_parse_like_slices():
    assert parse_steps("3") == (3, 4) and parse_steps("2:5") == (2, 5)
    assert parse_steps(":5") == (None, 5) and parse_steps("2:") == (2, None) and parse_steps(None) is None


def test_a_bad_step_range_is_named(scripted_store, capsys):
    assert cli_main(["show", str(scripted_store.root), "--step", "a:b"]) == 2
    assert "--step: expected A:B" in capsys.readouterr().err


def test_an_unknown_finish_reason_is_refused_listing_the_known_ones(scripted_store, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(["show", str(scripted_store.root), "--finish-reason", "timeout"])
    assert exit_.value.code == 2
    assert "argument --finish-reason: invalid choice: 'timeout' (choose from 'stop', 'length', " in capsys.readouterr().err


def test_rerun_command_matches_then_flags_changed_limits_and_exits_1(scripted_store, tiny_model_dir):
    def run(*extra):
        return subprocess.run([sys.executable, "-m", "agentrl.cli", "replay", "rerun", str(scripted_store.root.parent),
                               "--tokenizer", str(tiny_model_dir), *extra], capture_output=True, text=True, timeout=300)

    same = run("--split", "train")
    assert same.returncode == 0, same.stderr[-2000:]
    assert json.loads(same.stdout) == {"trajectories": 12, "matching": 12, "differing": 0, "differences_by_kind": {}}
    changed = run("--step", "2", "agent.max_tool_response_tokens=1")  # tool results now cut to one token
    assert changed.returncode == 1, changed.stderr[-2000:]
    lines = changed.stdout.splitlines()
    assert lines[0] == "val step 2 · r0#0: 1 difference"
    assert lines[1].startswith("  [observation] turn 1 (tool) tokens differ: stored '\\n<|im_start|>user\\n<tool_response>\\n408")
    assert "4...[truncated 2 tokens]" in lines[1]  # "408" is three tokens
    assert json.loads("\n".join(lines[2:]))["differences_by_kind"] == {"observation": 1}


def test_show_puts_a_turns_reasoning_apart_from_its_answer():
    """Reasoning is shown under its own heading while the tokens stay as sampled (ids here are
    character codes, so the expected text is exact)."""
    from agentrl.data.rollout_store import StoredTrajectory
    from agentrl.replay.cli import format_trajectory, split_reasoning
    from agentrl.trajectory import Trajectory, Turn

    def ids(text):
        return [ord(c) for c in text]

    first, tool, second = "<think>\nadd them\n</think>\n\ncall(1+2)", "3\n", "</think>\n#### 3"
    a, b = len(first), len(first) + len(tool)
    t = Trajectory(row_id="r", group_id="g", sample_index=0, data_source="d", agent_name="tool_agent",
                   prompt_ids=[1], response_ids=ids(first + tool + second),
                   response_mask=[1] * len(first) + [0] * len(tool) + [1] * len(second),
                   logprobs=[0.0] * len(first + tool + second),
                   turns=[Turn("assistant", 0, a), Turn("tool", a, b), Turn("assistant", b, b + len(second))],
                   messages=[], finish_reason="stop")
    stored = StoredTrajectory(split="train", step=0, writer_id=0, trajectory=t, row=None)
    out = format_trajectory(stored, lambda x: "".join(map(chr, x))).splitlines()
    i = out.index(f"  ── assistant [0, {a}) {a} sampled tokens")
    assert out[i + 1 : i + 8] == ["    reasoning:", "    │ <think>↵", "    │ add them↵", "    │ </think>↵", "    │ ↵", "    answer:",
                                  "    │ call(1+2)"]
    j = out.index(f"  ── assistant [{b}, {b + len(second)}) {len(second)} sampled tokens")  # opened in the prompt
    assert out[j + 1 : j + 5] == ["    reasoning:", "    │ </think>↵", "    answer:", "    │ #### 3"]
    assert out[out.index(f"  ── tool [{a}, {b}) {len(tool)} observed tokens (masked)") + 1] == "    ┆ 3↵"
    assert split_reasoning("#### 3") is None


def test_show_counts_the_sampled_tokens_of_each_weight_version_over_every_segment():
    from agentrl.data.rollout_store import StoredTrajectory
    from agentrl.replay.cli import format_trajectory
    from agentrl.trajectory import Trajectory, TrajectorySegment, Turn

    t = Trajectory(row_id="r", group_id="g", sample_index=0, data_source="d", agent_name="tool_agent", prompt_ids=[1],
                   response_ids=[5, 6, 7, 8], response_mask=[1, 0, 1, 1], logprobs=[0.0] * 4,
                   turns=[Turn("assistant", 0, 1), Turn("tool", 1, 2), Turn("assistant", 2, 4)], messages=[],
                   finish_reason="stop", token_versions=[3, -1, 4, 4],
                   earlier_segments=[TrajectorySegment([1], [9, 9], [1, 1], [0.0, 0.0], [Turn("assistant", 0, 2)], [2, 3])])
    out = format_trajectory(StoredTrajectory(split="train", step=0, writer_id=0, trajectory=t, row=None), None).splitlines()
    assert out[3] == "  sampled at weight version: v2 ×1, v3 ×2, v4 ×2"
    assert t.oldest_version == 2


def test_show_names_a_program_error_and_counts_them_by_exception_type(tmp_path, capsys):
    from agentrl.data.rollout_store import RolloutStore
    from agentrl.trajectory import Trajectory, Turn

    def trajectory(i, finish, info):
        return Trajectory(row_id=f"r{i}", group_id="g", sample_index=i, data_source="d", agent_name="openai_agent",
                          prompt_ids=[1], response_ids=[2, 3], response_mask=[1, 1], logprobs=[-0.5, -0.5],
                          turns=[Turn("assistant", 0, 2)], messages=[], finish_reason=finish, reward_info=info)

    error = {"error": "ModelBehaviorError: Invalid JSON", "exception_type": "ModelBehaviorError"}
    store = RolloutStore(tmp_path / "rollouts")
    store.write_step(1, [trajectory(0, "program_error", error), trajectory(1, "stop", {}), trajectory(2, "program_error", error),
                         trajectory(3, "program_error", {"error": "ValueError: no", "exception_type": "ValueError"})])
    assert cli_main(["show", str(store.root)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out.count("  program error (ModelBehaviorError): ModelBehaviorError: Invalid JSON") == 2
    assert out[-2:] == ["4 trajectories shown", "program errors by exception type: ModelBehaviorError 2, ValueError 1"]
