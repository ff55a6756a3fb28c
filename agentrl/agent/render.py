"""Chat-template rendering as token deltas.

The agent layer never re-tokenizes what the model sampled. It renders the prompt once, and
afterwards renders only what is *observed* (tool results, user turns) as a delta that is
appended after the sampled tokens. A delta is computed against a fixed dummy conversation:

    render(dummy + new, add_generation_prompt=True) minus render(dummy)

plus the separator the template writes after an assistant's end-of-turn token (for Qwen-style
templates the ``\\n`` after ``<|im_end|>``): the engine stops at ``<|im_end|>`` and never
samples that separator, so the delta must supply it or the stream drifts from the template.

For *append-only* templates (rendering a conversation is a prefix of rendering any
continuation) the final token stream then equals the template's rendering of the final
messages, token for token. Templates that rewrite history (e.g. drop earlier ``<think>``
blocks) are detected at construction (``append_only`` is False); with them the stream stays
what the model actually saw while generating - the deltas are still exact - but it no longer
equals a fresh rendering of the final messages, and the trainer trains on the real context.

Rendering is cached per shape: the template is rendered once with placeholder contents for a
given sequence of roles, split on the placeholders, and later deltas are string joins (checked
against a full rendering when the shape is first seen).
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["ChatRenderer"]

_DUMMY = "\x00dummy\x00"
_HOLE = "\x00hole{}\x00"


class ChatRenderer:
    """Renders prompts and observation deltas through a tokenizer's chat template."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.eos_token: str = tokenizer.eos_token
        self.eos_id: int = tokenizer.convert_tokens_to_ids(self.eos_token)
        self._base = [
            {"role": "system", "content": _DUMMY},
            {"role": "user", "content": _DUMMY},
            {"role": "assistant", "content": _DUMMY},
        ]
        base_text = self._render(self._base, add_generation_prompt=False)
        self._base_len = len(base_text)
        end = base_text.rfind(_DUMMY + self.eos_token)
        if end < 0:
            raise ValueError("the chat template does not end an assistant message with the tokenizer's eos token")
        # what the template writes after the assistant's eos (never sampled by the engine)
        self.separator = base_text[end + len(_DUMMY) + len(self.eos_token) :]
        self.separator_ids: list[int] = self.encode(self.separator)
        self._shapes: dict[tuple[str, ...], list[str]] = {}
        self.append_only = self._probe_append_only()

    def _render(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool, tools: Any = None) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def prompt_ids(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt: messages rendered with the tools block and the generation prompt."""
        return self.encode(self._render(messages, add_generation_prompt=True, tools=tools or None))

    def render_ids(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """A full rendering (no generation prompt): what an append-only stream must equal."""
        return self.encode(self._render(messages, add_generation_prompt=False, tools=tools or None))

    def observation_text(self, messages: Sequence[dict[str, Any]], *, after_eos: bool = True) -> str:
        """Text appended after an assistant turn for ``messages`` (tool or user turns), ending
        with the generation prompt of the next assistant turn."""
        shape = tuple(m["role"] for m in messages)
        segments = self._shapes.get(shape)
        contents = [m.get("content") or "" for m in messages]
        if segments is None:
            segments = self._learn_shape(shape)
        if segments:
            parts = [segments[0]]
            for content, segment in zip(contents, segments[1:]):
                parts.append(content)
                parts.append(segment)
            text = "".join(parts)
        else:  # the template does not insert contents verbatim: render in full
            full = self._render(self._base + list(messages), add_generation_prompt=True)
            text = full[self._base_len :]
        return (self.separator if after_eos else "") + text

    def observation_ids(self, messages: Sequence[dict[str, Any]], *, after_eos: bool = True) -> list[int]:
        return self.encode(self.observation_text(messages, after_eos=after_eos))

    def _learn_shape(self, shape: tuple[str, ...]) -> list[str]:
        holes = [{"role": role, "content": _HOLE.format(i)} for i, role in enumerate(shape)]
        full = self._render(self._base + holes, add_generation_prompt=True)
        delta = full[self._base_len :]
        segments: list[str] = []
        rest = delta
        for i in range(len(shape)):
            hole = _HOLE.format(i)
            if rest.count(hole) != 1:
                segments = []
                break
            before, rest = rest.split(hole)
            segments.append(before)
        else:
            segments.append(rest)
        self._shapes[shape] = segments
        return segments

    def _probe_append_only(self) -> bool:
        tool_call = {"type": "function", "function": {"name": "probe", "arguments": {"x": 1}}}
        conversation = [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "<think>r</think>a", "tool_calls": [tool_call]},
            {"role": "tool", "content": "t"},
            {"role": "assistant", "content": "<think>r2</think>b"},
        ]
        try:
            full = self._render(conversation, add_generation_prompt=False)
            for k in (2, 4):
                if not full.startswith(self._render(conversation[:k], add_generation_prompt=True)):
                    return False
                if not full.startswith(self._render(conversation[: k + 1], add_generation_prompt=False)):
                    return False
        except Exception:  # a template that cannot render the probe is not known to be append-only
            return False
        return True
