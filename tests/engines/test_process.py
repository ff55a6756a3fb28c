"""The built-in engine in a process of its own (``EngineProcess``): the same tokens and logprobs
as the in-process engine, partial rollouts across weight updates, a bounded wait on a stopped
child, a named error for a killed one, and an event loop that engine steps never hold."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from agentrl.engines.base import FinishReason, GenerateRequest, SamplingParams
from agentrl.engines.builtin import BuiltinEngine
from agentrl.engines.process import EngineProcess
from agentrl.errors import EngineTimeout, EngineUnavailable
from enginetest import load_reference, reference_greedy, reference_logprobs

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

PROMPT = [5, 17, 42, 99, 3, 64, 128, 7]
START_S = 180.0  # loading torch and transformers in the child, on a loaded machine


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def child(model_dir):
    """One engine process shared by the comparison and partial-rollout tests (partial=True: with
    no weight update it runs every request as the plain engine does)."""
    # wait_ready=False (the trainer's way): the first call waits for the child to load the model
    engine = EngineProcess(model_dir, threads=1, max_batch_size=4, seed=123, partial=True, start_timeout_s=START_S,
                           wait_ready=False)
    yield engine
    engine.close()


def requests() -> list[GenerateRequest]:
    """Greedy, seeded and unseeded sampling (seeds drawn from the engine's generator in arrival
    order), top-p/top-k, a stop token, more requests than batch slots."""
    return [
        GenerateRequest(PROMPT, SamplingParams(max_new_tokens=24, temperature=0.0)),
        GenerateRequest(PROMPT[:5], SamplingParams(max_new_tokens=30, temperature=1.0, seed=7)),
        GenerateRequest(PROMPT[2:], SamplingParams(max_new_tokens=17, temperature=0.8, top_p=0.9, top_k=40)),
        GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=40, temperature=1.0)),
        GenerateRequest(PROMPT * 3, SamplingParams(max_new_tokens=25, temperature=1.0, stop_token_ids=tuple(range(0, 256, 5)))),
        GenerateRequest(PROMPT[::-1], SamplingParams(max_new_tokens=12, temperature=1.2, seed=3)),
    ]


async def tokens_reach(engine, generated: int) -> None:
    """Poll the engine's own token counter (not wall-clock time)."""
    for _ in range(20_000):
        if engine.stats().generated_tokens >= generated:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"engine did not generate {generated} tokens")


async def test_the_process_engine_samples_the_tokens_and_logprobs_of_the_in_process_engine(child, model_dir):
    local = BuiltinEngine(model_dir, max_batch_size=4, seed=123)
    try:
        expected = [await local.generate(r) for r in requests()]
        expected_together = await asyncio.gather(*(local.generate(r) for r in requests()))
    finally:
        local.close()
    before = child.stats()
    got = [await child.generate(r) for r in requests()]
    together = await asyncio.gather(*(child.generate(r) for r in requests()))
    for i, (mine, theirs) in enumerate(zip(got + list(together), expected + list(expected_together))):
        assert mine.output_ids == theirs.output_ids, i
        assert (mine.finish_reason, mine.matched_stop) == (theirs.finish_reason, theirs.matched_stop), i
        if i < len(got):  # one at a time: the same steps, bit for bit
            assert mine.logprobs == theirs.logprobs, i
        else:  # together: requests reach the child's steps a little later than an in-process
            # engine's, so the batches of a step differ, and fp32 sums with them
            assert mine.logprobs == pytest.approx(theirs.logprobs, abs=1e-5), i
    assert any(r.finish_reason is FinishReason.STOP for r in got)
    stats = child.stats()
    assert stats.generated_tokens - before.generated_tokens == sum(len(r.output_ids) for r in got + list(together))
    assert (stats.running, stats.waiting) == (0, 0)


async def test_a_bad_request_is_the_callers_error_and_the_child_lives_on(child):
    with pytest.raises(ValueError, match=r"input_ids\[1\] = 999 is outside the vocabulary \[0, 256\)"):
        await child.generate(GenerateRequest([1, 999], SamplingParams(max_new_tokens=3)))
    with pytest.raises(ValueError, match="cannot load weights: unknown key 'nope'"):
        await child.update_weights({"nope": torch.zeros(2)}, version=9, strict=False)
    assert await child.health()
    assert len((await child.generate(GenerateRequest(PROMPT, SamplingParams(max_new_tokens=4)))).output_ids) == 4


async def test_abort_and_a_cancelled_call_stop_the_childs_request(child):
    start = child.stats().generated_tokens
    running = asyncio.create_task(child.generate(GenerateRequest(PROMPT, SamplingParams(max_new_tokens=400), rid="long")))
    await tokens_reach(child, start + 3)
    await child.abort("long")
    result = await running
    assert result.finish_reason is FinishReason.ABORT and 3 <= len(result.output_ids) < 400
    before = child.stats().generated_tokens
    cancelled = asyncio.create_task(child.generate(GenerateRequest(PROMPT, SamplingParams(max_new_tokens=400))))
    await tokens_reach(child, before + 3)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    for _ in range(2000):  # the abort the cancellation sent reaches the child
        if child.stats().running == 0:
            break
        await asyncio.sleep(0.001)
    stats = child.stats()
    assert stats.running == 0 and stats.generated_tokens - before < 400  # stopped early, not run to its end


async def test_interrupted_requests_resume_under_new_weights_sent_through_the_shared_mapping(child, model_dir, other_model_dir):
    """Partial rollouts through the proxy: an update (a state dict through the shared file
    mapping) interrupts the running request; it resumes keeping its tokens, logprobs and budget."""
    new_state = {k: v for k, v in load_reference(other_model_dir).state_dict().items() if k != "lm_head.weight"}
    old_state = {k: v for k, v in load_reference(model_dir).state_dict().items() if k != "lm_head.weight"}
    start, v0 = child.stats().generated_tokens, child.weight_version
    running = asyncio.create_task(child.generate(GenerateRequest(PROMPT, SamplingParams(max_new_tokens=200, temperature=0.0))))
    await tokens_reach(child, start + 5)
    await child.update_weights(new_state, version=v0 + 3)
    result = await running
    assert child.weight_version == v0 + 3
    leftovers = [p for p in Path("/dev/shm").glob(f"agentrl-engine-{child.pid}-*")] if Path("/dev/shm").is_dir() else []
    assert leftovers == []  # the mapping's name is gone once both sides hold it
    await child.update_weights(old_state, version=v0 + 4)  # back, for the other tests of the module
    k = result.output_versions.count(v0)
    assert 5 <= k < 200 and result.output_versions == [v0] * k + [v0 + 3] * (200 - k)
    assert result.finish_reason is FinishReason.LENGTH and len(result.output_ids) == 200  # one budget across both
    old, new = load_reference(model_dir), load_reference(other_model_dir)
    assert result.output_ids[:k] == reference_greedy(old, PROMPT, k)
    assert result.output_ids[k:] == reference_greedy(new, PROMPT + result.output_ids[:k], 200 - k)
    assert result.logprobs[k:] == pytest.approx(
        reference_logprobs(new, PROMPT + result.output_ids[:k], result.output_ids[k:], 0.0), abs=5e-5)  # fp32, 200 tokens deep


async def test_without_room_in_dev_shm_the_shared_weights_file_goes_to_the_temp_dir(child, model_dir, tmp_path):
    norm = {"model.norm.weight": load_reference(model_dir).state_dict()["model.norm.weight"]}  # unchanged weights
    child._map_dir = str(tmp_path / "no-such-dir")  # as a full /dev/shm refuses the reservation
    version = child.weight_version + 1
    await child.update_weights(norm, version=version, strict=False)
    assert child.weight_version == version and child._map_dir is None


async def test_repeated_interruptions_through_a_checkpoint_directory_sample_what_an_uninterrupted_run_samples(child, model_dir):
    request = GenerateRequest(PROMPT, SamplingParams(max_new_tokens=150, temperature=1.0, seed=11))
    await child.flush_cache()  # both runs prefill the prompt afresh (no K/V reused from earlier requests)
    expected = await child.generate(request)  # no update meanwhile: uninterrupted
    await child.flush_cache()
    before = child.stats()
    running = asyncio.create_task(child.generate(request))
    versions = []
    for at in (4, 30, 60):
        await tokens_reach(child, before.generated_tokens + at)
        await child.update_weights(path=str(model_dir), version=child.weight_version + 1)  # the same weights
        versions.append(child.weight_version)
    result = await running
    stats = child.stats()
    assert result.output_ids == expected.output_ids
    first = result.output_versions.count(before.weight_version)
    assert first >= 4 and result.output_versions == sorted(result.output_versions)
    assert set(result.output_versions) <= {before.weight_version, *versions} and result.output_versions[-1] == versions[-1]
    assert result.logprobs[:first] == expected.logprobs[:first]  # kept exactly
    assert result.logprobs == pytest.approx(expected.logprobs, abs=1e-5)  # resumed: prefilled again
    assert (stats.interrupted_requests - before.interrupted_requests, stats.resumed_requests - before.resumed_requests) == (3, 3)


async def test_a_ctrl_c_that_reaches_the_child_leaves_the_ending_to_the_parent(child):
    # Ctrl-C signals the terminal's whole process group; a child that took it printed two tracebacks
    await child.generate(GenerateRequest(PROMPT, SamplingParams(max_new_tokens=2)))  # the child has started
    os.kill(child.pid, signal.SIGINT)
    result = await child.generate(GenerateRequest(PROMPT, SamplingParams(max_new_tokens=5, temperature=0.0)))
    assert len(result.output_ids) == 5 and await child.health()


async def test_a_stopped_child_times_out_and_a_killed_one_fails_every_call_naming_it(model_dir):
    engine = EngineProcess(model_dir, threads=1, max_batch_size=4, seed=0, sync_timeout_s=1.5, start_timeout_s=START_S)
    try:
        state = {k: v for k, v in load_reference(model_dir).state_dict().items() if k != "lm_head.weight"}
        running = asyncio.create_task(engine.generate(GenerateRequest(PROMPT, SamplingParams(max_new_tokens=400, temperature=1.0))))
        await tokens_reach(engine, 3)
        os.kill(engine.pid, signal.SIGSTOP)  # alive but never answering: a hung engine
        try:
            started = time.monotonic()
            with pytest.raises(EngineTimeout, match=rf"pid {engine.pid}\) did not finish a weight update to version 1 "
                                                    r"within engine.sync_timeout_s=1.5 s"):
                await engine.update_weights(state, version=1)
            assert 1.4 < time.monotonic() - started < 5
            with pytest.raises(EngineTimeout, match=rf"pid {engine.pid}\) did not answer a stats call"):
                engine.stats()
        finally:
            os.kill(engine.pid, signal.SIGCONT)
        os.kill(engine.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(EngineUnavailable, match=rf"the built-in engine process \(pid {engine.pid}\) was killed by signal 9"):
            await running
        assert time.monotonic() - started < 1.5  # the socket closing says so at once, not a timeout
        with pytest.raises(EngineUnavailable, match=rf"pid {engine.pid}\) was killed by signal 9"):
            await engine.generate(GenerateRequest(PROMPT, SamplingParams(max_new_tokens=4)))
        with pytest.raises(EngineUnavailable, match="killed by signal 9"):
            await engine.update_weights(state, version=2)
        assert not await engine.health()
    finally:
        engine.close()


async def test_a_child_that_cannot_load_its_model_fails_the_first_call_with_its_reason(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # a directory, but no model in it
    engine = EngineProcess(tmp_path, threads=1, start_timeout_s=START_S, wait_ready=False)
    try:
        with pytest.raises(EngineUnavailable, match=rf"pid {engine.pid}\) exited with code 1: \w+Error: .+"):
            await engine.generate(GenerateRequest(PROMPT, SamplingParams(max_new_tokens=4)))
        with pytest.raises(EngineUnavailable, match=rf"pid {engine.pid}\) exited with code 1"):
            engine.stats()
    finally:
        engine.close()


# ---------------------------------------------------------------- the tools' event loop


def build_slow_model(path: Path) -> Path:
    """A model whose prefill steps take a while on one thread (long prompts, wider layers)."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=256, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
                         initializer_range=0.2, eos_token_id=None, bos_token_id=None)
    Qwen2ForCausalLM(config).eval().save_pretrained(path)
    return path


async def tool_overruns(engine, count: int = 6) -> tuple[list[float], list[float]]:
    """A tool that awaits ``asyncio.sleep(0.2)``, ``count`` times, on the loop that also waits on
    long requests to the engine; returns how far each sleep overran, and how long a stats call
    took after each sleep."""
    prompts = [[(i * 7 + j) % 256 for j in range(1000)] for i in range(4)]
    calls = [asyncio.create_task(engine.generate(GenerateRequest(p, SamplingParams(max_new_tokens=400, temperature=1.0, seed=i))))
             for i, p in enumerate(prompts)]
    await asyncio.sleep(0)
    overruns, stats_s = [], []
    for _ in range(count):
        started = time.perf_counter()
        await asyncio.sleep(0.2)
        overruns.append(time.perf_counter() - started - 0.2)
        started = time.perf_counter()
        engine.stats()
        stats_s.append(time.perf_counter() - started)
    for call in calls:
        call.cancel()
    await asyncio.gather(*calls, return_exceptions=True)
    return overruns, stats_s


async def test_engine_steps_in_their_own_process_never_hold_the_tools_event_loop(tmp_path):
    """The same tool and requests against the engine stepping on the caller's loop (the synchronous
    trainer's placement), where a prefill step holds the loop, and against the engine's process."""
    model = build_slow_model(tmp_path / "slow")
    process = EngineProcess(model, threads=1, max_batch_size=8, max_prefill_tokens=2048, seed=0, start_timeout_s=START_S)
    try:
        await process.generate(GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=2)))  # warm
        apart, stats_s = await tool_overruns(process)
        for _ in range(600):  # the child ran long prefill steps meanwhile (counted when a step ends)
            if process.stats().prefill_tokens >= 2 * 1000:
                break
            await asyncio.sleep(0.05)
        assert process.stats().prefill_tokens >= 2 * 1000
        assert max(stats_s) < 0.25, stats_s  # answered by the child's reader thread, not after a prefill step
    finally:
        process.close()
    local = BuiltinEngine(model, max_batch_size=8, max_prefill_tokens=2048, seed=0, steps_on="event_loop")
    try:
        together, _ = await tool_overruns(local, count=1)
    finally:
        local.close()
    print(f"tool sleep overruns (s): engine process {apart}, engine on the tool's loop {together}")
    assert max(together) > 0.05, together  # the load is real: on one loop a step delays the tool
    assert max(apart) < 0.05, apart


def test_stats_before_the_child_has_loaded_are_zero_and_do_not_wait_for_it():
    """The actor takes its engine-stats baseline right after starting the child: that must not
    hold the trainer's start-up until the child has imported torch and loaded the model."""
    import threading

    from agentrl.engines.builtin import EngineStats

    loading = EngineProcess.__new__(EngineProcess)  # a child still loading: not ready, not dead
    loading._ready, loading._dead, loading._start_timeout_s = threading.Event(), None, 0.01
    assert loading.stats() == EngineStats(steps=0, running=0, waiting=0, generated_tokens=0, prefill_tokens=0,
                                          reused_tokens=0, weight_version=0, kv_cache_bytes=0)
