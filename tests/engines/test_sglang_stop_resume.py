"""A stop string split across an interruption (partial rollouts) ends the request where an
uninterrupted one ends: the same tokens, the completing token kept, finish reason ``stop`` and
the matched string.

On SGLang an interrupted request is sent again as prompt + tokens so far, and a server checks
stop strings against the new piece's text only; ``SGLangEngine`` checks the joined output. The
server here is `agentrl serve`'s app in this process (httpx's ASGI transport), whose engine
checks stop strings the same way. The built-in engine interrupts inside one engine and keeps
checking the whole output.

The model is the shipped calculator model (greedy, real tokenizer), whose output for the prompt
below begins ``####<tool_call>\\n{"argumentscalculator...",`` token by token (asserted). The
interruption lands after a chosen token: the served engine's stop-string check (a decode per
sampled token) holds its worker thread at that token until the weight update has asked for the
abort.
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from agentrl.engines.base import FinishReason, GenerateRequest, GenerateResult, SamplingParams
from agentrl.engines.builtin import BuiltinEngine
from agentrl.engines.serve import build_app
from agentrl.engines.sglang import SGLangEngine
from agentrl.errors import EngineError

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

QUESTION = "Compute 7 + 8 * 3."
BUDGET = 40
# the first tokens of the greedy output, one string per token
OPENING = ["####", "<tool_call>", "\n", '{"', "arguments", "calculator", "calculator", "calculator", "calculator", '",', '"}}', "\n"]


class PausingTokenizer:
    """The model's tokenizer for an engine's stop-string check, which decodes once per sampled
    token: ``pause_at(n)`` holds the caller (the engine's worker thread, inside its step) at the
    n-th decode from then on, after the n-th token, until ``release``."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.left: int | None = None
        self.reached = threading.Event()
        self.released = threading.Event()

    def pause_at(self, n: int) -> None:
        self.left = n

    async def wait_paused(self) -> None:
        assert await asyncio.to_thread(self.reached.wait, 30), "the engine never reached the chosen token"

    def release(self) -> None:
        self.released.set()

    def decode(self, ids, **kwargs) -> str:
        if self.left is not None:
            self.left -= 1
            if self.left == 0:
                self.left = None
                self.reached.set()
                self.released.wait(30)
        return self.tokenizer.decode(ids, **kwargs)


class Served:
    """`agentrl serve` over the built-in engine through an ASGI transport that records the
    /generate calls (prompt length, max_new_tokens) and says when the server was asked to abort
    its requests."""

    def __init__(self, model_dir, tokenizer):
        self.pausing = PausingTokenizer(tokenizer)
        self.engine = BuiltinEngine(model_dir, max_batch_size=4, seed=0, tokenizer=self.pausing)
        self.aborting = asyncio.Event()
        abort_all = self.engine.abort_all

        async def abort_all_and_say_so() -> None:
            await abort_all()
            self.aborting.set()

        self.engine.abort_all = abort_all_and_say_so  # type: ignore[method-assign]
        self.generates: list[tuple[int, int]] = []
        app = build_app(self.engine, str(model_dir), tokenizer=tokenizer)
        served = self

        class Recording(httpx.ASGITransport):
            async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
                if request.url.path == "/generate":
                    body = json.loads(request.content)
                    served.generates.append((len(body["input_ids"]), body["sampling_params"]["max_new_tokens"]))
                return await super().handle_async_request(request)

        self.transport = Recording(app=app)

    def client(self, **kwargs) -> SGLangEngine:
        return SGLangEngine(["http://served"], transport=self.transport, **kwargs)


@pytest.fixture
def served(skilled_model_dir, tokenizer):
    server = Served(skilled_model_dir, tokenizer)
    yield server
    server.engine.close()


@pytest.fixture(scope="module")
def tokenizer(skilled_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(skilled_model_dir)


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    messages = [{"role": "user", "content": QUESTION}]
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


def greedy(*stop: str) -> SamplingParams:
    return SamplingParams(max_new_tokens=BUDGET, temperature=0.0, stop=stop)


async def interrupted(served: Served, client: SGLangEngine, prompt: list[int], sampling: SamplingParams, at: int,
                      model_dir) -> GenerateResult:
    """``client.generate`` with a weight update (the same weights, version 1) that aborts the
    served request right after its ``at``-th token."""
    served.pausing.pause_at(at)
    running = asyncio.create_task(client.generate(GenerateRequest(prompt, sampling, rid="r")))
    await served.pausing.wait_paused()
    update = asyncio.create_task(client.update_weights(path=str(model_dir), version=1))
    await served.aborting.wait()
    served.pausing.release()
    result = await running
    await update
    return result


@pytest.mark.parametrize(
    ("stop", "at", "ends_at"),
    [
        ('"}}\n', 11, 12),  # the tool call's closing '"}}' sampled before the interruption, its newline after
        ('or",', 9, 10),  # begins inside the token before the interruption ("calculator"), ends inside the next
        ('<tool_call>\n{"argumentscalculatorcalculator', 4, 7),  # six tokens, three of them after the interruption
    ],
)
async def test_a_stop_string_split_by_an_interruption_ends_the_resumed_request_where_an_uninterrupted_one_ends(
    served, skilled_model_dir, prompt, tokenizer, stop, at, ends_at
):
    plain = served.client()
    partial = served.client(partial=True, tokenizer=tokenizer)
    try:
        free = await plain.generate(GenerateRequest(prompt, greedy()))
        expected = await plain.generate(GenerateRequest(prompt, greedy(stop, "~~")))
        served.generates.clear()
        result = await interrupted(served, partial, prompt, greedy(stop, "~~"), at, skilled_model_dir)
    finally:
        await plain.aclose()
        await partial.aclose()
    assert [tokenizer.decode([t]) for t in free.output_ids[: len(OPENING)]] == OPENING
    assert (len(free.output_ids), free.finish_reason) == (BUDGET, FinishReason.LENGTH)
    # the hand-found completing token: the stop string is in the first ends_at tokens' text, not in fewer
    assert stop in tokenizer.decode(free.output_ids[:ends_at]) and stop not in tokenizer.decode(free.output_ids[: ends_at - 1])
    assert expected.output_ids == free.output_ids[:ends_at]
    assert (expected.finish_reason, expected.matched_stop) == (FinishReason.STOP, stop)
    assert (partial.interrupted_requests, partial.resumed_requests) == (1, 1)
    assert result.output_ids == expected.output_ids
    assert (result.finish_reason, result.matched_stop) == (FinishReason.STOP, stop)
    assert result.logprobs == pytest.approx(expected.logprobs, abs=1e-5)
    assert result.output_versions == [0] * at + [1] * (ends_at - at) and result.weight_version == 1
    # the first piece, then a short one (the output ended inside the stop string: 4 * len + 2
    # tokens) where the budget left is larger
    window = 4 * len(stop) + 2
    assert served.generates == [(len(prompt), BUDGET), (len(prompt) + at, min(window, BUDGET - at))]


async def test_an_open_stop_prefix_that_the_resumed_text_does_not_complete_costs_one_short_piece(
    served, skilled_model_dir, prompt, tokenizer
):
    """The output ends with '"}}' at the interruption, the start of the stop string '}}X' (never
    sampled): a short piece of 4 * 3 + 2 tokens, then the rest of the budget, joined into the
    uninterrupted output."""
    partial = served.client(partial=True, tokenizer=tokenizer)
    try:
        free = await partial.generate(GenerateRequest(prompt, greedy()))
        served.generates.clear()
        result = await interrupted(served, partial, prompt, greedy("}}X"), 11, skilled_model_dir)
    finally:
        await partial.aclose()
    assert tokenizer.decode(free.output_ids[:11]).endswith('"}}')
    assert (result.output_ids, result.finish_reason, result.matched_stop) == (free.output_ids, FinishReason.LENGTH, None)
    assert result.output_versions == [0] * 11 + [1] * (BUDGET - 11)
    assert served.generates == [(len(prompt), BUDGET), (len(prompt) + 11, 14), (len(prompt) + 25, BUDGET - 25)]
    assert (partial.interrupted_requests, partial.resumed_requests) == (1, 1)  # the third piece is no resumption


async def test_a_stop_string_the_aborted_piece_completed_with_its_last_token_ends_the_request(tokenizer):
    """SGLang reports ``abort`` for a request aborted as it sampled the token completing a stop
    string: the client sees the stop and does not resume (a scripted server)."""
    tokens = tokenizer.encode('####<tool_call>\n{"arguments')
    updating = asyncio.Event()
    generates: list[dict] = []

    async def server(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/update_weights_from_disk":
            updating.set()
            return httpx.Response(200, json={"success": True, "message": ""})
        generates.append(json.loads(request.content))
        await updating.wait()
        meta = {"finish_reason": {"type": "abort"}, "output_token_logprobs": [[-0.5, t, None] for t in tokens],
                "prompt_tokens": 3, "weight_version": "0"}
        return httpx.Response(200, json={"output_ids": tokens, "meta_info": meta})

    engine = SGLangEngine(["http://s"], transport=httpx.MockTransport(server), partial=True, tokenizer=tokenizer)
    try:
        running = asyncio.create_task(engine.generate(GenerateRequest([1, 2, 3], greedy("call>\n{"))))
        while not generates:
            await asyncio.sleep(0.001)
        await engine.update_weights(path="/w", version=1)
        result = await running
    finally:
        await engine.aclose()
    assert (result.output_ids, result.finish_reason, result.matched_stop) == (tokens, FinishReason.STOP, "call>\n{")
    assert len(generates) == 1 and (engine.interrupted_requests, engine.resumed_requests) == (1, 0)


async def test_partial_rollouts_with_stop_strings_refuse_a_request_without_the_tokenizer():
    async def server(request: httpx.Request) -> httpx.Response:
        raise AssertionError("nothing is sent")

    engine = SGLangEngine(["http://s"], transport=httpx.MockTransport(server), partial=True)
    try:
        with pytest.raises(EngineError, match=r"stop strings with partial rollouts need the model's tokenizer.*"
                                              r"SGLangEngine\(\.\.\., tokenizer=\.\.\.\)"):
            await engine.generate(GenerateRequest([1, 2, 3], greedy("x")))
    finally:
        await engine.aclose()


async def test_the_builtin_engine_ends_at_a_stop_string_split_by_an_interruption(skilled_model_dir, prompt, tokenizer):
    """The built-in engine (partial) interrupts inside one engine and checks the whole output: no
    client-side repair needed."""
    from enginetest import load_reference

    state = {k: v.clone() for k, v in load_reference(skilled_model_dir).state_dict().items() if k != "lm_head.weight"}
    pausing = PausingTokenizer(tokenizer)
    engine = BuiltinEngine(skilled_model_dir, max_batch_size=4, seed=0, partial=True, tokenizer=pausing)
    try:
        expected = await engine.generate(GenerateRequest(prompt, greedy('"}}\n')))
        pausing.pause_at(11)
        running = asyncio.create_task(engine.generate(GenerateRequest(prompt, greedy('"}}\n'))))
        await pausing.wait_paused()
        update = asyncio.create_task(engine.update_weights(state, version=1))
        await asyncio.sleep(0)  # the update is queued: the step under way is the last before it
        pausing.release()
        result = await running
        await update
        stats = engine.stats()
    finally:
        engine.close()
    assert len(expected.output_ids) == 12 and (expected.finish_reason, expected.matched_stop) == (FinishReason.STOP, '"}}\n')
    assert (stats.interrupted_requests, stats.resumed_requests) == (1, 1)
    assert result.output_ids == expected.output_ids and result.output_versions == [0] * 11 + [1]
    assert (result.finish_reason, result.matched_stop) == (FinishReason.STOP, '"}}\n')
