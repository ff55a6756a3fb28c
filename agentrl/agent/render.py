"""Chat-template rendering as token deltas.

The agent layer never re-tokenizes what the model sampled. It renders the prompt once, and
afterwards renders only what is *observed* (tool results, user turns) as a delta that is
appended after the sampled tokens. A delta is computed against a fixed dummy conversation (a user turn and an assistant turn):
it is the text of ``render(dummy + new, add_generation_prompt=True)`` that follows the
assistant's content and its end-of-turn token. It starts with the separator the template writes
after that token (for Qwen-style templates the ``\\n`` after ``<|im_end|>``): the engine stops at
``<|im_end|>`` and never samples that separator, so the delta must supply it or the stream
drifts from the template.

The delta is anchored on the assistant's content, not on the length of a rendering of the dummy
alone, because templates render an assistant turn differently depending on what follows it
(Qwen3 writes an empty ``<think>\\n\\n</think>\\n\\n`` into the *last* assistant turn only): a
length taken from one rendering would cut the other mid-token. The dummy has no system message,
because templates that move the system prompt into the last user turn (Mistral) would otherwise
write it into an appended user turn.

For *append-only* templates (rendering a conversation is a prefix of rendering any
continuation) the final token stream then equals the template's rendering of the final
messages, token for token, whenever the model's tokens are the tokenizer's own encoding of its
text. Templates that rewrite history (e.g. drop earlier ``<think>`` blocks) are detected at
construction (``append_only`` is False). With them the stream stays what the model actually saw
while generating - each delta is still exactly the template's rendering of the new messages -
but it no longer equals a fresh rendering of the final messages; the trainer trains on the
real context, and ``Trajectory.messages`` is a record, not a recipe for the tokens.

Speed (the agent layer renders thousands of deltas per second):

* a delta is cached per *shape* (the sequence of roles): the template is rendered once with
  placeholder contents, split on them, and later deltas are string joins. A shape is trusted
  only if a probe (contents with edge whitespace, quotes, braces, markup) renders identically
  both ways; otherwise that shape is rendered by the template every time;
* tokenization splits text at the tokenizer's added tokens (``<|im_start|>``, ``<tool_call>``,
  ...), which the tokenizer itself never merges across, and caches the pieces between them:
  the template's own text is tokenized once. Used only if the tokenizer passes a probe;
* prompts are cached per (messages, tools), so the ``n`` samples of a row render once;
* templates are rendered by transformers' compiled template directly (skipping
  ``apply_chat_template``'s per-call conversions), again only if a probe renders identically.

Every fast path falls back to the reference path (``apply_chat_template`` and
``tokenizer.encode``) when its probe disagrees, so speed never changes the tokens.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Sequence

from agentrl.errors import AgentrlError

__all__ = ["ChatRenderer", "TemplateUnsupported"]


class TemplateUnsupported(AgentrlError, ValueError):
    """The chat template cannot render what the agent loop needs (e.g. tool results) exactly."""

_DUMMY = "\x00dummy\x00"
_ANSWER = "\x00answer\x00"  # the dummy assistant content the deltas are anchored on
_HOLE = "\x00hole{}\x00"
# contents that a template which strips, escapes or inspects its contents renders differently
_PROBES = ("  probe \n\t<x> & 'q' \"dq\" {{ y }} {% z %}\n\n", "")
_MAX_CACHED_PIECES = 50_000
_MAX_CACHED_PIECE_LEN = 512
_MAX_CACHED_PROMPTS = 4096


def second_round_problem(alone: str, full: str, turn_end: str, content: str) -> str | None:
    """Why tool results cannot be rendered one round at a time (None: they can): ``alone`` is the
    delta of a second round rendered on its own, ``full`` a rendering of two rounds in which
    ``turn_end`` ends the call turn before the second, ``content`` the second result's text."""
    if content not in alone:
        return "the template drops messages with role 'tool' (their content is not rendered)"
    later = full[full.rindex(turn_end) + len(turn_end) :]
    if later != alone:
        return f"the template renders a second round of tool results as {later!r} but a first one as {alone!r}"
    return None


class ChatRenderer:
    """Renders prompts and observation deltas through a tokenizer's chat template.

    ``eos_token`` / ``eos_id`` is the end-of-turn token: the added token the template writes
    right after an assistant message's content (``<|im_end|>`` for Qwen-style templates). It
    is the token generation stops at.
    """

    # Harmony (gpt-oss) ends a turn that calls a tool with a token of its own, a stop token too,
    # and every message in history with <|end|> (agentrl.agent.harmony); None / () elsewhere.
    call_token: str | None = None
    call_id: int | None = None
    message_end_tokens: tuple[str, ...] = ()  # tokens besides eos_token that end a message in history

    def __init__(
        self, tokenizer: Any, *, chat_template: str | None = None, template_kwargs: dict[str, Any] | None = None
    ):
        self.tokenizer = tokenizer
        self.chat_template: str = chat_template or tokenizer.chat_template
        if not self.chat_template:
            raise ValueError("the tokenizer has no chat template (set model.chat_template to a jinja file)")
        # extra template variables (agent.chat_template_kwargs), e.g. {"enable_thinking": False}
        self.template_kwargs: dict[str, Any] = dict(template_kwargs or {})
        self._render = self._choose_render()
        self.encode, self.decode = self._choose_codec()
        self._base = [{"role": "user", "content": _DUMMY}, {"role": "assistant", "content": _ANSWER}]
        base_text = self._render(self._base, add_generation_prompt=False)
        if base_text.count(_ANSWER) != 1:
            raise ValueError("the chat template does not render an assistant message's content verbatim")
        suffix = base_text[base_text.index(_ANSWER) + len(_ANSWER) :]
        self.eos_token = self._end_of_turn(suffix)
        self.eos_id: int = tokenizer.convert_tokens_to_ids(self.eos_token)
        self._shapes: dict[tuple[str, ...], list[str]] = {}
        self._prompts: dict[str, list[int]] = {}
        # what the template writes between an assistant's end-of-turn token and the next turn
        # (never sampled): the whitespace a delta starts with
        after = self._delta([{"role": "user", "content": _DUMMY}])
        self.separator = after[: len(after) - len(after.lstrip())]
        # what the template writes after the *final* end-of-turn token (appended when an episode ends)
        self.separator_ids: list[int] = self.encode(suffix[len(self.eos_token) :])
        self.append_only = self._probe_append_only()
        self._tool_problem: str | None | bool = False  # False: not probed yet
        self._prompt_move: str | None | bool = False  # False: not probed yet

    # ------------------------------------------------------------------ public API
    def prompt_ids(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt: messages rendered with the tools block and the generation prompt (a fresh list)."""
        key = json.dumps([messages, tools or None], ensure_ascii=False, sort_keys=True, default=str)
        ids = self._prompts.get(key)
        if ids is None:
            if len(self._prompts) >= _MAX_CACHED_PROMPTS:
                self._prompts.clear()
            ids = self._prompts[key] = self.encode(self._render(messages, add_generation_prompt=True, tools=tools or None))
        return list(ids)

    def render_ids(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The reference rendering (``apply_chat_template``, no generation prompt): what an
        append-only stream must equal. Slow; for tests and replay, not the rollout path."""
        text = self._reference_render(messages, add_generation_prompt=False, tools=tools or None)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def template_ids(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *,
                     add_generation_prompt: bool = True) -> list[int]:
        """``messages`` rendered by the template, with or without the generation prompt (a
        server's ``/tokenize``)."""
        return self.encode(self._render(list(messages), add_generation_prompt=add_generation_prompt, tools=tools or None))

    def observation_text(self, messages: Sequence[dict[str, Any]], *, after_eos: bool = True) -> str:
        """Text appended after an assistant turn for ``messages`` (tool or user turns), ending
        with the generation prompt of the next assistant turn."""
        shape = tuple(m["role"] for m in messages)
        segments = self._shapes.get(shape)
        if segments is None:
            segments = self._learn_shape(shape)
        if "tool" in shape:
            self.require_tool_messages()
        if segments and all(m.keys() <= {"role", "content"} for m in messages):
            parts = [segments[0]]
            for message, segment in zip(messages, segments[1:]):
                parts.append(message.get("content") or "")
                parts.append(segment)
            text = "".join(parts)
        else:  # the template does not insert contents verbatim (or a message has more fields): render in full
            text = self._delta(messages)
        if not after_eos and text.startswith(self.separator):
            text = text[len(self.separator) :]
        return text

    @property
    def tool_message_problem(self) -> str | None:
        """Why this template cannot show tool results to the model (None: it can)."""
        if self._tool_problem is False:
            self._tool_problem = self._probe_tool_messages()
        return self._tool_problem  # type: ignore[return-value]

    @property
    def prompt_move(self) -> str | None:
        """How this template moves the first request's prompt once the conversation goes on
        (None: it stays where the first request had it). Mistral-Nemo's writes the system
        message and the tools block into the *last* user turn: at inference every later request
        renders them there, or drops the system message when the conversation ends with tool
        results. ``Episode.observe`` then starts a new segment whose prompt is the template's
        rendering of the whole conversation, so that every request is what the template gives."""
        if self._prompt_move is False:
            self._prompt_move = self._probe_prompt_move()
        return self._prompt_move  # type: ignore[return-value]

    def render_prompt_text(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """The template's rendering of the whole conversation with the generation prompt: what a
        server applying the template gives the model for the next request."""
        return self._render(list(messages), add_generation_prompt=True, tools=tools or None)

    def render_text(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """The template's rendering of the conversation without the generation prompt."""
        return self._render(list(messages), add_generation_prompt=False, tools=tools or None)

    def _probe_prompt_move(self) -> str | None:
        tools = [{"type": "function", "function": {"name": "probe", "description": "d", "parameters": {"type": "object", "properties": {}}}}]
        call = {"id": "a1b2c3d4e", "type": "function", "function": {"name": "probe", "arguments": {}}}
        later = {
            "a user turn follows": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "u2"}],
            "tool results follow": [{"role": "assistant", "content": "", "tool_calls": [call]},
                             {"role": "tool", "content": "t", "tool_call_id": "a1b2c3d4e", "name": "probe"}],
        }
        question = "question-probe-5c1e"
        for system, what in ((True, "system message"), (False, "tools block")):
            first = ([{"role": "system", "content": "s"}] if system else []) + [{"role": "user", "content": question}]
            for kind, more in later.items():
                try:
                    head = self._render(first, add_generation_prompt=False, tools=None if system else tools)
                    full = self._render(first + more, add_generation_prompt=True, tools=None if system else tools)
                except Exception:  # the template refuses this conversation (Gemma's system message): not this case
                    continue
                # the first request through its question (what follows it may depend on what comes next)
                if question not in head or not full.startswith(head[: head.index(question) + len(question)]):
                    return (f"the template renders the {what} of the first request elsewhere once {kind} "
                            "(before the last user turn, or not at all)")
        return None

    def require_tool_messages(self) -> None:
        problem = self.tool_message_problem
        if problem is not None:
            raise TemplateUnsupported(
                f"this chat template cannot render tool results: {problem}. Use a loop that shows tool results "
                "as text in a user turn (agent_name=react), or a chat template that renders role 'tool'"
            )

    def _probe_tool_messages(self) -> str | None:
        marker = "tool-result-probe-7f3a"  # plain text: some templates JSON-quote tool results
        message = {"role": "tool", "content": marker, "tool_call_id": "a1b2c3d4e", "name": "probe"}
        try:
            text = self._delta([message])
        except Exception as exc:
            return f"rendering a tool message raised {type(exc).__name__}: {exc}"
        if marker not in text:
            return "the template drops messages with role 'tool' (their content is not rendered)"
        # a delta is rendered without the earlier turns: the template must render a tool result
        # the same way after an earlier round of tool calls
        second = dict(message, content="tool-result-probe-2")
        answer = "answer-probe-2"
        call = {"id": "a1b2c3d4e", "type": "function", "function": {"name": "probe", "arguments": {}}}
        try:
            middle = {"role": "assistant", "content": answer, "tool_calls": [call]}
            full = self._render(self._base + [message, middle, second], add_generation_prompt=True)
            # from the end-of-turn token of the assistant turn between the two rounds
            later = full[full.rindex(self.eos_token, 0, full.index(second["content"])) :]
            alone = self._delta([second])
        except Exception as exc:
            return f"rendering a second round of tool results raised {type(exc).__name__}: {exc}"
        if later.startswith(self.eos_token) and later[len(self.eos_token) :] != alone:
            return (
                f"the template renders a tool result after an earlier round of tool results as {later[len(self.eos_token):]!r} "
                f"but a first one as {alone!r}, so observations cannot be rendered exactly one at a time"
            )
        return None

    def observation_ids(self, messages: Sequence[dict[str, Any]], *, after_eos: bool = True) -> list[int]:
        return self.encode(self.observation_text(messages, after_eos=after_eos))

    def surely_fits(self, text: str, limit: int) -> bool:
        """True when ``text`` certainly encodes to at most ``limit`` tokens, known without
        encoding it (every token covers at least one byte, give or take a leading marker)."""
        return len(text) * 4 < limit or len(text.encode("utf-8")) + 1 <= limit

    # ------------------------------------------------------------------ rendering
    def _reference_render(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool, tools: Any = None) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
            chat_template=self.chat_template, **self.template_kwargs,
        )

    def _choose_render(self) -> Callable[..., str]:
        """transformers' compiled template called directly, if it renders a probe identically."""
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            compiled = _compile_jinja_template(self.chat_template)
        except Exception:  # another transformers version: the public path only
            return self._reference_render
        kwargs = {**self.tokenizer.special_tokens_map, **self.template_kwargs}

        def render(messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool, tools: Any = None) -> str:
            return compiled.render(
                messages=list(messages), tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **kwargs
            )

        if "strftime_now" in self.chat_template:  # the date transformers supplies: the reference path only
            return self._reference_render

        probe_tools = [{"type": "function", "function": {"name": "f", "description": "d <b>", "parameters": {
            "type": "object", "properties": {"x": {"type": "string", "enum": ["a", "é"]}}, "required": ["x"]}}}]
        probe = [
            {"role": "system", "content": _PROBES[0]},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"},
            {"role": "tool", "content": _PROBES[0]},
            {"role": "user", "content": _PROBES[0]},
        ]
        try:
            for tools in (None, probe_tools):
                for generation in (False, True):
                    fast = render(probe, add_generation_prompt=generation, tools=tools)
                    if fast != self._reference_render(probe, add_generation_prompt=generation, tools=tools):
                        return self._reference_render
        except Exception:
            return self._reference_render
        return render

    def _delta(self, messages: Sequence[dict[str, Any]]) -> str:
        """The rendering of ``messages`` after the dummy assistant turn: the text that follows the
        assistant's content and its end-of-turn token, through the next generation prompt."""
        full = self._render(self._base + list(messages), add_generation_prompt=True)
        if full.count(_ANSWER) != 1:
            raise ValueError("the chat template does not render an assistant message's content verbatim")
        rest = full[full.index(_ANSWER) + len(_ANSWER) :]
        if not rest.startswith(self.eos_token):
            raise ValueError(
                f"the chat template ends an assistant message followed by {[m['role'] for m in messages]} with "
                f"{rest[:40]!r}, not with its end-of-turn token {self.eos_token!r}"
            )
        return rest[len(self.eos_token) :]

    def _end_of_turn(self, suffix: str) -> str:
        for token in sorted(self._added_tokens(), key=len, reverse=True):
            if suffix.startswith(token):
                return token
        raise ValueError(
            f"the chat template ends an assistant message with {suffix!r}, which does not start with an added "
            "token: generation needs an end-of-turn token to stop at"
        )

    def _learn_shape(self, shape: tuple[str, ...]) -> list[str]:
        segments = self._split_on_holes(shape)
        # trust the cached segments only if they reproduce real renderings
        for probe in _PROBES:
            messages = [{"role": role, "content": probe} for role in shape]
            try:
                full = self._delta(messages)
            except Exception:  # the template refuses these messages without more fields (Mistral's call ids)
                full = None
            if segments and full != probe.join(segments):
                segments = []
        self._shapes[shape] = segments
        return segments

    def _split_on_holes(self, shape: tuple[str, ...]) -> list[str]:
        holes = [{"role": role, "content": _HOLE.format(i)} for i, role in enumerate(shape)]
        try:
            rest = self._delta(holes)
        except Exception:  # the template refuses this shape: the full render raises it again, with its message
            return []
        segments: list[str] = []
        for i in range(len(shape)):
            hole = _HOLE.format(i)
            if rest.count(hole) != 1:
                return []
            before, rest = rest.split(hole)
            segments.append(before)
        segments.append(rest)
        return segments

    def _probe_append_only(self) -> bool:
        tool_call = {"type": "function", "function": {"name": "probe", "arguments": {"x": 1}}}
        conversation = [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "<think>r</think>a", "tool_calls": [tool_call]},
            {"role": "tool", "content": "t"},
            {"role": "assistant", "content": "<think>r2</think>b"},
            {"role": "user", "content": "u2"},
            {"role": "assistant", "content": "<think>r3</think>c"},
        ]
        try:
            full = self._render(conversation, add_generation_prompt=False)
            for k in (2, 4, 6):
                if not full.startswith(self._render(conversation[:k], add_generation_prompt=True)):
                    return False
                if not full.startswith(self._render(conversation[: k + 1], add_generation_prompt=False)):
                    return False
        except Exception:  # a template that cannot render the probe is not known to be append-only
            return False
        return True

    # ------------------------------------------------------------------ tokenization
    def _added_tokens(self) -> list[str]:
        return [t.content for t in self.tokenizer.added_tokens_decoder.values()]

    def _choose_codec(self) -> tuple[Callable[[str], list[int]], Callable[[Sequence[int]], str]]:
        """Piecewise cached encoding and the backend's decode, each if it agrees with the
        tokenizer's own methods on a probe."""
        tok = self.tokenizer

        def reference_encode(text: str) -> list[int]:
            return tok.encode(text, add_special_tokens=False)

        def reference_decode(ids: Sequence[int]) -> str:
            return tok.decode(list(ids), skip_special_tokens=False)

        backend = getattr(tok, "backend_tokenizer", None)
        added = list(tok.added_tokens_decoder.values())
        if backend is None or not added:
            return reference_encode, reference_decode
        pieces: dict[str, list[int]] = {}
        splitter = re.compile("(" + "|".join(re.escape(t.content) for t in sorted(added, key=lambda t: -len(t.content))) + ")")
        token_ids = {t.content: tok.convert_tokens_to_ids(t.content) for t in added}

        def piece_ids(piece: str) -> list[int]:
            ids = pieces.get(piece)
            if ids is None:
                ids = backend.encode(piece, add_special_tokens=False).ids
                if len(piece) <= _MAX_CACHED_PIECE_LEN:
                    if len(pieces) >= _MAX_CACHED_PIECES:
                        pieces.clear()
                    pieces[piece] = ids
            return ids

        def fast_encode(text: str) -> list[int]:
            out: list[int] = []
            for i, piece in enumerate(splitter.split(text)):
                if i % 2:
                    out.append(token_ids[piece])
                elif piece:
                    out.extend(piece_ids(piece))
            return out

        def fast_decode(ids: Sequence[int]) -> str:
            return backend.decode(list(ids), skip_special_tokens=False)

        # Added tokens that strip neighbouring whitespace, or that match after normalization,
        # tokenize differently when their neighbours are encoded apart: no piecewise encoding.
        splittable = all(not (t.lstrip or t.rstrip or t.single_word or t.normalized) for t in added)
        words = [" ", ".\n", "a", "\n\n", " x", "12", "\n", "é", ""]
        probe = "".join(w + t.content for w in words for t in added) + " tail.\n"
        try:
            reference = reference_encode(probe)
            encode = fast_encode if splittable and fast_encode(probe) == reference else reference_encode
            decode = fast_decode if fast_decode(reference) == reference_decode(reference) else reference_decode
        except Exception:
            return reference_encode, reference_decode
        return encode, decode
