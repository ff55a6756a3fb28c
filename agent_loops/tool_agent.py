"""``tool_agent``: chat-template function calling (Qwen2.5 / hermes ``<tool_call>`` format).

Each assistant turn either calls tools - their results come back as one tool turn rendered by
the chat template - or answers. An answer goes to the row's interaction when it has one (which
may reply and let the model try again), else it ends the episode.
"""

from __future__ import annotations

from agentrl.agent.loop import AgentLoop, Episode, ask_interaction
from agentrl.trajectory import TrajectoryFinish


class ToolAgentLoop(AgentLoop):
    name = "tool_agent"

    async def play(self, episode: Episode) -> TrajectoryFinish:
        while True:  # the episode ends it at a turn limit, or a turn cut short (length)
            step = await episode.assistant_turn()
            if step.parsed.calls:
                outcomes = await episode.call_tools(step.index, step.parsed)
                # a result message carries its call's id for families that pair them (Mistral)
                results = [o.call.result_message(episode.truncate_tool_text(o.text)) for o in outcomes]
                episode.observe(results, "tool")
                continue
            if episode.interaction is not None:
                await ask_interaction(episode, step.turn)
                continue
            return TrajectoryFinish.STOP
