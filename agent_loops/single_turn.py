"""``single_turn``: one assistant answer to the prompt (verl: ``single_turn_agent``)."""

from __future__ import annotations

from agentrl.agent.loop import AgentLoop, Episode
from agentrl.engines.base import FinishReason
from agentrl.trajectory import TrajectoryFinish


class SingleTurnLoop(AgentLoop):
    name = "single_turn"

    def prompt_tools(self, tool_schemas):
        return None

    async def play(self, episode: Episode) -> TrajectoryFinish:
        _, result, text = await episode.generate()
        episode.add_assistant_message(text)
        return TrajectoryFinish.LENGTH if result.finish_reason is FinishReason.LENGTH else TrajectoryFinish.STOP
