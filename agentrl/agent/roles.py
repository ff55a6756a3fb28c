"""Several agents in one episode: roles, each with its own token stream and its own credit.

An episode of a ``RolesLoop`` has named roles (a solver and a verifier, two players). Each role
the policy samples has an ``Episode`` of its own: its own prompt, messages and token stream,
exact as a single agent's (sampled tokens with their logprobs and weight versions, mask 1;
everything else observed, mask 0). What the other roles said reaches a role's context as user
messages rendered by the chat template (``RolesLoop.shown`` decides the text, or hides a turn):
before its first turn they join its prompt, afterwards they are an observation delta, as any
user turn. So each role's trajectory is what that role saw and sampled, nothing more.

The policy of a role (``agent.roles``, over the loop's own ``RolesLoop.roles``):

* ``shared``: sampled by the trained policy and trained, every shared role in one loss
  (self-play); each role's trajectory sits in a group of its own, ``<group>@<role>``, so GRPO
  and RLOO compare a role's samples of a prompt with the same role's only;
* ``frozen``: not trained and not sampled by the policy: the loop speaks for it
  (``RolesEpisode.say``: a scripted responder such as a rule-based judge); it has no trajectory;
* ``trained``: sampled by a policy of its own and trained on the role's trajectories only: its
  episode's requests name the role as their policy (``GenerateRequest.policy``; the engine
  serves each policy's weights, ``agentrl.engines.policies``) and its trajectories carry that
  policy's weight version. The trainer builds the role's policy from ``agent.roles``, so a role
  is trained only when the config says so (a loop's own ``trained`` must be repeated there).

Rewards by role: the loop's own (``RolesEpisode.rewards``), else the reward function of the
row's data source, called once per episode with the last message of the transcript as the
solution and ``extra_info["transcript"]`` (every turn as ``{"role": <role>, "content": ...}``);
a mapping keyed by role names gives each role its reward, any other result goes to every role.
A turn reward is set on the role's own turn (``AssistantTurn.turn.reward``). The row's
interaction (``extra_info.interaction_kwargs``) answers a role's turn when the loop asks it
(``RolesEpisode.ask``): its reply goes to that role as a user message, and its reward may be a
mapping by role, each added to that role's latest assistant turn; a ``calculate_score`` mapping by
role is each role's reward when the loop sets none.

``role_metrics`` reports ``role/<name>/reward``, ``role/<name>/tokens`` (sampled tokens) and
``role/<name>/tool_calls``, each a mean over the role's trajectories.
"""

from __future__ import annotations

import asyncio
import dataclasses
import zlib
from typing import Any, Literal, Mapping, Sequence, get_args

from agentrl.agent.loop import (AgentLoop, AssistantTurn, Episode, EpisodeEnd, InteractionFailure, LoopContext, start_interaction,
                                trajectory_instance_id)
from agentrl.agent.tools_runtime import InteractionSession, ToolSession
from agentrl.data.row import Row
from agentrl.errors import ConfigError
from agentrl.rewards import score_to_float
from agentrl.trajectory import Trajectory, TrajectoryBuilder, TrajectoryFinish

__all__ = ["RolePolicy", "RolesEpisode", "RolesLoop", "role_group_id", "role_metrics", "role_policies", "roles_per_sample"]

RolePolicy = Literal["shared", "trained", "frozen"]
POLICIES: tuple[str, ...] = get_args(RolePolicy)


def role_group_id(group_id: str, role: str) -> str:
    """The group a role's trajectory is compared in: the row's group, per role."""
    return f"{group_id}@{role}"


def role_policies(declared: Mapping[str, str], configured: Mapping[str, str], *, loop: str) -> dict[str, RolePolicy]:
    """The loop's roles with their policies, ``agent.roles`` over the loop's own; a configured
    role the loop does not have, an unknown policy, a ``trained`` the config does not name (the
    trainer builds a role's own policy from ``agent.roles``) and no ``shared`` role (the main
    policy would train on nothing) are ``ConfigError``s naming the key."""
    problems = [(f"agent.roles.{name}", f"loop {loop!r} has no role {name!r} (its roles: {', '.join(declared)})")
                for name in configured if name not in declared]
    policies: dict[str, RolePolicy] = {}
    for name, policy in {**declared, **{k: v for k, v in configured.items() if k in declared}}.items():
        if policy not in POLICIES:
            problems.append((f"agent.roles.{name}", f"unknown policy {policy!r} (one of: {', '.join(POLICIES)})"))
        elif policy == "trained" and configured.get(name) != "trained":
            problems.append((f"agent.roles.{name}", f"loop {loop!r} declares role {name!r} trained: set agent.roles.{name}="
                                                    "trained (the trainer builds a role's own policy from the config) or shared"))
        else:
            policies[name] = policy  # type: ignore[assignment]
    if problems:
        raise ConfigError(problems)
    if all(p == "frozen" for p in policies.values()):
        raise ConfigError([("agent.roles", f"loop {loop!r}: every role is frozen, nothing would be trained")])
    if not any(p == "shared" for p in policies.values()):
        raise ConfigError([("agent.roles", f"loop {loop!r}: no role is shared: the main policy would train on nothing "
                                           "(make one role shared; trained roles train policies of their own beside it)")])
    return policies


class RolesEpisode:
    """One episode of several roles: an ``Episode`` per sampled role, and the transcript."""

    def __init__(self, row: Row, ctx: LoopContext, policies: Mapping[str, RolePolicy], episodes: Mapping[str, Episode],
                 loop: "RolesLoop"):
        self.row, self.ctx, self.loop = row, ctx, loop
        self.policies = dict(policies)
        self.episodes = dict(episodes)  # the sampled (shared and trained) roles
        self.transcript: list[dict[str, Any]] = []  # every turn said: {"role": <role>, "content": <text>}
        self.rewards: dict[str, float] = {}  # a loop's own reward per role (else the reward function's)
        self.error: str | None = None
        self.interaction: InteractionSession | None = None  # the row's (extra_info.interaction_kwargs)
        self.interaction_score: Any = None  # its calculate_score: a number, or a mapping by role
        self._unseen: dict[str, list[dict[str, Any]]] = {name: [] for name in policies}

    def episode(self, role: str) -> Episode:
        """The role's own episode (its token stream, messages, tool calls, counters)."""
        if role not in self.policies:
            raise KeyError(f"no role {role!r} in this episode (roles: {', '.join(self.policies)})")
        if role not in self.episodes:
            raise ValueError(f"role {role!r} is frozen: the loop speaks for it (RolesEpisode.say), the policy does not")
        return self.episodes[role]

    def is_sampled(self, role: str) -> bool:
        return role in self.episodes

    async def turn(self, role: str) -> AssistantTurn:
        """Sample the role's next assistant turn in its own context (the other roles' turns it has
        not seen first). An answer without tool calls is said to the other roles; a turn with
        calls is the role's own to execute (``episode(role).call_tools``)."""
        ep = self.episode(role)
        self._catch_up(role, ep)
        step = await ep.assistant_turn()
        if not step.parsed.calls:
            self._publish(role, step.parsed.content)
        return step

    async def ask(self, role: str, step: AssistantTurn) -> None:
        """Let the row's interaction answer the role's turn ``step``: its reward is the turn reward
        (a mapping by role: each role's latest assistant turn gets its own); when it is done the
        episode ends (``interaction_done``), else its reply is the role's next user message."""
        if self.interaction is None:
            raise ValueError("the row has no interaction (extra_info.interaction_kwargs)")
        ep = self.episode(role)
        try:
            response = await self.interaction.respond(ep.messages)
        except Exception as exc:
            raise InteractionFailure(f"{type(exc).__name__}: {exc}") from exc
        given = response.reward
        for name, value in (given.items() if isinstance(given, Mapping) else [(role, given)]):
            if not self.is_sampled(name) and name in self.policies:
                continue  # a frozen role has no turns to credit
            turns = [t for t in self.episode(name).builder.turns if t.role == "assistant"]
            turn = step.turn if name == role else turns[-1] if turns else None
            if turn is not None:
                turn.reward = (turn.reward or 0.0) + float(value)
        if response.done:
            raise EpisodeEnd(TrajectoryFinish.INTERACTION_DONE)
        ep.check_turn("user", 0)
        ep.observe([{"role": "user", "content": response.text}], "user")

    def say(self, role: str, text: str) -> None:
        """A turn of a role the policy does not sample (a scripted responder): said to the others."""
        if role not in self.policies:
            raise KeyError(f"no role {role!r} in this episode (roles: {', '.join(self.policies)})")
        self._publish(role, text)

    def tell(self, role: str, message: dict[str, Any]) -> None:
        """Show a sampled role a message of the loop's own before its next turn (in its prompt
        before its first turn), as the other roles' turns are shown."""
        self.episode(role)  # a role the policy samples
        self._unseen[role].append(message)

    def _publish(self, speaker: str, text: str) -> None:
        self.transcript.append({"role": speaker, "content": text})
        for viewer in self.policies:
            if viewer != speaker:
                message = self.loop.shown(viewer, speaker, text)
                if message is not None:
                    self._unseen[viewer].append(message)

    def _catch_up(self, role: str, ep: Episode) -> None:
        """Show the role what it has not seen: in its prompt before its first turn, else as a user turn."""
        unseen, self._unseen[role] = self._unseen[role], []
        if not unseen:
            return
        if not ep.builder.turns and not ep.earlier_segments:
            ep.messages.extend(unseen)
            ep.builder = TrajectoryBuilder(self.ctx.renderer.prompt_ids(ep.messages, ep.prompt_tools))
            return
        ep.check_turn("user", 0)
        ep.observe(unseen, "user")


class RolesLoop(AgentLoop):
    """Base of a loop with several roles. Subclasses declare ``roles`` (name -> policy), give
    each role its prompt (``role_messages``) and implement ``play_roles``; ``run`` returns one
    trajectory per sampled role, ``role`` set and grouped per role (``role_group_id``)."""

    roles: Mapping[str, RolePolicy] = {}

    def role_messages(self, role: str, row: Row, tool_schemas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The role's prompt (default: the row's)."""
        return row.messages()

    def shown(self, viewer: str, speaker: str, text: str) -> dict[str, Any] | None:
        """How ``speaker``'s turn appears in ``viewer``'s context (None: not at all); default a user message."""
        return {"role": "user", "content": text}

    async def play_roles(self, game: RolesEpisode) -> TrajectoryFinish:
        raise NotImplementedError

    async def play(self, episode: Episode) -> TrajectoryFinish:
        raise TypeError(f"loop {self.name!r} plays several roles: RolesLoop.run drives play_roles")

    async def run(  # type: ignore[override]  # one trajectory per sampled role
        self, row: Row, ctx: LoopContext, *, row_id: str, group_id: str, sample_index: int = 0, seed: int | None = None,
    ) -> list[Trajectory]:
        policies = role_policies(self.roles, ctx.roles, loop=self.name)
        extra = row.extra_info
        instance_id = trajectory_instance_id(group_id, sample_index)
        tools = ctx.toolbox.session(instance_id, extra.tools_kwargs)
        interaction = (ctx.interactions.session(instance_id, extra.interaction_kwargs.model_dump())
                       if extra.interaction_kwargs is not None else None)
        async with tools:
            episodes = {name: self._role_episode(name, row, ctx, tools, row_id=row_id, group_id=group_id,
                                                 sample_index=sample_index, seed=seed)
                        for name, policy in policies.items() if policy != "frozen"}
            for name in (n for n in episodes if policies[n] == "trained"):
                episodes[name].policy = name  # a trained role samples from its own policy
            game = RolesEpisode(row, ctx, policies, episodes, self)
            game.interaction = interaction
            try:
                finish, error = await self._play_game(game, interaction)
            finally:
                if interaction is not None:
                    await interaction.__aexit__(None, None, None)  # finalize, always
            sep = ctx.renderer.separator_ids
            for ep in episodes.values():  # the separator the template writes after a final end-of-turn token
                b = ep.builder
                if ep.last_stopped_on_eos and b.turns and b.turns[-1].role == "assistant" and len(sep) <= ep.tokens_left:
                    b.append_template(sep)
            await tools.collect_rewards()
        rewards, info = self._role_rewards(game, finish)
        out = []
        for name, ep in episodes.items():
            ep.own_score = rewards.get(name, 0.0)
            t = self._finish(ep, finish, error)
            t.reward_info.update(info)
            out.append(dataclasses.replace(t, role=name, group_id=role_group_id(group_id, name)))
        return out

    async def _play_game(self, game: RolesEpisode, interaction: InteractionSession | None) -> tuple[TrajectoryFinish, str | None]:
        """Start the interaction, play under the trajectory timeout, read the interaction's score;
        returns (finish reason, error)."""
        try:
            await start_interaction(interaction)
            finish = TrajectoryFinish.parse(
                await asyncio.wait_for(self.play_roles(game), game.ctx.limits.trajectory_timeout_s),
                where=f"agent loop {self.name!r}: play_roles() returned")
            error = None
        except EpisodeEnd as end:
            finish, error = end.reason, game.error or next((e.error for e in game.episodes.values() if e.error), None)
        except asyncio.TimeoutError:
            return TrajectoryFinish.TRAJECTORY_TIMEOUT, None
        except InteractionFailure as exc:
            return TrajectoryFinish.INTERACTION_ERROR, str(exc)
        if interaction is not None:
            try:
                game.interaction_score = await interaction.score()
            except Exception as exc:
                return TrajectoryFinish.INTERACTION_ERROR, f"calculate_score failed: {type(exc).__name__}: {exc}"
        return finish, error

    def _role_episode(self, name: str, row: Row, ctx: LoopContext, tools: ToolSession, *, row_id: str, group_id: str,
                      sample_index: int, seed: int | None) -> Episode:
        schemas = tools.schemas()
        messages = self.role_messages(name, row, schemas)
        prompt_tools = self.prompt_tools(schemas)
        # each role its own seed and engine session (request ids, the server's prefix cache)
        role_seed = None if seed is None else (seed + zlib.crc32(name.encode())) & 0x7FFFFFFF
        ep = Episode(row, ctx, row_id=row_id, group_id=group_id, sample_index=sample_index, seed=role_seed, tools=tools,
                     interaction=None, messages=messages, prompt_ids=ctx.renderer.prompt_ids(messages, prompt_tools),
                     parser=ctx.parser_for(self.name), prompt_tools=prompt_tools, history=ctx.history_for(self.name))
        ep.session_id = f"{row_id}#{sample_index}@{name}"
        return ep

    def _role_rewards(self, game: RolesEpisode, finish: TrajectoryFinish) -> tuple[dict[str, float], dict[str, Any]]:
        """Each role's reward and what the reward function said (see the module's docstring)."""
        if game.rewards:
            return dict(game.rewards), {"role_rewards": dict(game.rewards)}
        score = game.interaction_score
        if isinstance(score, Mapping) and score and set(score) <= set(game.policies):
            scores = {role: float(value) for role, value in score.items()}
            return scores, {"role_rewards": scores, "interaction_score": scores}
        row = game.row
        fn = game.ctx.reward_fn(row.data_source)
        if fn is None:
            return {}, {}
        solution = game.transcript[-1]["content"] if game.transcript else ""
        extra = {**row.extra_info.model_dump(), "transcript": list(game.transcript)}
        result = fn(row.data_source, solution, row.ground_truth, extra)
        if isinstance(result, Mapping) and result and set(result) <= set(game.policies):
            scores = {role: score_to_float(value)[0] for role, value in result.items()}
            return scores, {"role_rewards": scores}
        score, info = score_to_float(result)
        return {role: score for role in game.episodes}, info


def roles_per_sample(trajectories: Sequence[Trajectory]) -> int:
    """How many trajectories one sample of a row makes: the number of roles (1 without roles)."""
    return max(1, len({t.role for t in trajectories if t.role is not None}))


def role_metrics(trajectories: Sequence[Trajectory], prefix: str = "") -> dict[str, float]:
    """``role/<name>/reward``, ``role/<name>/tokens`` (sampled) and ``role/<name>/tool_calls``:
    means over each role's trajectories (none without roles)."""
    by_role: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        if t.role is not None:
            by_role.setdefault(t.role, []).append(t)
    m: dict[str, float] = {}
    for role, group in sorted(by_role.items()):
        n = len(group)
        m[f"{prefix}role/{role}/reward"] = sum(t.reward for t in group) / n
        m[f"{prefix}role/{role}/tokens"] = sum(sum(t.response_mask) for t in group) / n
        m[f"{prefix}role/{role}/tool_calls"] = sum(t.metrics.get("tool_calls", 0.0) for t in group) / n
    return m
