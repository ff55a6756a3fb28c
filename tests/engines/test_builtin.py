"""The built-in engine against a real tiny Qwen2 and a separate full forward of the same weights."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from agentrl.engines._packed import OneDNNLinear
from agentrl.engines.base import Engine, FinishReason, GenerateRequest, SamplingParams
from agentrl.engines.builtin import BuiltinEngine
from agentrl.errors import EngineUnavailable
from enginetest import build_qwen2, load_reference, reference_greedy, reference_logprobs

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

PROMPT = [5, 17, 42, 99, 3, 64, 128, 7]


@pytest.fixture(params=["thread", "event_loop", "onednn"])
def engine(model_dir, request):
    """Every behaviour holds wherever the steps run (a background thread or the caller's loop) and
    with every linear layer through oneDNN copies of the weights (which the engine only uses for
    weights far larger than this test model's)."""
    engine = BuiltinEngine(model_dir, max_batch_size=8, seed=0, steps_on="thread" if request.param == "onednn" else request.param)
    if request.param == "onednn":
        engine._scheduler.forward.linear = OneDNNLinear(min_weight_elements=0)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def reference(model_dir):
    return load_reference(model_dir)


def greedy(n: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, **kwargs)


async def wait_for_steps(engine: BuiltinEngine, steps: int) -> None:
    """Poll the engine's own step counter (not wall-clock time)."""
    for _ in range(100_000):
        if engine.stats().steps >= steps:
            return
        await asyncio.sleep(0.0005)
    raise AssertionError(f"engine did not reach {steps} steps")


async def submit_together(engine: BuiltinEngine, requests: list[GenerateRequest]) -> list[asyncio.Task]:
    """Submit all requests before the worker can take any: a worker thread already running may
    otherwise start a step between two submissions (a CI run saw the last request of a batch miss
    the first step). The engine's condition lock is reentrant and every submission runs on this
    thread, so holding it keeps only the worker thread out until all are queued."""
    queued = len(engine._inbox)
    with engine._cv:
        tasks = [asyncio.create_task(engine.generate(r)) for r in requests]
        while len(engine._inbox) < queued + len(requests):
            await asyncio.sleep(0)
    return tasks


async def submitted_together(engine: BuiltinEngine, requests: list[GenerateRequest]) -> list:
    return await asyncio.gather(*await submit_together(engine, requests))


async def wait_until_all_admitted(engine: BuiltinEngine, steps: int) -> None:
    """``steps`` steps have run and no request waits: a request still in the inbox would otherwise
    join whatever the test submits next (a CI run saw eleven of twelve background requests, queued
    while the worker stepped the first one, admitted in the same step as a later group)."""
    for _ in range(100_000):
        stats = engine.stats()
        if stats.steps >= steps and stats.waiting == 0:
            return
        await asyncio.sleep(0.0005)
    raise AssertionError(f"engine did not reach {steps} steps with every request admitted")


def test_builtin_engine_satisfies_the_engine_protocol(engine):
    assert isinstance(engine, Engine)


async def test_greedy_output_is_the_argmax_chain_of_a_full_forward(engine, reference):
    result = await engine.generate(GenerateRequest(PROMPT, greedy(12)))
    assert result.output_ids == reference_greedy(reference, PROMPT, 12)
    assert result.finish_reason is FinishReason.LENGTH
    assert result.prompt_tokens == len(PROMPT)
    expected = reference_logprobs(reference, PROMPT, result.output_ids, temperature=0.0)
    assert result.logprobs == pytest.approx(expected, abs=1e-5)


async def test_top_k_one_samples_the_greedy_tokens(engine):
    greedy_result = await engine.generate(GenerateRequest(PROMPT, greedy(10)))
    top1 = await engine.generate(GenerateRequest(PROMPT, SamplingParams(max_new_tokens=10, temperature=1.3, top_k=1, seed=7)))
    assert top1.output_ids == greedy_result.output_ids


async def test_stop_token_ends_generation_and_is_kept_in_the_output(engine):
    free_run = (await engine.generate(GenerateRequest(PROMPT, greedy(10)))).output_ids
    stop = free_run[3]
    first = free_run.index(stop)
    result = await engine.generate(GenerateRequest(PROMPT, greedy(10, stop_token_ids=(stop, 255))))
    assert result.output_ids == free_run[: first + 1]
    assert result.finish_reason is FinishReason.STOP
    assert result.matched_stop == stop
    assert len(result.logprobs) == first + 1


async def test_max_new_tokens_bounds_the_output(engine):
    results = await asyncio.gather(*(engine.generate(GenerateRequest(PROMPT, greedy(n))) for n in (1, 4, 9)))
    assert [len(r.output_ids) for r in results] == [1, 4, 9]
    assert all(r.finish_reason is FinishReason.LENGTH for r in results)
    assert results[2].output_ids[:4] == results[1].output_ids


async def test_zero_max_new_tokens_returns_an_empty_length_result(engine):
    result = await engine.generate(GenerateRequest(PROMPT, greedy(0)))
    assert (result.output_ids, result.logprobs, result.finish_reason) == ([], [], FinishReason.LENGTH)


async def test_logprobs_match_a_full_forward_when_requests_join_mid_decode(engine, reference):
    long_request = GenerateRequest(list(range(1, 30)), SamplingParams(max_new_tokens=60, temperature=1.0, seed=1), rid="long")
    joiners = [
        GenerateRequest([9, 8, 7], SamplingParams(max_new_tokens=20, temperature=0.7, top_p=0.9, seed=2), rid="short"),
        GenerateRequest(list(range(40, 90)), SamplingParams(max_new_tokens=15, temperature=1.5, top_k=20, seed=3), rid="mid"),
        GenerateRequest([200, 201], greedy(25), rid="greedy"),
    ]
    long_task = asyncio.create_task(engine.generate(long_request))
    await wait_for_steps(engine, 5)
    joined = await asyncio.gather(*(engine.generate(r) for r in joiners))
    results = [await long_task, *joined]
    for request, result in zip([long_request, *joiners], results):
        expected = reference_logprobs(reference, request.input_ids, result.output_ids, request.sampling.temperature)
        assert result.logprobs == pytest.approx(expected, abs=1e-5), request.rid
    assert results[3].output_ids == reference_greedy(reference, [200, 201], 25)


async def test_a_request_is_admitted_while_another_is_decoding(engine):
    first = asyncio.create_task(engine.generate(GenerateRequest(PROMPT, greedy(80), rid="first")))
    await wait_for_steps(engine, 3)
    second = await engine.generate(GenerateRequest([1, 2, 3], greedy(5), rid="second"))
    assert not first.done()  # the second finished while the first was still generating
    await first
    log = list(engine.step_log)
    admitted_at = next(r for r in log if "second" in r.prefill_rids)
    first_done_at = next(r for r in log if "first" in r.finished_rids)
    assert "first" in admitted_at.decode_rids  # joined a step in which "first" decoded
    assert admitted_at.step < first_done_at.step
    assert len(second.output_ids) == 5


async def test_seeded_sampling_repeats_exactly(engine):
    def batch():
        return [
            GenerateRequest(PROMPT, SamplingParams(max_new_tokens=16, temperature=1.0, seed=11)),
            GenerateRequest(PROMPT[:3], SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.7, seed=12)),
        ]

    first = await asyncio.gather(*(engine.generate(r) for r in batch()))
    second = await asyncio.gather(*(engine.generate(r) for r in batch()))
    assert [r.output_ids for r in first] == [r.output_ids for r in second]
    # The second run reuses the first run's retained K/V, so logprobs agree to rounding only.
    for a, b in zip(first, second):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    other_seed = await engine.generate(GenerateRequest(PROMPT, SamplingParams(max_new_tokens=16, temperature=1.0, seed=99)))
    assert other_seed.output_ids != first[0].output_ids


async def test_unseeded_requests_follow_the_engine_seed(model_dir):
    outputs = []
    for _ in range(2):
        engine = BuiltinEngine(model_dir, max_batch_size=4, seed=5)
        outputs.append((await engine.generate(GenerateRequest(PROMPT, SamplingParams(max_new_tokens=12)))).output_ids)
        engine.close()
    assert outputs[0] == outputs[1]


async def test_next_turn_reuses_the_retained_prefix_and_matches_a_full_forward(engine, reference):
    turn1 = await engine.generate(GenerateRequest(PROMPT, SamplingParams(max_new_tokens=10, temperature=1.0, seed=4)))
    history = PROMPT + turn1.output_ids + [77, 78, 79]  # the observation of a tool call
    turn2 = await engine.generate(GenerateRequest(history, SamplingParams(max_new_tokens=10, temperature=1.0, seed=5)))
    # Everything but the last sampled token of turn 1 already had K/V in the slot.
    assert turn2.cached_tokens == len(PROMPT) + len(turn1.output_ids) - 1
    assert turn2.logprobs == pytest.approx(reference_logprobs(reference, history, turn2.output_ids, 1.0), abs=1e-5)
    # A different continuation of the same prompt copies the shared prefix into a new slot.
    branch = await engine.generate(GenerateRequest(PROMPT + [1, 2], greedy(6)))
    assert branch.cached_tokens == len(PROMPT)
    assert branch.output_ids == reference_greedy(reference, PROMPT + [1, 2], 6)


async def test_samples_of_one_prompt_arriving_together_prefill_it_once(engine, reference):
    """A GRPO group: n samples of the same prompt submitted at once, all admitted in one step.
    The first computes the prompt; the others copy its K/V inside the step, right after each
    layer writes it (all but the last prompt token, which each computes for its own next-token
    logits). Outputs keep the exact logprobs."""
    prompt = list(range(30, 50))
    other = [200, 201, 202]  # unrelated and short: computed in full
    requests = [GenerateRequest(prompt, SamplingParams(max_new_tokens=6, temperature=1.0, seed=s), rid=f"s{s}") for s in range(6)]
    requests.append(GenerateRequest(other, greedy(4), rid="other"))
    results = await submitted_together(engine, requests)
    log = list(engine.step_log)
    assert set(log[0].prefill_rids) == {f"s{s}" for s in range(6)} | {"other"}
    assert log[0].prefill_tokens == len(prompt) + 5 + len(other)
    assert log[0].reused_tokens == 5 * (len(prompt) - 1)
    assert [r.cached_tokens for r in results] == [0] + [len(prompt) - 1] * 5 + [0]
    for request, result in zip(requests, results):
        expected = reference_logprobs(reference, request.input_ids, result.output_ids, request.sampling.temperature)
        assert result.logprobs == pytest.approx(expected, abs=1e-5), request.rid
    assert len({tuple(r.output_ids) for r in results[:6]}) > 1  # different seeds, different samples


async def test_state_dict_update_changes_outputs_to_the_new_weights(engine, other_model_dir):
    before = await engine.generate(GenerateRequest(PROMPT, greedy(12)))
    new_model = load_reference(other_model_dir)
    state = {k: v for k, v in new_model.state_dict().items() if k != "lm_head.weight"}  # tied: one name is enough
    await engine.update_weights(state)
    after = await engine.generate(GenerateRequest(PROMPT, greedy(12)))
    assert after.output_ids == reference_greedy(new_model, PROMPT, 12)
    assert after.output_ids != before.output_ids
    assert (before.weight_version, after.weight_version) == (0, 1)
    assert after.logprobs == pytest.approx(reference_logprobs(new_model, PROMPT, after.output_ids, 0.0), abs=1e-5)


async def test_update_from_disk_loads_a_save_pretrained_directory(engine, other_model_dir):
    await engine.update_weights(path=str(other_model_dir), version=7)
    result = await engine.generate(GenerateRequest(PROMPT, greedy(12)))
    assert result.output_ids == reference_greedy(load_reference(other_model_dir), PROMPT, 12)
    assert result.weight_version == 7


async def test_update_drops_retained_prefixes_computed_with_old_weights(engine, other_model_dir):
    turn1 = await engine.generate(GenerateRequest(PROMPT, greedy(5)))
    await engine.update_weights(path=str(other_model_dir))
    history = PROMPT + turn1.output_ids
    turn2 = await engine.generate(GenerateRequest(history, greedy(5)))
    assert turn2.cached_tokens == 0
    assert turn2.output_ids == reference_greedy(load_reference(other_model_dir), history, 5)


async def test_update_drains_running_requests_under_the_old_weights(engine, reference, other_model_dir):
    running = asyncio.create_task(engine.generate(GenerateRequest(PROMPT, greedy(60))))
    await wait_for_steps(engine, 2)
    await engine.update_weights(path=str(other_model_dir))
    old = await running  # already done: the update waited for it
    assert old.weight_version == 0
    assert old.output_ids == reference_greedy(reference, PROMPT, 60)


async def test_bad_state_dict_is_rejected_before_any_weight_changes(engine, other_model_dir):
    before = await engine.generate(GenerateRequest(PROMPT, greedy(8)))
    state = dict(load_reference(other_model_dir).state_dict())
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    state["model.extra.weight"] = torch.zeros(1)
    del state["model.norm.weight"]
    with pytest.raises(ValueError) as info:
        await engine.update_weights(state)
    message = str(info.value)
    assert "unknown key 'model.extra.weight'" in message
    assert "model.layers.0.mlp.up_proj.weight: shape (3, 3)" in message
    assert "no value for model.norm.weight" in message
    after = await engine.generate(GenerateRequest(PROMPT, greedy(8)))
    assert after.output_ids == before.output_ids and after.weight_version == 0


async def test_abort_returns_the_tokens_generated_so_far(engine):
    task = asyncio.create_task(engine.generate(GenerateRequest(PROMPT, greedy(400), rid="doomed")))
    await wait_for_steps(engine, 3)
    await engine.abort("doomed")
    result = await task
    assert result.finish_reason is FinishReason.ABORT
    assert 3 <= len(result.output_ids) < 400
    assert len(result.logprobs) == len(result.output_ids)


async def test_abort_of_a_waiting_request_returns_it_empty(model_dir):
    engine = BuiltinEngine(model_dir, max_batch_size=1)
    try:
        running = asyncio.create_task(engine.generate(GenerateRequest(PROMPT, greedy(200), rid="a")))
        waiting = asyncio.create_task(engine.generate(GenerateRequest(PROMPT, greedy(5), rid="b")))
        await wait_for_steps(engine, 2)
        await engine.abort("b")
        result = await waiting
        assert (result.finish_reason, result.output_ids) == (FinishReason.ABORT, [])
        assert not running.done()
        await engine.abort("a")
        assert (await running).finish_reason is FinishReason.ABORT
    finally:
        engine.close()


async def test_cancelling_the_caller_aborts_the_request(engine):
    task = asyncio.create_task(engine.generate(GenerateRequest(PROMPT, greedy(400), rid="cancelled")))
    await wait_for_steps(engine, 2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(10_000):
        if engine.stats().running == 0:
            break
        await asyncio.sleep(0.001)
    assert engine.stats().running == 0


@pytest.mark.parametrize(
    ("input_ids", "message"),
    [
        ([], "input_ids is empty"),
        ([1, 2, 256], "input_ids[2] = 256 is outside the vocabulary [0, 256)"),
        ([1, -1], "input_ids[1] = -1 is outside the vocabulary"),
        (list(range(200)) * 3, "input_ids has 600 tokens; max_seq_len is 512"),
    ],
)
async def test_invalid_requests_are_rejected_with_a_clear_message(engine, input_ids, message):
    with pytest.raises(ValueError) as info:
        await engine.generate(GenerateRequest(input_ids, greedy(4)))
    assert message in str(info.value)


async def test_generation_stops_at_max_seq_len(model_dir):
    engine = BuiltinEngine(model_dir, max_batch_size=2, max_seq_len=20)
    try:
        result = await engine.generate(GenerateRequest(list(range(15)), greedy(100)))
        assert len(result.output_ids) == 5 and result.finish_reason is FinishReason.LENGTH
    finally:
        engine.close()


async def test_health_reports_false_after_close(model_dir):
    engine = BuiltinEngine(model_dir)
    assert await engine.health()
    engine.close()
    assert not await engine.health()


async def test_an_idle_engine_parks_its_thread_and_the_next_request_restarts_it(model_dir, reference):
    engine = BuiltinEngine(model_dir, idle_exit_s=0.01)
    try:
        first = await engine.generate(GenerateRequest(PROMPT, greedy(6)))
        for _ in range(200):  # the worker exits on its own once idle
            if not engine.worker_running:
                break
            await asyncio.sleep(0.01)
        assert not engine.worker_running
        assert await engine.health()  # parked is healthy: the next call starts a worker
        second = await engine.generate(GenerateRequest(PROMPT + first.output_ids, greedy(6)))  # served: restarted
        assert second.output_ids == reference_greedy(reference, PROMPT, 12)[6:]
        assert second.cached_tokens == len(PROMPT) + 5  # the parked engine kept its retained K/V
    finally:
        engine.close()
    assert not await engine.health()
    with pytest.raises(EngineUnavailable):
        await engine.generate(GenerateRequest(PROMPT, greedy(2)))


async def test_group_samples_copy_the_prompt_from_their_leader_not_the_head_of_running_requests_alike(model_dir, reference):
    """Twelve running requests start like the group's prompt (one chat template head). The
    leader copies that head from one of them; the followers, admitted in the same step, copy the
    whole prompt (but its last token) from the leader, not just the head."""
    engine = BuiltinEngine(model_dir, max_batch_size=32, seed=0)
    head = [1, 2, 3, 4]
    try:
        background = await submit_together(
            engine, [GenerateRequest(head + [100 + i, 101 + i], greedy(40), rid=f"bg{i}") for i in range(12)]
        )
        await wait_until_all_admitted(engine, 3)
        prompt = head + list(range(150, 170))
        group = [GenerateRequest(prompt, SamplingParams(max_new_tokens=4, temperature=1.0, seed=s), rid=f"s{s}") for s in range(4)]
        results = await submitted_together(engine, group)
        await asyncio.gather(*background)
    finally:
        engine.close()
    assert [r.cached_tokens for r in results] == [len(head)] + [len(prompt) - 1] * 3
    admitted = [rec for rec in engine.step_log if any(rid.startswith("s") for rid in rec.prefill_rids)]
    assert [sorted(rec.prefill_rids) for rec in admitted] == [["s0", "s1", "s2", "s3"]]
    for request, result in zip(group, results):
        expected = reference_logprobs(reference, request.input_ids, result.output_ids, 1.0)
        assert result.logprobs == pytest.approx(expected, abs=1e-5), request.rid


async def test_event_loop_steps_run_on_the_callers_thread_and_match_the_threaded_engine(model_dir, reference):
    threaded = BuiltinEngine(model_dir, max_batch_size=8, seed=0)
    inline = BuiltinEngine(model_dir, max_batch_size=8, seed=0, steps_on="event_loop")
    forward_threads = []
    forward = inline._scheduler.forward
    inline._scheduler.forward = lambda *args: forward_threads.append(threading.get_ident()) or forward(*args)
    requests = [GenerateRequest(PROMPT[: 4 + i], SamplingParams(max_new_tokens=9, temperature=1.0, seed=i)) for i in range(5)]
    try:
        assert not inline.worker_running  # nothing runs before the first call
        ours = await asyncio.gather(*(inline.generate(r) for r in requests))
        theirs = await asyncio.gather(*(threaded.generate(r) for r in requests))
    finally:
        threaded.close()
        inline.close()
    assert [r.output_ids for r in ours] == [r.output_ids for r in theirs]
    for mine, other in zip(ours, theirs):  # the steps may batch differently: equal up to rounding
        assert mine.logprobs == pytest.approx(other.logprobs, abs=1e-5)
    assert len(forward_threads) >= 9 and set(forward_threads) == {threading.get_ident()}
    assert ours[0].logprobs == pytest.approx(reference_logprobs(reference, PROMPT[:4], ours[0].output_ids, 1.0), abs=1e-5)


def test_an_event_loop_that_closes_with_work_left_hands_it_to_a_thread(model_dir, reference):
    """Loop A runs the steps; a request from loop B (another thread) is still decoding when
    ``asyncio.run`` of A returns and cancels the stepping task: a thread finishes B's request."""
    engine = BuiltinEngine(model_dir, max_batch_size=8, seed=0, steps_on="event_loop")
    submitted, results = threading.Event(), []

    def other_loop() -> None:
        async def ask():
            submitted.set()
            return await engine.generate(GenerateRequest(PROMPT, greedy(30)))
        results.append(asyncio.run(ask()))

    async def loop_a() -> None:
        own = asyncio.ensure_future(engine.generate(GenerateRequest(PROMPT[:3], greedy(60))))  # A's task steps
        await wait_for_steps(engine, 1)
        assert isinstance(engine._worker, asyncio.Task)
        thread_b.start()
        submitted.wait(5)
        while engine.stats().running < 2:  # B's request joins the steps A's loop runs
            await asyncio.sleep(0)
        assert not own.done()  # returning cancels it (aborted) and the stepping task

    thread_b = threading.Thread(target=other_loop)
    try:
        asyncio.run(loop_a())
        thread_b.join(30)
        assert not thread_b.is_alive()
    finally:
        engine.close()
    assert results[0].output_ids == reference_greedy(reference, PROMPT, 30)
    assert results[0].finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("step", ["in_place", "fused_adamw"])
async def test_a_shared_module_changed_in_place_serves_the_new_weights_after_weights_changed(model_dir, step):
    """A colocated trainer hands its own module to the engine: nothing is copied at a sync, the
    next request sees the changed parameters, and prefixes cached under the old ones are gone.
    The layers go through oneDNN copies of the weights, which must follow: torch's fused AdamW
    (the trainer's optimizer) changes parameters without moving their version counters."""
    model = load_reference(model_dir)
    engine = BuiltinEngine(model, max_batch_size=4, seed=0, steps_on="event_loop")
    engine._scheduler.forward.linear = OneDNNLinear(min_weight_elements=0)
    try:
        before = await engine.generate(GenerateRequest(PROMPT, greedy(8)))
        if step == "in_place":
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.neg_()  # the owner's optimizer step, in place
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
            model(torch.tensor([PROMPT])).logits.logsumexp(-1).sum().backward()
            optimizer.step()
        changed = load_reference(model_dir)
        changed.load_state_dict(model.state_dict())
        running = asyncio.ensure_future(engine.generate(GenerateRequest(PROMPT, greedy(200))))
        await wait_for_steps(engine, engine.stats().steps + 1)
        with pytest.raises(RuntimeError, match="requests are running"):
            await engine.weights_changed(version=7)
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await engine.weights_changed(version=7)
        after = await engine.generate(GenerateRequest(PROMPT + before.output_ids[:3], greedy(8)))
    finally:
        engine.close()
    assert engine.weight_version == 7 and after.weight_version == 7
    assert after.cached_tokens == 0  # the K/V retained under the old weights was dropped
    assert after.output_ids == reference_greedy(changed, PROMPT + before.output_ids[:3], 8)
    expected = reference_logprobs(changed, PROMPT + before.output_ids[:3], after.output_ids, temperature=0.0)
    assert after.logprobs == pytest.approx(expected, abs=1e-5)


async def test_in_step_copies_chain_through_requests_that_copied_their_own_prefix(engine, reference):
    """Two groups whose prompts share a 10-token head, all six requests in one step: A0 computes
    its prompt, A1 and A2 copy it; B0 copies the head from A2 (which itself got it by copy in
    this step, so it comes from A0) and computes its own tail; B1 and B2 copy B0's prompt, its
    head again from A0. Every output keeps the exact logprobs."""
    head = list(range(60, 70))
    a, b = head + list(range(100, 110)), head + list(range(120, 130))
    requests = [
        GenerateRequest(prompt, SamplingParams(max_new_tokens=5, temperature=1.0, seed=i), rid=f"{name}{i}")
        for name, prompt in (("a", a), ("b", b)) for i in range(3)
    ]
    results = await submitted_together(engine, requests)
    first = engine.step_log[0]
    assert len(first.prefill_rids) == 6
    assert first.prefill_tokens == len(a) + 1 + 1 + (len(b) - len(head)) + 1 + 1
    assert [r.cached_tokens for r in results] == [0, len(a) - 1, len(a) - 1, len(head), len(b) - 1, len(b) - 1]
    for request, result in zip(requests, results):
        expected = reference_logprobs(reference, request.input_ids, result.output_ids, request.sampling.temperature)
        assert result.logprobs == pytest.approx(expected, abs=1e-5), request.rid


async def test_stop_strings_end_generation_at_the_token_that_completes_them(tiny_model_dir):
    """On the tiny model's own vocabulary: a stop string split across two tokens (it starts inside
    one), and one spanning eight; the output is the free run's tokens up to the one whose decoding
    first contains the string (found here by decoding every prefix whole), logprobs included."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = BuiltinEngine(tiny_model_dir, max_batch_size=4, seed=0)  # the tokenizer comes from the directory
    try:
        prompt = tok.encode("What is 12 * 34?")
        sampling = SamplingParams(max_new_tokens=24, temperature=1.0, seed=3)
        free = await engine.generate(GenerateRequest(prompt, sampling))
        texts = [tok.decode([t]) for t in free.output_ids]
        i = next(i for i in range(2, 20) if len(texts[i].strip()) >= 3 and len(texts[i + 1].strip()) >= 3 and "\ufffd" not in texts[i] + texts[i + 1])
        split = texts[i][-2:] + texts[i + 1][:2]  # ends inside token i + 1, starts inside token i
        long = tok.decode(free.output_ids[i - 2 : i + 6])  # eight tokens' text
        for stop in (split, long):
            k = next(k for k in range(1, 25) if stop in tok.decode(free.output_ids[:k]))
            assert k == (i + 2 if stop == split else i + 6)  # the completing token, not an earlier match
            result = await engine.generate(GenerateRequest(prompt, SamplingParams(max_new_tokens=24, temperature=1.0, seed=3, stop=(stop, "never sampled"))))
            assert result.output_ids == free.output_ids[:k]
            assert result.logprobs == pytest.approx(free.logprobs[:k], abs=1e-5)  # the second run reuses the cached prompt
            assert (result.finish_reason, result.matched_stop) == (FinishReason.STOP, stop)
    finally:
        engine.close()


async def test_stop_strings_without_a_tokenizer_are_refused(model_dir):
    from agentrl.errors import EngineError

    engine = BuiltinEngine(build_qwen2(seed=0), max_batch_size=2, seed=0)  # a module with no directory behind it
    try:
        with pytest.raises(EngineError, match="stop strings need a tokenizer"):
            await engine.generate(GenerateRequest(PROMPT, greedy(4, stop=("x",))))
    finally:
        engine.close()
