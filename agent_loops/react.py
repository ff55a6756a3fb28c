"""``react``: plain-text ReAct, no special tokens.

The model writes ``Thought:`` / ``Action:`` / ``Action Input:`` lines, or ``Final Answer:``.
Generation stops at every line break (token ids containing a newline), so an action is run as
soon as its input line is complete; its result is appended as an ``Observation: ...`` line
(masked) inside the same assistant message, and the model continues. The tools are described
in the system prompt as text. The trajectory reward judges the final answer. The parser is the
configured one (``agent.tool_parser_by_loop.react``, by default ``react``).

When the final answer ends the episode, the end-of-turn token and the template's separator are
appended as masked template glue, so the stream equals the chat template's rendering of
``[system, user, assistant(transcript)]``.
"""

from __future__ import annotations

import json
from typing import Any

from agentrl.agent.call_stats import count_turn
from agentrl.agent.loop import AgentLoop, Episode, LoopContext
from agentrl.agent.tool_parsers import parse_turn
from agentrl.data.row import Row
from agentrl.engines.base import FinishReason
from agentrl.trajectory import TrajectoryFinish

INSTRUCTIONS = (
    "Answer the question. You can use these tools:\n{tools}\n"
    "Use this format:\nThought: what to do next\nAction: the tool name\nAction Input: the tool input\n"
    "Observation: the tool result\n... (repeat as needed)\nFinal Answer: the answer"
)


def describe_tools(schemas: list[dict[str, Any]]) -> str:
    lines = []
    for schema in schemas:
        fn = schema["function"]
        lines.append(f"- {fn['name']}: {fn.get('description', '')} Input: {json.dumps(fn.get('parameters', {}))}")
    return "\n".join(lines)


class ReactLoop(AgentLoop):
    name = "react"

    def initial_messages(self, row: Row, ctx: LoopContext, tool_schemas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        messages = row.messages()
        instructions = INSTRUCTIONS.format(tools=describe_tools(tool_schemas))
        if messages and messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": instructions + "\n" + messages[0]["content"]}
        else:
            messages.insert(0, {"role": "system", "content": instructions})
        return messages

    def prompt_tools(self, tool_schemas):
        return None

    def _solution_text(self, episode: Episode) -> str:
        return episode.final_answer if episode.final_answer is not None else super()._solution_text(episode)

    async def play(self, episode: Episode) -> TrajectoryFinish:
        renderer = episode.ctx.renderer
        stops = tuple(newline_token_ids(renderer)) + (renderer.eos_id,)
        message = {"role": "assistant", "content": ""}
        episode.messages.append(message)
        segment = ""  # what the model wrote since the last observation
        continue_turn = False
        while True:
            turn, result, text = await episode.generate(stop_token_ids=stops, continue_turn=continue_turn)
            turn_index = episode.turn_index
            message["content"] += text
            segment += text
            if result.finish_reason is FinishReason.LENGTH:
                return TrajectoryFinish.LENGTH
            schemas = episode.tools.schemas()
            parsed = parse_turn(episode.parser, segment, schemas)
            if parsed.final_answer is not None or episode.last_stopped_on_eos:
                # the parse rate counts a segment once, where it ends: with calls, or with the
                # answer (an Action line never completed there is an unparsed attempt)
                count_turn(episode.counts, episode.parser, segment, parsed, schemas)
                episode.final_answer = parsed.final_answer
                if not episode.last_stopped_on_eos:
                    episode.builder.append_template([renderer.eos_id] + renderer.separator_ids)
                return TrajectoryFinish.STOP
            if not parsed.calls:
                continue_turn = True  # the line was a thought: keep writing the same turn
                continue
            count_turn(episode.counts, episode.parser, segment, parsed, schemas)
            outcomes = await episode.call_tools(turn_index, parsed)
            observation = "".join(f"Observation: {episode.truncate_tool_text(o.text)}\n" for o in outcomes)
            episode.observe_ids(renderer.encode(observation), "tool", [])
            message["content"] += observation
            segment, continue_turn = "", False


_NEWLINE_IDS: dict[int, list[int]] = {}


def newline_token_ids(renderer) -> list[int]:
    """Ids of every token whose text contains a line break (cached per tokenizer)."""
    key = id(renderer.tokenizer)
    if key not in _NEWLINE_IDS:
        tok = renderer.tokenizer
        _NEWLINE_IDS[key] = [i for i in range(len(tok)) if "\n" in tok.decode([i])]
    return _NEWLINE_IDS[key]
