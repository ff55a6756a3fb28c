"""Real SGLang 0.5.23 on this CPU against agentrl's built-in engine, same tiny model.

Needs the cached SGLang venv (``python -m agentrl.engines.sglang_cpu build``, or
``scripts/sglang_cpu_env.sh``); every test here skips with the reason when it is missing. One
server serves the whole module (start-up takes 30-60 s on two cores, 3.5-4 GB of RAM).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM

from agentrl.agent.runner import LoopTable, RolloutRunner, build_context
from agentrl.agent.tools_runtime import ToolBox
from agentrl.agent.setup import RolloutSetup
from agentrl.config.schema import DataConfig, RewardConfig, RolloutConfig, TrainConfig
from agentrl.data.row import Row
from agentrl.engines.base import FinishReason, GenerateRequest, GenerateResult, SamplingParams
from agentrl.engines.builtin import BuiltinEngine
from agentrl.engines.guard import API_KEY_ENV, auth_headers
from agentrl.engines.sglang import SGLangEngine
from agentrl.engines.sglang_cpu.env import unavailable_reason
from agentrl.engines.sglang_cpu.server import launch_sglang_cpu_server, process_group_rss_bytes
from agentrl.trajectory import Trajectory

_REASON = unavailable_reason()
pytestmark = [pytest.mark.sglang, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

LOGPROB_TOLERANCE = 1e-4
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def served_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A private copy: the weight-update test swaps the server's weights and restores these."""
    path = tmp_path_factory.mktemp("sglang-served") / "model"
    shutil.copytree(tiny_model_dir, path)
    return path


@pytest.fixture(scope="module")
def perturbed_model_dir(served_model_dir, tmp_path_factory) -> Path:
    """Same architecture and tokenizer, every weight moved by seeded noise."""
    path = tmp_path_factory.mktemp("sglang-perturbed") / "model"
    shutil.copytree(served_model_dir, path)
    model = Qwen2ForCausalLM.from_pretrained(served_model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.5 * param.std())
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def sglang_url(served_model_dir, tmp_path_factory):
    started = time.perf_counter()
    logs = tmp_path_factory.mktemp("sglang-logs")
    # Generous start-up timeout: the two cores are shared with the rest of the suite.
    with launch_sglang_cpu_server(served_model_dir, threads=2, ready_timeout_s=300.0, log_dir=logs) as servers:
        rss = process_group_rss_bytes(servers.servers[0].process.pid)
        print(f"\nsglang CPU server ready after {time.perf_counter() - started:.1f} s, RSS {rss / 2**30:.2f} GiB")
        # the server was started with --api-key; the clients of these tests take it from the environment
        with pytest.MonkeyPatch.context() as env:
            env.setenv(API_KEY_ENV, servers.api_key)
            SGLANG_LOGS.append(servers.servers[0].log_path)
            yield servers.urls[0]


SGLANG_LOGS: list[Path] = []


def test_the_sglang_server_refuses_requests_without_its_api_key(sglang_url):
    assert httpx.post(f"{sglang_url}/flush_cache", timeout=30.0).status_code == 401
    assert httpx.post(f"{sglang_url}/update_weights_from_disk", json={"model_path": "/tmp"}, timeout=30.0).status_code == 401
    # SGLang prints its arguments, the key among them; the log agentrl keeps has it blanked out
    log = SGLANG_LOGS[-1].read_text()
    assert "'api_key': '<api-key>'" in log and os.environ[API_KEY_ENV] not in log


@pytest.fixture(scope="module")
def eos_id(served_model_dir) -> int:
    return AutoTokenizer.from_pretrained(served_model_dir).eos_token_id


@pytest.fixture(scope="module")
def prompts(served_model_dir) -> list[list[int]]:
    """Token ids of texts of different lengths (a single token up to a chat-rendered question)."""
    tokenizer = AutoTokenizer.from_pretrained(served_model_dir)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 * 34? Use the calculator."}], add_generation_prompt=True, tokenize=False
    )
    texts = ["7", "3 + 4 =", "The answer is 408 because 12 * 34 = 408.", chat]
    ids = [tokenizer(text).input_ids for text in texts]
    assert len(ids[0]) == 1 and len(ids[3]) > 15
    return ids


async def _generate_each(engine, prompts: list[list[int]], sampling: SamplingParams) -> list[GenerateResult]:
    return list(await asyncio.gather(*(engine.generate(GenerateRequest(p, sampling)) for p in prompts)))


async def _sglang(url: str, prompts: list[list[int]], sampling: SamplingParams) -> list[GenerateResult]:
    engine = SGLangEngine([url], max_retries=0)
    try:
        return await _generate_each(engine, prompts, sampling)
    finally:
        await engine.aclose()


async def _builtin(model_dir: Path, prompts: list[list[int]], sampling: SamplingParams) -> list[GenerateResult]:
    async with BuiltinEngine(model_dir) as engine:
        return await _generate_each(engine, prompts, sampling)


def _assert_same_generations(sglang: list[GenerateResult], builtin: list[GenerateResult]) -> float:
    """Same tokens and finish reasons, logprobs within tolerance; returns the largest logprob gap."""
    worst = 0.0
    for index, (remote, local) in enumerate(zip(sglang, builtin, strict=True)):
        assert remote.output_ids == local.output_ids, f"prompt {index}: tokens differ"
        assert remote.finish_reason == local.finish_reason, f"prompt {index}"
        gap = max(abs(a - b) for a, b in zip(remote.logprobs, local.logprobs, strict=True))
        assert gap < LOGPROB_TOLERANCE, f"prompt {index}: logprobs differ by {gap}"
        worst = max(worst, gap)
    return worst


def _greedy(eos_id: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, stop_token_ids=(eos_id,))


def test_sglang_and_builtin_engine_give_the_same_greedy_tokens_and_logprobs(sglang_url, served_model_dir, prompts, eos_id):
    sampling = _greedy(eos_id)
    sglang = asyncio.run(_sglang(sglang_url, prompts, sampling))
    builtin = asyncio.run(_builtin(served_model_dir, prompts, sampling))
    worst = _assert_same_generations(sglang, builtin)
    print(f"\ngreedy agreement over {len(prompts)} prompts: max |logprob gap| {worst:.2e}")
    # A model that repeats one token would make this comparison weak: the outputs must vary.
    assert len({token for result in builtin for token in result.output_ids}) > 3


def test_sglang_ends_at_a_stop_string_where_the_builtin_engine_does_keeping_the_completing_token(sglang_url, served_model_dir, eos_id):
    """A stop string that starts inside one greedy token and ends in the next: SGLang (``stop``,
    ``no_stop_trim``) and the built-in engine end at the same token, keep it in ``output_ids``
    and say which string matched."""
    tokenizer = AutoTokenizer.from_pretrained(served_model_dir)
    prompt = tokenizer("What is 12 * 34?").input_ids
    free = asyncio.run(_builtin(served_model_dir, [prompt], SamplingParams(max_new_tokens=24, temperature=0.0)))[0].output_ids
    texts = [tokenizer.decode([t]) for t in free]
    i = next(i for i in range(len(texts) - 1) if texts[i] != texts[i + 1] and texts[i].strip() and len(texts[i + 1].strip()) >= 2)
    stop = texts[i][-1] + texts[i + 1][:2]
    k = next(k for k in range(1, len(free) + 1) if stop in tokenizer.decode(free[:k]))
    sampling = SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=(eos_id,), stop=(stop,))
    [remote] = asyncio.run(_sglang(sglang_url, [prompt], sampling))
    [local] = asyncio.run(_builtin(served_model_dir, [prompt], sampling))
    assert local.output_ids == free[:k] and (local.finish_reason, local.matched_stop) == (FinishReason.STOP, stop)
    assert remote.output_ids == local.output_ids and (remote.finish_reason, remote.matched_stop) == (FinishReason.STOP, stop)
    assert max(abs(a - b) for a, b in zip(remote.logprobs, local.logprobs, strict=True)) < LOGPROB_TOLERANCE


def test_sglang_logprobs_of_sampled_tokens_equal_a_forward_pass_of_the_same_weights(sglang_url, served_model_dir, prompts):
    """Sampled tokens depend on each engine's RNG, so score SGLang's samples with one forward pass."""
    prompt = prompts[2]
    [sampled] = asyncio.run(_sglang(sglang_url, [prompt], SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0)))
    model = Qwen2ForCausalLM.from_pretrained(served_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + sampled.output_ids])).logits[0, len(prompt) - 1 : -1]  # [new, vocab]
    reference = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(sampled.output_ids)[:, None]).squeeze(1)
    # Unseeded sampling may draw EOS early (its logprob is about -6.6 here: ~1 run in 60 over 12
    # tokens); every token it did sample is scored all the same.
    assert len(sampled.output_ids) == NEW_TOKENS or sampled.finish_reason is FinishReason.STOP
    assert torch.allclose(torch.tensor(sampled.logprobs), reference, atol=LOGPROB_TOLERANCE, rtol=0)


def test_sglang_loads_the_tiny_tokenizer_and_tokenizes_text_like_transformers(sglang_url, served_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(served_model_dir)
    text = "The calculator says 3*4 = 12."
    payload = {
        "text": text,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": 0,  # also return the prompt's tokens, as SGLang's tokenizer made them
    }
    response = httpx.post(f"{sglang_url}/generate", json=payload, timeout=120.0, headers=auth_headers(os.environ[API_KEY_ENV])).json()
    prompt_ids = [entry[1] for entry in response["meta_info"]["input_token_logprobs"]]
    assert prompt_ids == tokenizer(text).input_ids
    assert response["text"] == tokenizer.decode(response["output_ids"])


def test_update_weights_from_disk_makes_sglang_follow_the_new_weights(
    sglang_url, served_model_dir, perturbed_model_dir, prompts, eos_id
):
    sampling = _greedy(eos_id)

    async def update_then_generate(path: Path, version: int) -> list[GenerateResult]:
        engine = SGLangEngine([sglang_url], max_retries=0)
        try:
            await engine.update_weights(path=str(path), version=version)  # /update_weights_from_disk
            return await _generate_each(engine, prompts, sampling)
        finally:
            await engine.aclose()

    before = asyncio.run(_sglang(sglang_url, prompts, sampling))
    try:
        started = time.perf_counter()
        after = asyncio.run(update_then_generate(perturbed_model_dir, version=7))
        seconds = time.perf_counter() - started
        worst = _assert_same_generations(after, asyncio.run(_builtin(perturbed_model_dir, prompts, sampling)))
        assert {result.weight_version for result in after} == {7}
        moved = max(abs(a - b) for old, new in zip(before, after) for a, b in zip(old.logprobs, new.logprobs))
        assert moved > 0.1, "the perturbed weights should change the outputs"
        print(f"\nupdate + {len(prompts)} generations {seconds:.2f} s; gap vs built-in on the new weights {worst:.2e}")
    finally:
        restored = asyncio.run(update_then_generate(served_model_dir, version=8))
    assert [r.output_ids for r in restored] == [r.output_ids for r in before]


def test_a_request_interrupted_by_three_weight_updates_gives_the_greedy_tokens_of_an_uninterrupted_one(
    sglang_url, served_model_dir
):
    """Partial rollouts on real SGLang: each update aborts the running request
    (``abort_all_requests``) and the client sends prompt + tokens so far with the rest of the
    budget. The weights reloaded are the same, so the pieces must join into the uninterrupted
    greedy output."""
    prompt, sampling = [5, 17, 42, 99, 3, 64, 128, 7], SamplingParams(max_new_tokens=192, temperature=0.0)

    async def run() -> tuple[GenerateResult, list[tuple[GenerateResult, int]]]:
        engine = SGLangEngine([sglang_url], max_retries=0, partial=True)
        try:
            started = time.perf_counter()
            expected = await engine.generate(GenerateRequest(prompt, sampling))
            whole = time.perf_counter() - started
            tries = []
            # An update every twelfth of the machine's pace, the three well before the end. In CI
            # other tests share the two cores, so the timed request can be much slower than the
            # interrupted one (once 191 of 192 tokens came before the first update): when the
            # updates came too late, try again with the pace halved; every try must still join
            # into the greedy output, which is the behaviour under test.
            for attempt, divisor in enumerate((12, 24, 48, 96)):
                versions = [100 * (attempt + 1) + k for k in range(3)]  # rising from try to try
                before = engine.interrupted_requests
                running = asyncio.create_task(engine.generate(GenerateRequest(prompt, sampling)))
                for version in versions:
                    await asyncio.sleep(whole / divisor)
                    await engine.update_weights(path=str(served_model_dir), version=version)
                result = await running
                tries.append((result, engine.interrupted_requests - before))
                if tries[-1][1] == 3 and versions[-1] in result.output_versions:
                    break
            return expected, tries
        finally:
            await engine.aclose()

    expected, tries = asyncio.run(run())
    assert len(expected.output_ids) == 192 and expected.output_versions == []  # it ran whole, at one version
    for result, _ in tries:  # however late the updates came, the pieces join into the greedy output
        assert result.output_ids == expected.output_ids and result.finish_reason is FinishReason.LENGTH
    result, interrupted = tries[-1]
    last = 100 * len(tries) + 2
    pieces = {v: result.output_versions.count(v) for v in (last - 2, last - 1, last)}
    assert interrupted == 3 and pieces[last] > 0, (
        f"{interrupted} interruptions, pieces {pieces} after {len(tries)} tries: the updates came too late"
    )
    assert len(set(result.output_versions)) >= 2 and result.output_versions == sorted(result.output_versions)
    assert result.weight_version == last
    gap = max(abs(a - b) for a, b in zip(result.logprobs, expected.logprobs))
    assert gap < LOGPROB_TOLERANCE
    print(f"\npieces {[len(result.output_ids) - sum(pieces.values()), *pieces.values()]}, largest logprob gap {gap:.2e}")


# ---------------------------------------------------------------- a multi-turn tool rollout

QUESTION, ANSWER = "What is 12 * 34?", "408"
ROW = {
    "data_source": "agentrl/arith",
    "prompt": [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": QUESTION}],
    "reward_model": {"style": "rule", "ground_truth": ANSWER},
    "extra_info": {"index": 0, "tools_kwargs": {"calculator": {"create_kwargs": {}}}},
    "agent_name": "tool_agent",
}
TOOL_CALL = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12 * 34"}}}


def _calculator_schemas() -> list[dict]:
    return ToolBox.from_plugins(["calculator"]).schemas(["calculator"])


@pytest.fixture(scope="module")
def tool_user_model_dir(served_model_dir, tmp_path_factory) -> Path:
    """The tiny model taught (by overfitting one conversation) to call the calculator, then answer.

    A randomly initialised model never writes a tool call, so an end-to-end tool rollout needs
    weights that do: train on the rendered conversation, loss on the assistant tokens only.
    """
    tokenizer = AutoTokenizer.from_pretrained(served_model_dir)
    conversation = [
        *ROW["prompt"],
        {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
        {"role": "tool", "content": ANSWER},
        {"role": "assistant", "content": f"#### {ANSWER}"},
    ]
    encoded = tokenizer.apply_chat_template(
        conversation, tools=_calculator_schemas(), tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids = torch.tensor([encoded["input_ids"]])  # [1, T]
    labels = ids.masked_fill(torch.tensor([encoded["assistant_masks"]]) == 0, -100)  # [1, T]
    model = Qwen2ForCausalLM.from_pretrained(served_model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for _ in range(400):
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 2e-3:
            break
    path = tmp_path_factory.mktemp("sglang-tool-user") / "model"
    shutil.copytree(served_model_dir, path)
    model.save_pretrained(path)
    return path


async def _rollout(engine, tokenizer) -> Trajectory:
    setup = RolloutSetup.from_config(TrainConfig(
        rollout=RolloutConfig(max_new_tokens=48), reward=RewardConfig(default="exact_number"), data=DataConfig(max_response_length=256),
    ))  # fmt: skip
    ctx = build_context(engine, tokenizer, setup, tool_names=["calculator"], validation=True)  # greedy: the val temperature is 0
    [trajectory] = await RolloutRunner(ctx, LoopTable("tool_agent")).run([("row-0", Row.model_validate(ROW))])
    return trajectory


def test_a_multi_turn_calculator_rollout_runs_through_sglang_like_through_the_builtin_engine(
    sglang_url, served_model_dir, tool_user_model_dir
):
    tokenizer = AutoTokenizer.from_pretrained(tool_user_model_dir)

    async def through_sglang() -> Trajectory:
        engine = SGLangEngine([sglang_url], max_retries=0)
        try:
            await engine.update_weights(path=str(tool_user_model_dir), version=1)
            return await _rollout(engine, tokenizer)
        finally:
            await engine.update_weights(path=str(served_model_dir), version=2)  # the module's server, as it was
            await engine.aclose()

    async def through_builtin() -> Trajectory:
        async with BuiltinEngine(tool_user_model_dir) as engine:
            return await _rollout(engine, tokenizer)

    remote, local = asyncio.run(through_sglang()), asyncio.run(through_builtin())

    assert remote.finish_reason == "stop", remote.reward_info
    assert [turn.role for turn in remote.turns] == ["assistant", "tool", "assistant"]
    [call] = remote.tool_calls
    assert (call.name, call.arguments, call.result, call.error) == ("calculator", {"expression": "12 * 34"}, ANSWER, None)
    assert remote.messages[-1] == {"role": "assistant", "content": f"#### {ANSWER}"}
    assert remote.reward == 1.0
    # Token-exact: the sampled ids plus the rendered tool turn are what the template renders.
    rendered = tokenizer.apply_chat_template(remote.messages, tools=_calculator_schemas(), tokenize=True, return_dict=True)
    assert remote.prompt_ids + remote.response_ids == rendered["input_ids"]
    # The same episode, token for token, as the built-in engine plays it; logprobs within tolerance.
    assert (remote.prompt_ids, remote.response_ids, remote.response_mask) == (
        local.prompt_ids, local.response_ids, local.response_mask,
    )  # fmt: skip
    sampled = [i for i, m in enumerate(remote.response_mask) if m]
    gap = max(abs(remote.logprobs[i] - local.logprobs[i]) for i in sampled)
    assert gap < LOGPROB_TOLERANCE
    print(f"\ntool rollout: {len(remote.response_ids)} response tokens, {len(sampled)} sampled, logprob gap {gap:.2e}")
