"""Generated tool tasks: deterministic, disjoint splits, correct answers, valid rows."""

from __future__ import annotations

import re

import pytest

from agentrl.data.row import Row
from agentrl_data_prep.tasks import RECOVERY_SOURCE, after_wrong_answer, generate, mental_slip, problems, sft_conversations
from agentrl_interactions.gsm8k import INCORRECT
from agentrl_tools.calculator import evaluate


@pytest.mark.parametrize("task", ["arith", "word", "arith_retry"])
def test_same_seed_same_rows_and_rows_validate(task):
    a, b = generate(task, 50, seed=7), generate(task, 50, seed=7)
    assert a == b
    assert generate(task, 50, seed=8) != a
    for row in a:
        Row.model_validate(row)
    assert all(r["agent_name"] == "tool_agent" for r in a)


@pytest.mark.parametrize("task", ["arith", "word"])
def test_train_and_test_are_disjoint(task):
    train = {r["prompt"][1]["content"] for r in generate(task, 400, seed=0, split="train")}
    test = {r["prompt"][1]["content"] for r in generate(task, 60, seed=0, split="test")}
    assert len(train) == 400 and len(test) == 60 and not train & test


@pytest.mark.parametrize("task", ["arith", "word"])
def test_demonstrations_compute_the_ground_truth(task):
    for conversation in sft_conversations(task, 30, seed=0):
        for call, result in zip(conversation[2::2], conversation[3::2]):
            if call.get("tool_calls"):
                expression = call["tool_calls"][0]["function"]["arguments"]["expression"]
                assert str(evaluate(expression)) == result["content"]
        final = conversation[-1]["content"]
        assert re.fullmatch(r"#### -?\d+", final)


def test_arith_answers_are_correct():
    for row in generate("arith", 100, seed=0):
        expression = row["prompt"][1]["content"].removeprefix("What is ").removesuffix("?")
        assert str(evaluate(expression)) == row["reward_model"]["ground_truth"]


def test_retry_variant_carries_the_gsm8k_interaction():
    row = generate("arith_retry", 1, seed=0)[0]
    assert row["extra_info"]["interaction_kwargs"] == {
        "name": "gsm8k", "query": row["prompt"][1]["content"], "ground_truth": row["reward_model"]["ground_truth"]
    }


def test_rows_after_a_wrong_answer_start_at_the_second_attempt():
    rows = generate("arith_retry", 20, seed=0, split="test")
    after = after_wrong_answer(rows)
    assert after == after_wrong_answer(rows) and len(after) == 20
    for row, late in zip(rows, after):
        Row.model_validate(late)
        assert late["data_source"] == RECOVERY_SOURCE and late["extra_info"] == row["extra_info"]
        assert late["prompt"][:2] == row["prompt"] and [m["role"] for m in late["prompt"][2:]] == ["assistant", "user"]
        assert late["prompt"][3]["content"] == INCORRECT
        first = re.fullmatch(r"#### (\d+)", late["prompt"][2]["content"]).group(1)
        truth = row["reward_model"]["ground_truth"]
        assert len(first) == len(truth) and sum(a != b for a, b in zip(first, truth)) == 1  # one digit wrong
    with pytest.raises(ValueError, match="needs rows with an interaction"):
        after_wrong_answer(generate("arith", 2, seed=0))


def test_word_problems_need_two_or_three_calls():
    counts = {sum(1 for m in c if m.get("tool_calls")) for c in sft_conversations("word", 40, seed=0)}
    assert counts == {2, 3}


def test_informal_answers_follow_the_rate_and_the_seed():
    def finals(rate, seed=0):
        return [c[-1]["content"] for c in sft_conversations("arith", 400, seed=seed, informal_rate=rate)]

    formal, informal = finals(0.0), finals(1.0)
    assert all(re.fullmatch(r"#### \d+", f) for f in formal)
    assert [f"The answer is {f[5:]}." for f in formal] == informal  # same problems, same tool calls
    mixed = finals(0.7)
    assert mixed == finals(0.7) and mixed != finals(0.7, seed=1)
    share = sum(f.startswith("The answer is ") for f in mixed) / len(mixed)
    assert 0.63 < share < 0.77
    with pytest.raises(ValueError, match="informal_rate"):
        sft_conversations("arith", 1, informal_rate=1.5)
    with pytest.raises(ValueError, match="max_attempts"):
        sft_conversations("arith_retry", 1, max_attempts=0)


def test_a_rare_tool_demonstrator_answers_the_rest_at_once_one_digit_wrong():
    every = sft_conversations("arith", 400, seed=0)
    rare = sft_conversations("arith", 400, seed=0, tool_rate=0.15)
    truth = [p.answer for p in problems("arith", 400, 0, "train")]
    used = [any(m.get("tool_calls") for m in c) for c in rare]
    assert 0.10 < sum(used) / len(used) < 0.20
    for conversation, full, answer, tool in zip(rare, every, truth, used):
        if tool:  # the same conversation as the demonstrator who always uses the tool
            assert conversation == full
            continue
        assert [m["role"] for m in conversation] == ["system", "user", "assistant"]
        said = conversation[-1]["content"]
        assert re.fullmatch(r"#### [1-9]\d*", said)
        wrong = said[5:]
        assert len(wrong) == len(str(answer)) and sum(a != b for a, b in zip(wrong, str(answer))) == 1
    assert rare == sft_conversations("arith", 400, seed=0, tool_rate=0.15)  # seeded
    with pytest.raises(ValueError, match="tool_rate"):
        sft_conversations("arith", 1, tool_rate=-0.1)


def test_a_mental_slip_changes_exactly_one_digit_and_never_leads_with_zero():
    import random

    rng = random.Random(0)
    for answer in [7, 10, 95, 1000, 123456] * 40:
        slip = mental_slip(answer, rng)
        assert slip != answer and len(str(slip)) == len(str(answer))
        assert sum(a != b for a, b in zip(str(slip), str(answer))) == 1


def test_a_retry_demonstrator_who_slipped_may_reach_for_the_tool_after_the_feedback():
    from agentrl_interactions.gsm8k import INCORRECT

    conversations = sft_conversations("arith_retry", 300, seed=0, tool_rate=0.4, max_attempts=2)
    late = [c for c in conversations if c[2].get("content", "").startswith("####") and any(m.get("tool_calls") for m in c)]
    assert late  # first answer mental (wrong), then "incorrect", then the calculator and the right answer
    for c in late:
        assert c[3] == {"role": "user", "content": INCORRECT}
        assert c[4]["tool_calls"] and c[-1]["content"] == f"#### {int(c[5]['content'])}"


def test_retry_demonstrations_answer_again_after_the_interaction_feedback():
    from agentrl_interactions.gsm8k import INCORRECT

    conversations = sft_conversations("arith_retry", 200, seed=0, informal_rate=0.5, max_attempts=3)
    attempts = []
    for c in conversations:
        answers = [m["content"] for m in c[4:] if m["role"] == "assistant"]
        feedback = [m["content"] for m in c[4:] if m["role"] == "user"]
        assert feedback == [INCORRECT] * (len(answers) - 1)  # after every informal answer but the last
        assert all(a.startswith("The answer is ") for a in answers[:-1])
        attempts.append(len(answers))
    assert set(attempts) == {1, 2, 3}
    # a final third attempt may still be informal; a shorter conversation ended on the required format
    assert all(c[-1]["content"].startswith("####") for c, n in zip(conversations, attempts) if n < 3)
    # the plain task never retries, whatever the rate
    assert {len(c) for c in sft_conversations("arith", 50, seed=0, informal_rate=0.9)} == {5}


def test_demonstrations_render_through_the_tiny_chat_template(tiny_tokenizer):
    [conversation] = sft_conversations("arith", 1, seed=0)
    out = tiny_tokenizer.apply_chat_template(conversation, return_assistant_tokens_mask=True, return_dict=True)
    trained = tiny_tokenizer.decode([i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m])
    assert trained.startswith("<tool_call>\n{\"name\": \"calculator\"") and trained.endswith(
        f"#### {conversation[-1]['content'][5:]}<|im_end|>"
    )


def test_cli_writes_train_and_test_parquet(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    subprocess.run(
        [sys.executable, "-m", "data_prep.tasks", "--task", "word", "--n", "64", "--output-dir", str(tmp_path)],
        cwd=repo, check=True, capture_output=True,
    )
    from agentrl.data.io import count_rows

    assert count_rows(tmp_path / "train.parquet") == 64 and count_rows(tmp_path / "test.parquet") == 32


def test_retry_demonstrations_train_on_both_answers_and_never_on_the_feedback(tiny_tokenizer):
    from agentrl_interactions.gsm8k import INCORRECT

    retried = next(c for c in sft_conversations("arith_retry", 50, seed=0, informal_rate=0.5) if len(c) == 7)
    answer = retried[-1]["content"][5:]
    out = tiny_tokenizer.apply_chat_template(retried, return_assistant_tokens_mask=True, return_dict=True)
    trained = tiny_tokenizer.decode([i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m])
    assert trained.endswith(f"The answer is {answer}.<|im_end|>#### {answer}<|im_end|>")
    assert INCORRECT not in trained and INCORRECT in tiny_tokenizer.decode(out["input_ids"])


def test_the_retry_tasks_validation_holds_each_problem_twice_plain_and_after_a_wrong_answer(tmp_path):
    from agentrl.config.schema import TrainConfig
    from agentrl.data.prepare import prepare_data

    cfg = TrainConfig.model_validate({"data": {"task": "arith_retry", "task_train_size": 8, "task_val_size": 5}})
    _, val = prepare_data(cfg, tmp_path)
    sources = [row.data_source for _, row in val]
    assert sources == ["agentrl/arith_retry"] * 5 + [RECOVERY_SOURCE] * 5
    assert len({uid for uid, _ in val}) == 10  # distinct ids: the two kinds are separate rows
    assert [r.prompt[1].content for _, r in val[:5]] == [r.prompt[1].content for _, r in val[5:]]
    _, plain = prepare_data(TrainConfig.model_validate({"data": {"task": "arith", "task_val_size": 5}}), tmp_path / "plain")
    assert {row.data_source for _, row in plain} == {"agentrl/arith"}
