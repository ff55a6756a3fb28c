"""The GSM8K interaction: verl's exact texts and turn rewards, its lifecycle, its errors."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.agent.interaction import InteractionResponse
from agentrl.agent.tools_runtime import InteractionPool
from agentrl.errors import ConfigError, DataError
from agentrl.plugins import PluginRegistry
from agentrl_interactions.gsm8k import Gsm8kInteraction

QUESTION = {"role": "user", "content": "Natalia sold 48 clips in April and half as many in May. How many in all?"}
CORRECT = "Your response is correct!"
INCORRECT = "Your response is incorrect! You need to reflect on your answer and try again."


def conversation(*answers: str) -> list[dict]:
    """The question, then each assistant answer followed by the interaction's (incorrect) reply."""
    messages = [QUESTION]
    for answer in answers:
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": INCORRECT}]
    return messages[:-1]


def test_gsm8k_interaction_is_the_entry_point_plugin():
    assert PluginRegistry().load("interactions", "gsm8k") is Gsm8kInteraction


def test_wrong_answer_gets_verls_retry_text_and_no_reward_then_right_answer_ends():
    async def scenario():
        interaction = Gsm8kInteraction()
        await interaction.start("t", ground_truth="72", query=QUESTION["content"])
        first = await interaction.generate_response("t", conversation("48+24 = 70\n#### 70"))
        score_after_first = await interaction.calculate_score("t")
        second = await interaction.generate_response("t", conversation("#### 70", "48+24 = 72\n#### 72"))
        return first, score_after_first, second, await interaction.calculate_score("t")

    first, score_after_first, second, final = asyncio.run(scenario())
    assert first == InteractionResponse(done=False, text=INCORRECT, reward=0.0, metrics={})
    assert score_after_first == 0.0
    assert second == InteractionResponse(done=True, text=CORRECT, reward=1.0, metrics={})
    assert final == 1.0


@pytest.mark.parametrize(
    "answer, strict, flexible",
    [
        ("#### 72", True, True),
        ("The answer is 72", False, True),  # verl's code: "#### " is prefixed, then the last number counts
        ("72", False, True),
        ("#### 72.", False, False),  # the full stop is part of the number, as in verl
        ("#### 1,000", False, False),
        ("#### 70", False, False),
        ("", False, False),
    ],
)
def test_strict_needs_the_hash_marks_and_flexible_reproduces_verls_code(answer, strict, flexible):
    async def correct(method: str) -> bool:
        interaction = Gsm8kInteraction(method=method)
        await interaction.start("t", ground_truth="72")
        return (await interaction.generate_response("t", conversation(answer))).done

    assert asyncio.run(correct("strict")) is strict
    assert asyncio.run(correct("flexible")) is flexible


def test_the_last_assistant_message_is_judged_even_after_tool_turns():
    messages = [
        QUESTION,
        {"role": "assistant", "content": "#### 72"},
        {"role": "user", "content": INCORRECT},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "48+24"}}}]},
        {"role": "tool", "content": "72"},
    ]

    async def scenario():
        interaction = Gsm8kInteraction()
        await interaction.start("t", ground_truth="72")
        return await interaction.generate_response("t", messages)

    assert asyncio.run(scenario()).text == INCORRECT  # the tool-calling message has no answer


def test_instances_are_independent_and_finalize_frees_them():
    async def scenario():
        interaction = Gsm8kInteraction()
        await interaction.start("a", ground_truth="72")
        await interaction.start("b", ground_truth="5")
        a = await interaction.generate_response("a", conversation("#### 5"))
        b = await interaction.generate_response("b", conversation("#### 5"))
        await interaction.finalize("a")
        await interaction.finalize("a")  # twice is harmless
        return a.done, b.done, await interaction.calculate_score("b"), set(interaction._instances)

    assert asyncio.run(scenario()) == (False, True, 1.0, {"b"})


def test_missing_ground_truth_is_a_data_error_naming_the_field():
    with pytest.raises(DataError, match=r"field extra_info\.interaction_kwargs\.ground_truth: the gsm8k interaction needs a ground truth"):
        asyncio.run(Gsm8kInteraction().start("t", query="q"))


def test_unknown_method_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"agent\.interaction_config\.gsm8k\.method: must be 'strict' or 'flexible', got 'fuzzy'"):
        Gsm8kInteraction(method="fuzzy")


def test_pool_passes_a_data_prep_row_s_interaction_kwargs_to_start():
    # data_prep's interaction variant writes {name, query, ground_truth}; the name picks the plugin
    pool = InteractionPool({"gsm8k": {"method": "flexible"}})
    session = pool.session("t", {"name": "gsm8k", "query": QUESTION["content"], "ground_truth": "72"})

    async def scenario():
        async with session:
            response = await session.respond(conversation("72 clips"))
        return response, session.interaction._instances

    response, instances = asyncio.run(scenario())
    assert (response.done, response.reward) == (True, 1.0)
    assert instances == {}  # finalized on exit
