"""Model families: end-of-turn stops, the native tool-call parser, and the template check.

``stop_tokens`` collects every id generation must stop at: the end-of-turn token the chat
template writes after an assistant message (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``,
``<|end|>``, ``</s>``), the tokenizer's eos, and every eos id of ``generation_config.json``
(Llama 3.1 lists ``<|end_of_text|>``, ``<|eom_id|>`` and ``<|eot_id|>``). A family whose
end-of-turn token is not its tokenizer's eos (Phi-3.5: ``<|end|>`` vs ``<|endoftext|>``) would
otherwise run every turn to ``max_new_tokens``.

``detect_tool_parser`` names the parser of the family's own tool-call format from its template
and vocabulary (``agent.tool_parser=auto``).

``check_template`` plays a scripted multi-turn tool conversation through the renderer exactly as
an agent loop does (prompt, sampled turns in the family's native tool-call text, observation
deltas) and compares the token stream with an independent reference built from
``apply_chat_template`` on the real messages: the first differing position, both sides decoded.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.agent.glm import GlmRenderer, is_glm_template
from agentrl.agent.harmony import HISTORY_NOTE, HarmonyRenderer, is_harmony_template
from agentrl.agent.history import history_rewrite
from agentrl.agent.render import ChatRenderer
from agentrl.agent.tool_parsers import parse_turn

__all__ = ["StopTokens", "family_renderer", "stop_tokens", "detect_tool_parser", "TemplateReport", "check_template", "require_exact_template", "cli_main"]


@dataclass(frozen=True, slots=True)
class StopTokens:
    end_of_turn: str  # the token the template writes after an assistant message
    ids: tuple[int, ...]  # end-of-turn id first, then every other eos id
    sources: dict[int, tuple[str, ...]] = field(default_factory=dict)  # id -> where it came from


def _generation_config_eos(model_dir: Path | None) -> list[int]:
    if model_dir is None or not (model_dir / "generation_config.json").is_file():
        return []
    eos = json.loads((model_dir / "generation_config.json").read_text()).get("eos_token_id")
    if isinstance(eos, int):
        return [eos]
    return [int(e) for e in eos] if isinstance(eos, list) else []


def _model_dir(tokenizer: Any, model_dir: str | Path | None) -> Path | None:
    if model_dir is None:
        model_dir = getattr(tokenizer, "name_or_path", None) or None  # "" for a tokenizer built in memory
    return Path(model_dir) if model_dir is not None and Path(model_dir).is_dir() else None


def family_renderer(
    tokenizer: Any, *, chat_template: str | None = None, template_kwargs: dict[str, Any] | None = None
) -> ChatRenderer:
    """The renderer of the family's chat template: ``ChatRenderer``, or ``HarmonyRenderer`` for
    gpt-oss's harmony template (its turns end with <|call|> or <|return|>, its tool results name the call)."""
    template = chat_template or getattr(tokenizer, "chat_template", None) or ""
    kind = HarmonyRenderer if is_harmony_template(template) else GlmRenderer if is_glm_template(template) else ChatRenderer
    return kind(tokenizer, chat_template=chat_template, template_kwargs=template_kwargs)


def stop_tokens(tokenizer: Any, renderer: ChatRenderer | None = None, *, model_dir: str | Path | None = None) -> StopTokens:
    """Every id a turn ends at: the template's end-of-turn token, the tokenizer's eos and the
    eos ids of ``generation_config.json`` (next to the tokenizer, or in ``model_dir``)."""
    renderer = renderer or family_renderer(tokenizer)
    sources: dict[int, list[str]] = {}

    def add(token_id: int | None, source: str) -> None:
        if token_id is not None and token_id >= 0:
            sources.setdefault(int(token_id), []).append(source)

    add(renderer.eos_id, f"chat template end-of-turn {renderer.eos_token!r}")
    if renderer.call_token is not None:  # harmony (gpt-oss) ends a turn that calls a tool with <|call|>
        add(renderer.call_id, f"chat template end of a tool call {renderer.call_token!r}")
    add(tokenizer.eos_token_id, f"tokenizer eos {tokenizer.eos_token!r}")
    for token_id in _generation_config_eos(_model_dir(tokenizer, model_dir)):
        add(token_id, "generation_config.json eos_token_id")
    return StopTokens(renderer.eos_token, tuple(sources), {k: tuple(v) for k, v in sources.items()})


def detect_tool_parser(tokenizer: Any, chat_template: str | None = None) -> str:
    """The name of the tool parser (entry point in ``agentrl.tool_parsers``) for this family's
    native tool-call format, read from the chat template and the vocabulary."""
    template = chat_template or tokenizer.chat_template or ""
    vocab = {t.content for t in tokenizer.added_tokens_decoder.values()}
    if is_harmony_template(template):  # gpt-oss
        return "harmony"
    if "[TOOL_CALLS]" in template or "[TOOL_CALLS]" in vocab:
        return "mistral"
    if "<｜tool▁calls▁begin｜>" in template or "<｜tool▁calls▁begin｜>" in vocab:
        return "deepseek_r1"
    if "<|tool_call|>" in vocab:
        return "phi4_mini"
    if "<arg_key>" in template or "<arg_key>" in vocab:  # GLM-4.5 / 4.6
        return "glm45"
    if "<function=" in template:  # Qwen3-Coder, Qwen3.5 / 3.6: XML parameters inside <tool_call>
        return "qwen3_coder"
    if "<tool_call>" in template:
        return "hermes"
    if "<|start_header_id|>" in template and "tool_call" in template:
        return "llama3_json"
    return "hermes"


# ---------------------------------------------------------------------- the check
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
SYSTEM = "You are a careful assistant. Use the calculator for arithmetic."
QUESTION = "What is 12 * 34, plus 1?"
CALLS = [[("calculator", {"expression": "12 * 34"})], [("calculator", {"expression": "408 + 1"})]]
RESULTS = ["408", "409"]
FOLLOW_UP = "Are you sure? Answer with the number only."


@dataclass(slots=True)
class TemplateReport:
    ok: bool  # no drift, and (unless tools were skipped) tool results can be rendered
    parser: str
    stop_ids: tuple[int, ...]
    stop_tokens: dict[int, str]
    end_of_turn: str
    append_only: bool
    tools: str  # "ok", or why tool results cannot be shown to the model
    round_trip: str  # "ok", or what the parser got back from the family's own call text
    drift: dict[str, Any] | None = None  # {position, ours, reference, ours_text, reference_text}
    refused: str | None = None  # why this family cannot be used (the renderer refused it)
    prompt_move: str | None = None  # how the template moves the first request's prompt later (ChatRenderer.prompt_move)
    history: str | None = None  # where the template rewrites the history (agentrl.agent.history.history_rewrite)
    notes: list[str] = field(default_factory=list)

    def render(self) -> str:
        status = "OK" if self.ok else "DRIFT" if self.drift else "REFUSED" if self.refused or self.tools.startswith("refused") else "FAILED"
        lines = [f"check-template: {status}"]
        if self.refused:
            lines.append(f"  refused: {self.refused}")
            return "\n".join(lines)
        lines += [
            f"  end-of-turn token: {self.end_of_turn!r}",
            "  stop ids: " + ", ".join(f"{i} ({self.stop_tokens[i]})" for i in self.stop_ids),
            f"  tool parser: {self.parser}",
            f"  tool results: {self.tools}",
            f"  tool-call round trip: {self.round_trip}",
            f"  append-only template: {self.append_only}",
            "  history: " + ("append-only (agent.history=as_template and as_sampled give the same stream)" if self.history is None
                             else f"rewritten by the template: {self.history}; agent.history=as_template starts a new "
                             "segment there (every request as the template renders it), as_sampled keeps one stream"),
            "  prompt stays in place: " + ("yes" if self.prompt_move is None else
                                           f"no: {self.prompt_move}; a request after such a turn starts a new segment "
                                           "from the template's own rendering of the conversation"),
        ]
        if self.drift is None:
            lines.append("  token drift: none")
        else:
            d = self.drift
            lines.append(f"  token drift at position {d['position']}: ours {d['ours']} {d['ours_text']!r}, reference {d['reference']} {d['reference_text']!r}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _reference_delta(tokenizer: Any, renderer: ChatRenderer, before: list[dict], new: list[dict], tools: Any) -> str:
    """The template's own rendering of ``new`` after the conversation ``before`` (ending with an
    assistant turn): the text after that turn's end-of-turn token, from ``apply_chat_template``
    on the real messages - independent of the renderer's dummy conversation and caches. ``before``
    is rendered as a request (with the generation prompt), so its last turn ends as it does in
    history (harmony: an answer with <|end|>, not <|return|>)."""
    kwargs = dict(tokenize=False, chat_template=renderer.chat_template, tools=tools, **renderer.template_kwargs)
    head = tokenizer.apply_chat_template(before, add_generation_prompt=True, **kwargs)
    full = tokenizer.apply_chat_template(before + new, add_generation_prompt=True, **kwargs)
    ends = re.compile("|".join(re.escape(t) for t in (renderer.eos_token, *renderer.message_end_tokens)))
    # GLM: the token that ends the last turn opens the next message, one past those in the head
    last = len(ends.findall(head)) - (0 if getattr(renderer, "ends_with_next_role", False) else 1)
    return full[[m.end() for m in ends.finditer(full)][last] :]


def check_template(
    tokenizer: Any,
    *,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    tool_parser: str = "auto",
    model_dir: str | Path | None = None,
    tools: bool = True,
) -> TemplateReport:
    """Play the scripted tool conversation through the renderer and compare with the reference.

    ``tools=False`` checks a conversation without tool calls (user follow-ups only), for loops
    that never show tool results through the template."""
    from agentrl.plugins import PluginRegistry

    try:
        renderer = family_renderer(tokenizer, chat_template=chat_template, template_kwargs=chat_template_kwargs)
    except Exception as exc:
        return TemplateReport(False, "", (), {}, "", False, "", "", refused=f"{exc}")
    stops = stop_tokens(tokenizer, renderer, model_dir=model_dir)
    parser_name = detect_tool_parser(tokenizer, renderer.chat_template) if tool_parser == "auto" else tool_parser
    parser = PluginRegistry().load("tool_parsers", parser_name)()
    report = TemplateReport(
        ok=True, parser=parser_name, stop_ids=stops.ids, stop_tokens={i: "; ".join(s) for i, s in stops.sources.items()},
        end_of_turn=stops.end_of_turn, append_only=renderer.append_only, tools="ok", round_trip="ok",
        prompt_move=renderer.prompt_move, history=history_rewrite(renderer),
    )
    if isinstance(renderer, HarmonyRenderer):
        report.notes.append(HISTORY_NOTE)
    problem = renderer.tool_message_problem
    use_tools = tools and problem is None
    if tools and problem is not None:
        report.ok = False
        report.tools = f"refused: {problem} (use agent_name=react or single_turn with this template)"
    elif not tools:
        report.tools = "not checked (--no-tools)"
    schemas = [CALCULATOR] if use_tools else None

    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    try:
        ours = renderer.prompt_ids(messages, schemas)
    except Exception as exc:  # Gemma 2 refuses system messages: rows must carry their instructions in the user turn
        report.notes.append(f"the template refuses a system message ({exc}): rows must not have one")
        messages = messages[1:]
        ours = renderer.prompt_ids(messages, schemas)
    reference = tokenizer.encode(
        tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False, add_generation_prompt=True,
                                      chat_template=renderer.chat_template, **renderer.template_kwargs),
        add_special_tokens=False,
    )
    history = [m for m in messages if m["role"] != "system"]  # the reference deltas keep the system prompt where the prompt put it
    plan: list[tuple[str, list[dict[str, Any]]]] = []
    if use_tools:
        for calls, result in zip(CALLS, RESULTS):
            plan.append((getattr(parser, "format_calls")(calls), [{"role": "tool", "content": result}]))
    answer = getattr(parser, "format_answer", lambda text: text)  # harmony answers in its final channel
    plan.append((answer("#### 409"), [{"role": "user", "content": FOLLOW_UP}]))
    plan.append((answer("409"), []))
    # a reasoning model writes a <think> block first (kept in the trajectory as sampled)
    thinking = "<think>" in renderer.chat_template and renderer.template_kwargs.get("enable_thinking") is not False
    opened = tokenizer.decode(ours).endswith("<think>\n")  # DeepSeek-R1's generation prompt opens the block itself
    reasoning = ("" if opened else "<think>\n") + "I should use the calculator.\n</think>\n\n" if thinking else ""
    if hasattr(parser, "format_analysis"):  # harmony: an analysis message before each call and answer
        reasoning = parser.format_analysis("I should use the calculator.")
    for answer_text, observations in plan:
        sampled_text = reasoning + answer_text
        parsed = parse_turn(parser, sampled_text, schemas)
        end_id = renderer.call_id if parsed.calls and renderer.call_id is not None else renderer.eos_id  # harmony: <|call|>
        ours += renderer.encode(sampled_text) + [end_id]
        reference += tokenizer.encode(sampled_text, add_special_tokens=False) + [end_id]
        assistant: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.calls:
            assistant["tool_calls"] = [c.as_message_call() for c in parsed.calls]
            expected = [c for c in CALLS if _call_text(parser, c) == answer_text]
            got = [(c.name, c.arguments) for c in parsed.calls]
            if not expected or got != expected[0]:
                report.ok, report.round_trip = False, f"the parser read {got} from {sampled_text!r}"
            observations = [c.result_message(o["content"]) for c, o in zip(parsed.calls, observations)]
        elif observations and observations[0]["role"] == "tool":
            report.ok, report.round_trip = False, f"the parser found no call in the family's own call text {sampled_text!r}"
            break
        history.append(assistant)
        if observations:
            ours += renderer.observation_ids(observations)
            # the deltas, with the tools and the system prompt where the prompt put them (a template
            # that moves them, Mistral's, starts a new segment in the loops: report.prompt_move)
            delta = _reference_delta(tokenizer, renderer, history, observations, None)
            reference += tokenizer.encode(delta, add_special_tokens=False)
            if schemas and _reference_delta(tokenizer, renderer, history, observations, schemas) != delta:
                report.notes.append(
                    f"the template renders the tool list again before an appended {observations[0]['role']} turn (it moves it "
                    "to the last user turn); the loops start a new segment there, from the template's own rendering"
                )
            history.extend(observations)
    ours += renderer.separator_ids
    final_head = tokenizer.apply_chat_template(history, tools=schemas, tokenize=False, chat_template=renderer.chat_template, **renderer.template_kwargs)
    if not getattr(renderer, "ends_with_next_role", False):  # GLM writes nothing after the last turn's sampled end
        reference += tokenizer.encode(final_head[final_head.rindex(renderer.eos_token) + len(renderer.eos_token) :], add_special_tokens=False)
    if ours != reference:
        at = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), min(len(ours), len(reference)))
        report.ok = False
        report.drift = {
            "position": at, "ours": ours[at : at + 8], "reference": reference[at : at + 8],
            "ours_text": tokenizer.decode(ours[at : at + 8]), "reference_text": tokenizer.decode(reference[at : at + 8]),
        }
    return report


def _call_text(parser: Any, calls: list[tuple[str, dict[str, Any]]]) -> str:
    return getattr(parser, "format_calls")(calls)


def cli_main(argv: list[str]) -> int:
    import argparse

    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(prog="agentrl check-template", description="check a tokenizer's chat template for token drift")
    ap.add_argument("model_dir", help="a directory with tokenizer files (and generation_config.json), or tiny[:SIZE] (the built-in tiny model)")
    ap.add_argument("--chat-template", help="a jinja file to use instead of the tokenizer's template")
    ap.add_argument("--kwargs", default="{}", help='chat_template_kwargs as JSON, e.g. \'{"enable_thinking": false}\'')
    ap.add_argument("--tool-parser", default="auto")
    ap.add_argument("--no-tools", action="store_true", help="check a conversation without tool calls")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from agentrl.tiny import model_dir_arg

    try:
        args.model_dir = str(model_dir_arg(args.model_dir))
    except ValueError as exc:
        ap.error(str(exc))
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    template = Path(args.chat_template).read_text() if args.chat_template else None
    report = check_template(
        tokenizer, chat_template=template, chat_template_kwargs=json.loads(args.kwargs), tool_parser=args.tool_parser,
        model_dir=args.model_dir, tools=not args.no_tools,
    )
    if args.json:
        from dataclasses import asdict

        print(json.dumps(asdict(report), indent=2, default=str))
    else:
        print(report.render())
    return 0 if report.ok else (2 if report.refused or report.tools.startswith("refused") else 1)


def require_exact_template(tokenizer: Any, cfg: Any, model_dir: str | Path) -> TemplateReport:
    """The startup check of ``agentrl train`` and ``agentrl rollout``: the same scripted
    conversation as ``agentrl check-template``, with the run's parser and template variables;
    tool results are checked when the run offers tools. Drift or a refused template stops the run
    before any model is loaded, with the report."""
    from agentrl.errors import ConfigError

    agent = cfg.agent
    offers_tools = agent.default_loop == "tool_agent" or bool(agent.tool_config) or agent.tool_config_path is not None
    report = check_template(tokenizer, chat_template_kwargs=dict(agent.chat_template_kwargs), tool_parser=agent.tool_parser,
                            model_dir=model_dir, tools=offers_tools)
    if not report.ok:
        raise ConfigError([("model.path", f"the chat template check failed (agentrl check-template {model_dir}):\n{report.render()}")])
    return report
