"""Histories as the model sees them at inference (``agent.history``).

A trajectory is the token stream the model sampled and saw. For an *append-only* chat template
(rendering a conversation is a prefix of rendering any continuation of it) that stream is also
what a server applying the template at inference gives the model for every request. Other
templates rewrite the history as the conversation goes on: Qwen3, QwQ and DeepSeek-R1 drop the
``<think>`` blocks of assistant turns before the last user turn, gpt-oss's harmony template drops
the analysis of turns that ended in a final answer, Mistral-Nemo moves the system message and the
tools block to the last user turn. A policy trained on the append-only stream of such a template
learns from contexts it is never deployed on.

Two policies:

* ``as_sampled``: one append-only stream, whatever the template does (the stream is what the
  model saw while sampling; ``Trajectory.messages`` is a record, not a recipe for the tokens);
* ``as_template`` (the default): every request is the template's own rendering of the messages so
  far, with the generation prompt - what SGLang or vLLM would be given. Where appending the new
  messages' delta to the stream gives that rendering (always, for an append-only template), the
  stream goes on; where the template rewrote something, the stream so far becomes an *earlier
  segment* (exact as sampled, under its own prompt) and a new segment starts from the fresh
  rendering. The trainer trains every segment with the trajectory's advantage, sharing their
  common prefixes (``agentrl.trainer.packed``).

The comparison is on text, not on token ids: a turn the template keeps verbatim stays as sampled
even where the model chose a tokenization of its text that the tokenizer would not, so only a
rewrite of the history starts a segment. The new segment's prompt is the tokenizer's encoding of
the fresh rendering, as a server would tokenize it.

An append-only template is not rendered afresh (its stream is its rendering by construction), so
there each assistant turn stays as sampled even where a server would re-render the parsed message
differently (a call written with other whitespace or key order than the template's ``tojson``, a
stop string cut from the content): a choice for the sampled text where it is the model's own, at
no cost per observation. Templates that rewrite are compared in full, so there such a turn starts
a segment too.
"""

from __future__ import annotations

from typing import Any, Literal, Sequence, get_args

from agentrl.agent.render import ChatRenderer

__all__ = ["HistoryPolicy", "HISTORY_POLICIES", "rewrites_history", "fresh_request"]

HistoryPolicy = Literal["as_sampled", "as_template"]
HISTORY_POLICIES: tuple[str, ...] = get_args(HistoryPolicy)


def rewrites_history(renderer: ChatRenderer) -> bool:
    """Whether the template may render an earlier part of a conversation differently once it goes
    on (not append-only, or it moves the first request's prompt): only then can ``as_template``
    differ from ``as_sampled``, and only then is the fresh rendering worth its cost."""
    return not renderer.append_only or renderer.prompt_move is not None


def fresh_request(
    renderer: ChatRenderer, policy: HistoryPolicy, stream_ids: Sequence[int], delta_text: str,
    messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None,
) -> list[int] | None:
    """The ids of the next request when it must start a new segment, else None.

    ``stream_ids`` is the segment so far (prompt and response), ``delta_text`` what the renderer
    appends for the new messages (through the next generation prompt), ``messages`` the whole
    conversation including them. None when the policy is ``as_sampled``, when the template never
    rewrites, or when the stream with the delta is the template's rendering of ``messages``."""
    if policy == "as_sampled" or not rewrites_history(renderer):
        return None
    fresh = renderer.render_prompt_text(messages, tools)
    if fresh.endswith(delta_text):
        head = fresh[: len(fresh) - len(delta_text)]
        if renderer.decode(list(stream_ids)) == head:
            return None
    return renderer.encode(fresh)


_CALL = {"type": "function", "function": {"name": "probe", "arguments": {"x": 1}}}
_PROBE = [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "u"},
    {"role": "assistant", "content": "<think>\nr\n</think>\n\na", "tool_calls": [_CALL]},
    {"role": "tool", "content": "t"},
    {"role": "assistant", "content": "<think>\nr2\n</think>\n\nb"},
    {"role": "user", "content": "u2"},
]


def history_rewrite(renderer: ChatRenderer) -> str | None:
    """Where the template rewrites the history (None: it does not), read off a probe conversation
    (reasoning, a tool call, its result, a user follow-up): a tool call the template does not
    render in history, an earlier assistant turn that a later request renders differently, or an
    earlier request's generation prompt that later requests drop. For ``check-template``."""
    if not rewrites_history(renderer):
        return None
    if renderer.prompt_move is not None:
        return renderer.prompt_move
    requests = [end for end in range(1, len(_PROBE) + 1) if end == len(_PROBE) or _PROBE[end]["role"] == "assistant"]

    def differ(early: str, later: str, what: str, follows: str) -> str:
        at = next((i for i, (x, y) in enumerate(zip(early, later)) if x != y), min(len(early), len(later)))
        return (f"once a {follows} turn follows, {what} rendered as {early[max(0, at - 16) : at + 24]!r} is rendered as "
                f"{later[max(0, at - 16) : at + 24]!r}")

    try:
        for a in (i for i, m in enumerate(_PROBE) if m["role"] == "assistant"):
            turn = renderer.render_text(_PROBE[: a + 1])
            if _PROBE[a].get("tool_calls") and "probe" not in turn:  # the probe offers no tools block: only the call names it
                return "the template does not render an assistant turn's tool calls in later requests"
            ends = (renderer.eos_token, *renderer.message_end_tokens, *([renderer.call_token] if renderer.call_token else []))
            end = max(turn.rfind(token) + len(token) for token in ends if token in turn)
            head = turn[:end]  # through its end-of-turn token (harmony: or the token that ends its last message)
            for end in (e for e in requests if e > a + 1):
                later = renderer.render_prompt_text(_PROBE[:end], None)
                if not later.startswith(head):
                    return differ(head, later, "an earlier assistant turn", _PROBE[end - 1]["role"])
        for k, first in enumerate(requests):
            early = renderer.render_prompt_text(_PROBE[:first], None)
            for end in requests[k + 1 :]:
                later = renderer.render_prompt_text(_PROBE[:end], None)
                if not later.startswith(early):
                    return differ(early, later, "an earlier request's generation prompt", _PROBE[end - 1]["role"])
    except Exception:  # the template refuses the probe (no tool calls, no system message): say no more
        pass
    return "the template is not append-only (its rendering of earlier turns changes as the conversation goes on)"
