"""OpenEnv environments written against OpenEnv's public API (openenv 0.10), as a third party
would, for tests/environments/test_openenv*.py. A module of its own, importing nothing of agentrl:
the server process agentrl starts imports it, and stays light.

``guess_app`` is what an environment's ``server/app.py`` holds (the app OpenEnv's ``create_app``
builds); ``ReplyEnvironment`` is named as the class itself (agentrl builds the app the same way);
``calc_app`` serves an MCP environment (its tools are MCP tools).
"""

from __future__ import annotations

import os
import time
from uuid import uuid4

from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

class GuessAction(Action):
    """Guess the secret number."""

    guess: int = Field(..., description="your guess, 0 to 9")


class GuessObservation(Observation):
    feedback: str = ""


class GuessEnvironment(Environment):
    """Guess a secret number (reset's ``secret``): -0.25 a wrong guess, 1.0 and done when right,
    done after three guesses. 13 makes the environment's code raise, 11 makes it hang."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.secret = 0

    def reset(self, seed=None, episode_id=None, secret: int = 7, **kwargs) -> GuessObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self.secret = secret
        return GuessObservation(feedback="Guess my number (0-9).", done=False, reward=0.0)

    def step(self, action: GuessAction) -> GuessObservation:  # type: ignore[override]
        self._state.step_count += 1
        if action.guess == 13:
            raise ValueError("13 is unlucky")
        if action.guess == 11:
            time.sleep(30)
        if action.guess == self.secret:
            return GuessObservation(feedback="correct", done=True, reward=1.0)
        hint = "higher" if action.guess < self.secret else "lower"
        return GuessObservation(feedback=hint, done=self._state.step_count >= 3, reward=-0.25)

    @property
    def state(self) -> State:
        return self._state


# what the environment's server/app.py would hold
guess_app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=4)


class ReplyAction(Action):
    message: str = Field(..., description="what the agent says")


class ReplyObservation(Observation):
    prompt: str = ""


class ReplyEnvironment(Environment):
    """Say words with reset's ``letter``: each step's reward is a quarter per occurrence (at most
    1.0); two steps. The first step after reset's ``kill_marker`` file appeared (which it removes)
    kills the server process."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.letter, self.kill_marker = "a", None

    def reset(self, seed=None, episode_id=None, letter: str = "a", kill_marker: str | None = None, **kwargs) -> ReplyObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self.letter, self.kill_marker = letter, kill_marker
        return ReplyObservation(prompt=f"Say words with the letter {letter}.", done=False, reward=0.0)

    def step(self, action: ReplyAction) -> ReplyObservation:  # type: ignore[override]
        self._state.step_count += 1
        if self.kill_marker and os.path.exists(self.kill_marker):
            os.remove(self.kill_marker)
            os.kill(os.getpid(), 9)
        reward = min(action.message.count(self.letter), 4) / 4
        return ReplyObservation(prompt=f"More words with {self.letter}.", done=self._state.step_count >= 2, reward=reward)

    @property
    def state(self) -> State:
        return self._state


NOT_AN_APP = "a string cannot be served"


class CalcEnvironment(MCPEnvironment):
    """An MCP environment (OpenEnv RFC 003): its tools are a FastMCP server's; a call whose result is
    the sum of reset's ``a`` and ``b`` earns 1.0 and ends the episode, other calls 0.0 (three at most)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        mcp = FastMCP("calc")

        @mcp.tool()
        def add(a: int, b: int) -> int:
            """Add two integers."""
            return a + b

        super().__init__(mcp)
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.target = 0

    def reset(self, seed=None, episode_id=None, a: int = 2, b: int = 3, **kwargs) -> Observation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self.target = a + b
        return Observation(done=False, reward=0.0, metadata={"task": f"add {a} and {b}"})

    async def step_async(self, action, timeout_s=None, **kwargs) -> Observation:
        observation = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        if isinstance(action, CallToolAction):
            self._state.step_count += 1
            right = observation.result is not None and observation.result.data == self.target
            observation.reward, observation.done = (1.0, True) if right else (0.0, self._state.step_count >= 3)
        return observation

    def _step_impl(self, action, timeout_s=None, **kwargs) -> Observation:
        return Observation(done=False, reward=0.0, metadata={"error": f"unknown action {type(action).__name__}"})

    @property
    def state(self) -> State:
        return self._state


# what an MCP environment's server/app.py holds
calc_app = create_app(CalcEnvironment, CallToolAction, CallToolObservation, env_name="calc", max_concurrent_envs=4)
