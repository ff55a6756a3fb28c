"""The ``shout_twice`` loop: answers, and answers again (told to be louder) if the first answer was
not in capitals. The episode keeps the tokens exact and checks every turn limit."""

from __future__ import annotations

from agentrl import AgentLoop, Episode

from agentrl_shout.interaction import LOUDER, is_loud


class ShoutTwiceLoop(AgentLoop):
    name = "shout_twice"

    def prompt_tools(self, tool_schemas):
        return None  # this loop offers no tools in its prompt

    async def play(self, episode: Episode) -> str:
        _, _, text = await episode.generate()
        episode.add_assistant_message(text)
        if not is_loud(text):
            # a user turn as masked tokens (rendered by the chat template), then a second answer
            episode.observe([{"role": "user", "content": LOUDER}], "user")
            _, _, text = await episode.generate()
            episode.add_assistant_message(text)
        episode.counts["loop/second_answers"] += episode.turn_index > 0  # averaged per step as loop/second_answers
        return "stop"
