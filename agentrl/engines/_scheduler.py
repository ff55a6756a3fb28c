"""The built-in engine's scheduler: the worker's side of ``BuiltinEngine`` (``builtin.py``).

It holds the requests that wait and run, admits waiting ones while there are free slots (up to
``max_batch_size``) and the step's prefill budget (``max_prefill_tokens``) lasts, and runs one
step: one forward over the packed tokens (one decode token per running request followed by the
prompts of the admitted ones, see ``_ragged.py``: no padding, K/V written in place), then one
token sampled per request with its own temperature / top-p / top-k and its own seeded
``torch.Generator`` (``sampling.py``); a request stops on a stop token or on the token that
completes one of its stop strings (kept in the output, like SGLang; ``stops.py``), on
``max_new_tokens`` or when the context reaches ``max_seq_len``. Aborts and weight updates are
applied between steps. Which slot a request takes, and the prefix it reuses there,
``_prefix_cache.py`` decides.

Logprobs follow SGLang (see ``sampling.py``): ``log_softmax(logits / temperature)`` of the sampled
token, before top-k / top-p; ``log_softmax(logits)`` when greedy.

Only the worker (the thread or event-loop task that runs the steps) calls a ``Scheduler``.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from agentrl.engines import _ragged
from agentrl.engines._graphs import StaticDecode
from agentrl.engines._prefix_cache import Slots, longest_shared, resolve_copy
from agentrl.engines.base import FinishReason, GenerateRequest, GenerateResult
from agentrl.engines.sampling import sample_next_tokens
from agentrl.engines.stops import StopStrings
from agentrl.engines.weights import copy_weights_into, read_checkpoint
from agentrl.errors import EngineError

__all__ = ["Scheduler", "Sequence", "StepRecord", "WeightUpdate"]


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one engine step did (kept in ``BuiltinEngine.step_log``)."""

    step: int
    started: float  # time.perf_counter() when the step began
    ended: float  # ... and when its tokens were sampled
    decode_rids: tuple[str, ...]  # requests that decoded one token
    prefill_rids: tuple[str, ...]  # requests admitted (prefilled, first token sampled)
    finished_rids: tuple[str, ...]
    prefill_tokens: int  # prompt tokens computed this step
    reused_tokens: int  # prompt tokens whose K/V came from another slot (retained, running or admitted alongside)
    # What the step's attention must read and compute (the roofline of agentrl bench engine):
    kv_positions: int = 0  # K/V positions attended, each once: every decode row's context with its new token, every prefill span's prefix and tokens
    attended_pairs: int = 0  # (query, key) pairs attended, per layer and query head


@dataclass(eq=False, slots=True)
class Sequence:
    rid: str
    request: GenerateRequest
    tokens: list[int]  # prompt followed by the sampled tokens
    stop_ids: frozenset[int]
    generator: torch.Generator
    resolve: Callable[[GenerateResult | BaseException], None]
    stop_strings: StopStrings | None = None  # the request's stop strings over the model's tokenizer
    slot: int = -1
    cached: int = 0  # tokens whose K/V are in the slot
    reused: int = 0  # prompt tokens whose K/V came from another slot (not computed for this request)
    prefilled: bool = False
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the weight version that sampled each output token
    interruptions: int = 0  # weight updates it was interrupted by and resumed after (partial rollouts)


@dataclass(eq=False, slots=True)
class WeightUpdate:
    state_dict: Mapping[str, torch.Tensor] | None  # neither this nor path: changed in place (shared module)
    path: str | None
    version: int | None
    strict: bool
    resolve: Callable[[object], None]


class Scheduler:
    """Waiting and running requests, admission, and one step at a time over a model's forward."""

    def __init__(
        self,
        model: torch.nn.Module,
        forward: Callable[..., torch.Tensor],
        cache: _ragged.SlotKVCache,
        *,
        device: torch.device,
        vocab_size: int,
        max_seq_len: int,
        max_batch_size: int,
        max_prefill_tokens: int,
        step_log_size: int | None,
        static_decode: StaticDecode | None = None,
    ):
        self.model = model
        self.forward = forward
        self.cache = cache
        self.slots = Slots(cache)
        # decode-only steps on bucket-shaped inputs (CUDA graphs on a GPU); its scratch slot (the
        # cache's last) is never given to a request
        self.static_decode = static_decode
        if static_decode is not None:
            self.slots.empty.remove(static_decode.scratch)  # the largest: the heap stays a heap
        self.device = device
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.weight_version = 0
        self.step_log: deque[StepRecord] = deque(maxlen=step_log_size)
        self.counters = {"steps": 0, "generated": 0, "prefill": 0, "reused": 0, "interrupted": 0, "resumed": 0}
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.busy_s = 0.0  # seconds in steps

    def apply_aborts(self, rids: set[str], everything: bool) -> None:
        hit = lambda seq: everything or seq.rid in rids  # noqa: E731
        for seq in [s for s in self.waiting if hit(s)]:
            self.waiting.remove(seq)
            seq.resolve(self.result(seq, FinishReason.ABORT))
        for seq in [s for s in self.running if hit(s)]:
            self.finish(seq, FinishReason.ABORT)

    def interrupt_running(self) -> None:
        """Partial rollouts: take every running request off its slot before a weight update and
        put it back at the head of the queue, keeping its sampled tokens, logprobs and versions.
        Re-admitted, it is prefilled again (prompt and tokens so far) under the new weights and
        goes on sampling from where it stopped, its ``max_new_tokens`` counted over all its tokens."""
        for seq in reversed(list(self.running)):
            self.running.remove(seq)
            self.slots.release(seq.slot, [])  # its K/V came from the old weights
            seq.slot, seq.cached, seq.reused, seq.prefilled = -1, 0, 0, False
            seq.interruptions += 1
            self.counters["interrupted"] += 1
            self.enqueue(seq, ahead=True)

    def enqueue(self, seq: Sequence, *, ahead: bool = False) -> None:
        """Into the waiting queue, kept in ``request.priority`` order (lowest first): behind the
        requests of its priority, or ``ahead`` of them (one put back by an interruption)."""
        waiting, priority = self.waiting, seq.request.priority
        if not waiting or (waiting[-1].request.priority < priority if ahead else waiting[-1].request.priority <= priority):
            waiting.append(seq)  # the common case: one priority for every request
            return
        at = next(i for i, other in enumerate(waiting)
                  if (other.request.priority >= priority if ahead else other.request.priority > priority))
        waiting.insert(at, seq)

    def apply_update(self, update: WeightUpdate) -> None:
        self.forward.weights_changed()  # before the copy: a failed copy may have written some
        try:
            if update.state_dict is not None:
                copy_weights_into(self.model, update.state_dict, strict=update.strict)
            elif update.path is not None:
                copy_weights_into(self.model, read_checkpoint(update.path), strict=update.strict)
        except Exception as exc:  # a bad update is the caller's error to hear: it must not end the engine's worker
            update.resolve(exc)
            return
        self.slots.drop_retained()
        self.weight_version = update.version if update.version is not None else self.weight_version + 1
        update.resolve(None)

    def admit(self) -> tuple[list[Sequence], list[_ragged.PrefixCopy]]:
        """Requests that join this step, and the prefixes they copy from others joining with them."""
        admitted: list[Sequence] = []
        copies: list[_ragged.PrefixCopy] = []
        copied_from: dict[int, tuple[int, int]] = {}  # slot -> (source slot, length) of its in-step copy
        budget = self.max_prefill_tokens
        live = {seq.slot: seq.tokens[: seq.cached] for seq in self.running if seq.prefilled} if self.waiting else {}
        while self.waiting and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            if admitted and len(seq.tokens) > budget:
                break  # a long prompt waits for the next step rather than stretching this one
            self.waiting.popleft()
            donor, available = self.slots.best_prefix(seq.tokens, live, seq.request.session_id)
            leader, in_step = longest_shared(seq.tokens, [(s.slot, s.tokens) for s in reversed(admitted)], len(seq.tokens) - 1)
            if in_step > available:  # K/V computed (or copied) for the leader in this very step
                seq.slot, _ = self.slots.acquire(None, 0)
                copied_from[seq.slot] = (leader, in_step)
                copies.extend(resolve_copy(seq.slot, leader, in_step, copied_from))
                seq.reused = in_step
            else:
                seq.slot, seq.reused = self.slots.acquire(donor, available)
            seq.cached = seq.reused
            budget -= len(seq.tokens) - seq.reused
            self.running.append(seq)
            admitted.append(seq)
        return admitted, copies

    @torch.inference_mode()
    def step(self, admitted: list[Sequence], copies: list[_ragged.PrefixCopy]) -> None:
        started = time.perf_counter()
        decoding = [seq for seq in self.running if seq.prefilled]
        packed: list[int] = [seq.tokens[-1] for seq in decoding]
        positions: list[int] = [seq.cached for seq in decoding]
        logit_rows = list(range(len(decoding)))
        prefills: list[_ragged.PrefillSpan] = []
        for seq in admitted:
            prompt = seq.tokens[seq.cached :]
            prefills.append(_ragged.PrefillSpan(seq.slot, seq.cached, len(prompt), len(packed)))
            packed.extend(prompt)
            positions.extend(range(seq.cached, len(seq.tokens)))
            logit_rows.append(len(packed) - 1)
        self.cache.ensure_capacity(max(positions) + 1)
        static = self.static_decode is not None and not admitted and not copies
        layout = None if static else _ragged.build_layout(
            self.cache, [s.slot for s in decoding], positions[: len(decoding)], tuple(prefills), self.device, tuple(copies)
        )
        stepping = decoding + admitted
        try:
            tokens, logprobs = self._forward_and_sample(stepping, packed, positions, logit_rows, layout)
        except (RuntimeError, ValueError) as exc:  # fail this step's requests, keep serving the rest
            for seq in stepping:
                self.finish(seq, error=EngineError(f"generation failed for request {seq.rid}: {exc}"))
            return
        finished: list[tuple[Sequence, GenerateResult]] = []
        matched: int | str | None
        self.counters["resumed"] += sum(1 for seq in admitted if seq.interruptions)
        for seq, token, logprob in zip(stepping, tokens, logprobs):
            seq.cached = len(seq.tokens)
            seq.prefilled = True
            seq.tokens.append(token)
            seq.output_ids.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(self.weight_version)
            # Length is checked before stop tokens, as SGLang does: a stop token sampled as the
            # last allowed token ends the request with reason LENGTH.
            if len(seq.output_ids) >= seq.request.sampling.max_new_tokens or len(seq.tokens) >= self.max_seq_len:
                reason, matched = FinishReason.LENGTH, None
            elif token in seq.stop_ids:
                reason, matched = FinishReason.STOP, token
            elif seq.stop_strings is not None and (hit := seq.stop_strings.completed(seq.output_ids)) is not None:
                reason, matched = FinishReason.STOP, hit
            else:
                continue
            self._release(seq)
            finished.append((seq, self.result(seq, reason, matched)))
        prefill_tokens = sum(p.length for p in prefills)
        reused = sum(seq.reused for seq in admitted)
        # a decode row at position p attends p + 1 keys; a span's query i at start + i attends start + i + 1
        decode_keys = sum(positions[: len(decoding)]) + len(decoding)
        span_keys = sum(p.start + p.length for p in prefills)
        span_pairs = sum(p.length * p.start + p.length * (p.length + 1) // 2 for p in prefills)
        counters = self.counters
        counters["steps"] += 1
        counters["generated"] += len(stepping)
        counters["prefill"] += prefill_tokens
        counters["reused"] += reused
        ended = time.perf_counter()
        self.busy_s += ended - started
        self.step_log.append(
            StepRecord(
                step=counters["steps"],
                started=started,
                ended=ended,
                decode_rids=tuple(s.rid for s in decoding),
                prefill_rids=tuple(s.rid for s in admitted),
                finished_rids=tuple(seq.rid for seq, _ in finished),
                prefill_tokens=prefill_tokens,
                reused_tokens=reused,
                kv_positions=decode_keys + span_keys,
                attended_pairs=decode_keys + span_pairs,
            )
        )
        for seq, result in finished:  # after the step is logged, so a caller that awaited sees it
            seq.resolve(result)

    def _forward_and_sample(
        self,
        stepping: list[Sequence],
        packed: list[int],
        positions: list[int],
        logit_rows: list[int],
        layout: _ragged.StepLayout | None,
    ) -> tuple[list[int], list[float]]:
        device = self.device
        if layout is None:  # a decode-only step on the static path
            assert self.static_decode is not None
            logits = self.static_decode(packed, positions, [seq.slot for seq in stepping])  # [n, vocab] float32
        else:
            rows = torch.tensor(logit_rows, device=device) if len(logit_rows) != len(packed) else None
            logits = self.forward(
                torch.tensor(packed, device=device), torch.tensor(positions, device=device), layout, rows
            )  # [n, vocab] float32
        params = [seq.request.sampling for seq in stepping]
        temperatures = [p.temperature for p in params]
        uniforms = [
            0.0 if p.temperature == 0 else float(torch.rand((), generator=seq.generator))
            for p, seq in zip(params, stepping)
        ]
        tokens, logprobs = sample_next_tokens(
            logits,
            torch.tensor(temperatures, device=device),
            torch.tensor([p.top_p for p in params], device=device),
            torch.tensor([p.top_k if p.top_k > 0 else self.vocab_size for p in params], device=device),
            torch.tensor(uniforms, device=device),
        )
        return tokens.tolist(), logprobs.tolist()

    def finish(
        self,
        seq: Sequence,
        reason: FinishReason | None = None,
        *,
        matched: int | str | None = None,
        error: BaseException | None = None,
    ) -> None:
        self._release(seq, keep=error is None)
        seq.resolve(error if error is not None else self.result(seq, reason, matched))

    def _release(self, seq: Sequence, *, keep: bool = True) -> None:
        self.running.remove(seq)
        # Retain the slot's K/V for a later request sharing the prefix (not after a failed step).
        self.slots.release(seq.slot, seq.tokens[: seq.cached] if keep and seq.prefilled else [],
                           session=seq.request.session_id, priority=seq.request.priority)

    def result(self, seq: Sequence, reason: FinishReason, matched: int | str | None = None) -> GenerateResult:
        return GenerateResult(
            output_ids=list(seq.output_ids),
            logprobs=list(seq.logprobs),
            finish_reason=reason,
            matched_stop=matched,
            prompt_tokens=len(seq.request.input_ids),
            weight_version=self.weight_version,
            cached_tokens=seq.reused,
            # a version per token only where they differ (a request resumed across an update)
            output_versions=list(seq.versions) if any(v != self.weight_version for v in seq.versions) else [],
        )
