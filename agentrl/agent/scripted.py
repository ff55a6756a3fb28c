"""``ScriptedEngine``: an engine that answers from a script, for deterministic tests.

Plugin authors test multi-turn loops, tools and interactions without a model::

    engine = ScriptedEngine(tokenizer, {
        "row-0": ['<tool_call>\\n{"name": "calculator", "arguments": {"expression": "2+2"}}\\n</tool_call>',
                  "#### 4"],
    })

Each trajectory (``GenerateRequest.session_id`` = ``"<row_id>#<sample>"``) walks through its
row's list. Stop token ids and stop strings (``SamplingParams.stop``, checked on the decoded
text after every token, as ``agentrl.engines.stops`` describes) end an answer. An entry is text (encoded with the tokenizer, then the chat template's end-of-turn
token appended - as an engine that stopped at end-of-turn returns it) or a list of token
ids (returned as is). A callable script ``script(row_id, call_index, request) -> str | list[int]``
may replace the dict. Every request is kept in ``engine.requests`` (``record_requests=False``
for long runs). When a stop token (e.g. a line break for ReAct) or ``max_new_tokens``
cuts an entry short, the next generate call of that trajectory continues the same entry, as a
model would; a new entry starts when the previous one is used up (an entry cut right before
its final stop token counts as used up, so ReAct scripts can give one entry per step). Every sampled token gets the logprob ``logprob`` (default -0.5);
``max_new_tokens`` truncates with finish reason ``length``. Answers are instant.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Mapping, Sequence

from agentrl.engines.base import FinishReason, GenerateRequest, GenerateResult
from agentrl.engines.stops import StopStrings
from agentrl.errors import EngineError

__all__ = ["ScriptedEngine"]

Script = Mapping[str, Sequence["str | list[int]"]] | Callable[[str, int, GenerateRequest], "str | list[int]"]


class ScriptedEngine:
    def __init__(
        self, tokenizer: Any, script: Script, *, logprob: float = -0.5, stop_token: str | None = None,
        record_requests: bool = True,
    ):
        self.tokenizer = tokenizer
        self.record_requests = record_requests  # keep every request in ``requests`` (tests read them)
        self.script = script
        self.logprob = logprob
        # a scripted text ends with the family's end-of-turn token, as a model stopping there
        # returns it (``<|eot_id|>``, ``<end_of_turn>``, Phi's ``<|end|>``: not always the eos)
        self.stop_id = tokenizer.convert_tokens_to_ids(stop_token or _end_of_turn(tokenizer))
        self.calls: dict[str, int] = defaultdict(int)
        self.requests: list[GenerateRequest] = []
        self.weight_version = 0
        self._encoded: dict[str, list[int]] = {}
        self._pending: dict[str, list[int]] = {}

    def _answer(self, row_id: str, index: int, request: GenerateRequest) -> "str | list[int]":
        if callable(self.script):
            return self.script(row_id, index, request)
        answers = self.script.get(row_id)
        if answers is None:
            raise EngineError(f"ScriptedEngine has no script for row {row_id!r}")
        if index >= len(answers):
            raise EngineError(f"ScriptedEngine: row {row_id!r} has {len(answers)} scripted answers, asked for answer {index + 1}")
        return answers[index]

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if self.record_requests:
            self.requests.append(request)
        session = request.session_id or ""
        ids = self._pending.pop(session, None)
        if not ids:
            row_id = session.rsplit("#", 1)[0]
            index = self.calls[session]
            self.calls[session] += 1
            answer = self._answer(row_id, index, request)
            if isinstance(answer, str):
                if answer not in self._encoded:
                    self._encoded[answer] = self.tokenizer.encode(answer, add_special_tokens=False) + [self.stop_id]
                ids = self._encoded[answer]
            else:
                ids = list(answer)
        limit = request.sampling.max_new_tokens
        stops = set(request.sampling.stop_token_ids)
        strings = StopStrings(request.sampling.stop, lambda t: self.tokenizer.decode(t, skip_special_tokens=False))
        cut, matched_stop = None, None
        for i, t in enumerate(ids):  # as an engine checks: after every sampled token
            matched_stop = t if t in stops else strings.completed(ids[: i + 1]) if strings else None
            if matched_stop is not None:
                cut = i + 1
                break
        if cut is not None and cut <= limit:
            out, reason, matched = ids[:cut], FinishReason.STOP, matched_stop
        elif len(ids) > limit:
            out, reason, matched = ids[:limit], FinishReason.LENGTH, None
        else:
            out, reason, matched = ids, FinishReason.LENGTH, None
        rest = ids[len(out) :]
        # an entry cut just before its own stop token is used up (a ReAct line ending in "\n")
        if rest and rest != [self.stop_id]:
            self._pending[session] = rest
        return GenerateResult(
            output_ids=list(out), logprobs=[self.logprob] * len(out), finish_reason=reason, matched_stop=matched,
            prompt_tokens=len(request.input_ids), weight_version=self.weight_version,
        )

    async def abort(self, rid: str) -> None:
        return None

    async def update_weights(
        self, state_dict: Mapping[str, Any] | None = None, *, path: str | None = None, version: int | None = None
    ) -> None:
        self.weight_version = version if version is not None else self.weight_version + 1

    async def health(self) -> bool:
        return True


def _end_of_turn(tokenizer: Any) -> str:
    if not getattr(tokenizer, "chat_template", None):
        return str(tokenizer.eos_token)
    from agentrl.agent.families import family_renderer

    return str(family_renderer(tokenizer).eos_token)
