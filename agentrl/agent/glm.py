"""GLM-4.5 / GLM-4.6: a chat template with no end-of-turn token.

The template writes nothing after an assistant message: the next message opens with its role
token, ``<|observation|>`` before tool results and ``<|user|>`` before a user turn, and the model
ends its turn by sampling that token (both are eos ids in the released ``generation_config.json``).
So the token that ends a turn belongs to the turn (sampled, trained), and the delta of what
follows is the template's rendering *after* that role token. ``GlmRenderer`` (picked by
``agentrl.agent.families.family_renderer``) takes ``<|user|>`` as the end of an answer
(``eos_token``) and ``<|observation|>`` as the end of a turn that calls tools (``call_token``), as
harmony's renderer does with ``<|return|>`` and ``<|call|>``.
"""

from __future__ import annotations

from typing import Any, Sequence

from agentrl.agent.render import _ANSWER, ChatRenderer, second_round_problem

__all__ = ["GlmRenderer", "is_glm_template", "OBSERVATION", "USER"]

OBSERVATION, USER = "<|observation|>", "<|user|>"


def is_glm_template(template: str) -> bool:
    return OBSERVATION in template and "<arg_key>" in template


class GlmRenderer(ChatRenderer):
    """``ChatRenderer`` for GLM-4.5/4.6 templates: a turn ends with the role token of the message
    that follows it (``<|user|>``: ``eos_token``; ``<|observation|>``: ``call_token``)."""

    ends_with_next_role = True  # the end-of-turn token opens the next message in the template's rendering
    message_end_tokens = (OBSERVATION,)  # the other token that ends a turn (check-template's reference deltas)

    def __init__(self, tokenizer: Any, *, chat_template: str | None = None, template_kwargs: dict[str, Any] | None = None):
        super().__init__(tokenizer, chat_template=chat_template, template_kwargs=template_kwargs)
        self.call_token = OBSERVATION
        self.call_id = tokenizer.convert_tokens_to_ids(OBSERVATION)

    def _end_of_turn(self, suffix: str) -> str:
        if suffix:  # the template wrote something after an assistant message: not GLM's shape
            raise ValueError(f"a GLM template ends an assistant message with nothing, this one with {suffix[:40]!r}")
        return USER

    def _delta(self, messages: Sequence[dict[str, Any]]) -> str:
        full = self._render(self._base + list(messages), add_generation_prompt=True)
        rest = full[full.index(_ANSWER) + len(_ANSWER) :]
        opener = OBSERVATION if messages and messages[0]["role"] == "tool" else USER
        if not rest.startswith(opener):
            raise ValueError(f"the chat template opens {[m['role'] for m in messages]} after an assistant message with "
                             f"{rest[:40]!r}, not with {opener!r}")
        return rest[len(opener) :]

    def _probe_tool_messages(self) -> str | None:
        # a delta is rendered without the earlier turns: a second round of results must render as
        # the first does, after the <|observation|> that ends the call turn before it
        call = {"type": "function", "function": {"name": "probe", "arguments": {}}}
        first, second = ({"role": "tool", "content": c} for c in ("tool-result-probe-7f3a", "tool-result-probe-2"))
        try:
            alone = self._delta([second])
            full = self._render([self._base[0], {"role": "assistant", "content": "a", "tool_calls": [call]}, first,
                                 {"role": "assistant", "content": "b", "tool_calls": [call]}, second], add_generation_prompt=True)
        except Exception as exc:
            return f"rendering a tool message raised {type(exc).__name__}: {exc}"
        return second_round_problem(alone, full, OBSERVATION, second["content"])
