"""verifiers environments (the 0.3 API) run by the ``verifiers_env`` loop: their own rollout code
against agentrl's endpoint, token-exact; the rubric's weighted reward, each function logged as
``env/<name>``, step rewards as turn rewards, group reward functions over the whole group; the
environment's failures counted; its dataset as agentrl rows. The environments are written here
against verifiers' public API, as a third party writes them, and installed as a module of their
own (``vf_test_envs``)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import textwrap

import pytest

from agentrl.agent.runner import LoopTable, RolloutRunner, build_context
from agentrl.agent.scripted import ScriptedEngine
from agentrl.agent.setup import RolloutSetup
from agentrl.config.schema import DataConfig, EnvironmentConfig, RolloutConfig, TrainConfig
from agentrl.data.io import iter_raw_rows
from agentrl.data.row import EnvironmentRef, Row
from agentrl.engines.base import FinishReason
from agentrl.environments import spec
from agentrl.errors import PluginError

vf = pytest.importorskip("verifiers")
av = pytest.importorskip("agentrl.environments.verifiers")

# What a verifiers user writes (a Hub package's module): a ToolEnv over a Python function, a
# MultiTurnEnv with env_response, a @vf.stop condition, a step reward and a group reward function.
ENVS = '''
import verifiers as vf
from datasets import Dataset

GROUP_SIZES = []  # what the group reward function saw
RELEASED = []  # the rollouts whose rubric cleanup ran


class ReleasingRubric(vf.Rubric):
    @vf.cleanup
    async def release(self, state):
        RELEASED.append(state["trajectory_id"])


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: the arithmetic expression, such as 12 * 34
    """
    return str(eval(expression, {"__builtins__": {}}, {}))


def divide(a: int, b: int) -> str:
    """Divide a by b.

    Args:
        a: the dividend
        b: the divisor
    """
    return str(a / b)


def correct(completion, answer) -> float:
    return 1.0 if completion and answer in (completion[-1].content or "") else 0.0


def concise(completion) -> float:
    return 1.0 if completion and len(completion[-1].content or "") < 12 else 0.0


def load_calculator(rows: int = 2, stop_on_division_error: bool = False):
    data = Dataset.from_list([{"question": f"What is {i} * 34?", "answer": str(i * 34)} for i in range(12, 12 + rows)])
    held_out = Dataset.from_list([{"question": "What is 2 * 3?", "answer": "6"}])
    return vf.ToolEnv(dataset=data, eval_dataset=held_out, tools=[calculator, divide], max_turns=3,
                      rubric=ReleasingRubric(funcs=[correct, concise], weights=[1.0, 0.5]), system_prompt="Use the calculator.",
                      stop_errors=[ZeroDivisionError] if stop_on_division_error else None)


class Guess(vf.MultiTurnEnv):
    """Guess the number: the environment answers Higher or Lower; each guess is a step, rewarded
    1 when right."""

    async def setup_state(self, state):
        if state["info"].get("explode"):
            raise RuntimeError("the guessing backend is gone")
        return state

    async def env_response(self, messages, state, **kwargs):
        guess = (messages[-1].content or "").strip()
        if not guess.isdigit():
            return [vf.UserMessage(content="Answer with a number.")]
        return [vf.UserMessage(content="Higher." if int(guess) < int(state["answer"]) else "Lower.")]

    @vf.stop
    async def guessed(self, state) -> bool:
        steps = state["trajectory"]
        return bool(steps) and (steps[-1]["completion"][-1].content or "").strip() == state["answer"]

    async def add_trajectory_step(self, state, step):
        step["reward"] = 1.0 if (step["completion"][-1].content or "").strip() == state["answer"] else 0.0
        await super().add_trajectory_step(state, step)


def solved(completion, answer) -> float:
    return 1.0 if (completion[-1].content or "").strip() == answer else 0.0


def length(completion) -> float:
    return min(sum(len(m.content or "") for m in completion if m.role == "assistant"), 400) / 400


def fewest_guesses(states) -> list[float]:
    GROUP_SIZES.append(len(states))
    turns = [len(s["trajectory"]) for s in states]
    return [1.0 if t == min(turns) else 0.0 for t in turns]


def load_guess(rows: int = 2, explode: int = -1, max_turns: int = 4):
    data = Dataset.from_list([{"question": "Guess my number (1-9).", "answer": str(7 - i), "info": {"explode": i == explode}}
                              for i in range(rows)])
    held_out = Dataset.from_list([{"question": "Guess my number (1-9).", "answer": "3", "info": {"explode": False}}])
    rubric = vf.Rubric(funcs=[solved, fewest_guesses, length], weights=[1.0, 0.5, 0.25])
    return Guess(dataset=data, eval_dataset=held_out, rubric=rubric, max_turns=max_turns)


def load_broken():
    class Broken(vf.MultiTurnEnv):
        async def env_response(self, messages, state, **kwargs):
            raise RuntimeError("the environment's own code failed")

    return Broken(dataset=Dataset.from_list([{"question": "Say hi.", "answer": "hi"}]), max_turns=3)


def open_vault(guess: str, code: str) -> str:
    """Try to open the vault.

    Args:
        guess: the code you try
        code: the vault's code (the environment fills it in)
    """
    return "open" if guess == code else "still closed"


class Vault(vf.StatefulToolEnv):
    """A StatefulToolEnv: the tool's code argument is hidden from the model and filled from the row."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_tool(open_vault, args_to_skip=["code"])

    def update_tool_args(self, tool_name, tool_args, messages, state, **kwargs):
        return {**tool_args, "code": state["info"]["code"]}


def load_vault():
    data = Dataset.from_list([{"question": "Open the vault.", "answer": "open", "info": {"code": "42"}}])
    return Vault(dataset=data, max_turns=3, rubric=vf.Rubric(funcs=[opened], weights=[1.0]))


def opened(completion) -> float:
    return 1.0 if any(m.role == "tool" and m.content == "open" for m in completion) else 0.0


class Verdict(vf.MultiTurnEnv):
    """Guess the number; the environment ends the episode with its verdict (final_env_response)."""

    async def env_response(self, messages, state, **kwargs):
        guess = (messages[-1].content or "").strip()
        if guess == state["answer"]:
            state["final_env_response"] = [vf.UserMessage(content="Correct!")]
            return state["final_env_response"]
        return [vf.UserMessage(content="Higher." if guess.isdigit() and int(guess) < int(state["answer"]) else "Lower.")]


def told_correct(completion) -> float:  # verifiers' own completion ends with the verdict
    return 1.0 if completion[-1].content == "Correct!" else 0.0


def load_verdict():
    data = Dataset.from_list([{"question": "Guess my number (1-9).", "answer": "7"}])
    return Verdict(dataset=data, max_turns=4, rubric=vf.Rubric(funcs=[told_correct], weights=[1.0]))


not_an_env = object()
'''

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 34"}}\n</tool_call>'


@pytest.fixture
def envs(tmp_path, monkeypatch):
    (tmp_path / "vf_test_envs.py").write_text(textwrap.dedent(ENVS))
    monkeypatch.syspath_prepend(str(tmp_path))
    spec.clear_cache()
    yield tmp_path
    spec.clear_cache()
    sys.modules.pop("vf_test_envs", None)


def ref(name: str, **args) -> EnvironmentRef:
    return EnvironmentRef(library="verifiers", name=f"vf_test_envs:{name}", args=args)


def context(engine, tokenizer, env: EnvironmentRef, *, client: str = "chat", max_new_tokens: int = 128):
    cfg = TrainConfig(data=DataConfig(max_response_length=512), rollout=RolloutConfig(max_new_tokens=max_new_tokens),
                      environment=EnvironmentConfig(
        library="verifiers", name=env.name, args=env.args, verifiers={"client": client}))
    return build_context(engine, tokenizer, RolloutSetup.from_config(cfg), tool_names=[])


def rollout(ctx, env: EnvironmentRef, *, n: int = 1, on_done=None):
    rows = [(f"r{i}", Row.model_validate(r)) for i, r in enumerate(av.rows(env))]
    runner = RolloutRunner(ctx, LoopTable("tool_agent"))
    return asyncio.run(runner.run(rows, n=n, on_done=on_done))


def as_prompt_tool(tool) -> dict:
    """A vf.Tool as verifiers' chat client sends it, less OpenAI's ``strict`` (not rendered)."""
    return {"type": "function", "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters}}


def test_a_tool_env_episode_is_the_engines_tokens_and_its_rubric_is_the_reward(envs, tiny_tokenizer):
    env_ref = ref("load_calculator")
    engine = ScriptedEngine(tiny_tokenizer, {"r0": [CALL, "It is 408"], "r1": ["no idea at all"]})
    ctx = context(engine, tiny_tokenizer, env_ref)
    first, second = rollout(ctx, env_ref)
    r, env = ctx.renderer, av.load(env_ref)
    messages = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 12 * 34?"}]
    tools = [as_prompt_tool(t) for t in env.tool_defs]
    assert '"additionalProperties": false' in json.dumps(tools)  # verifiers' strict schema, rendered as sent
    asked = [q.input_ids for q in engine.requests if q.session_id == "r0#0"]
    assert first.prompt_ids == r.prompt_ids(messages, tools) == asked[0]
    sampled1 = tiny_tokenizer.encode(CALL, add_special_tokens=False) + [r.eos_id]
    sampled2 = tiny_tokenizer.encode("It is 408", add_special_tokens=False) + [r.eos_id]
    observed = r.observation_ids([{"role": "tool", "content": "408"}])  # the environment ran the tool
    assert asked[1] == first.prompt_ids + sampled1 + observed  # the sampled ids went back as sampled
    assert first.response_ids == sampled1 + observed + sampled2 + r.separator_ids
    assert first.response_mask == [1] * len(sampled1) + [0] * len(observed) + [1] * len(sampled2) + [0] * len(r.separator_ids)
    assert first.logprobs == [-0.5] * len(sampled1) + [0.0] * len(observed) + [-0.5] * len(sampled2) + [0.0] * len(r.separator_ids)
    assert [(t.role, t.reward) for t in first.turns] == [("assistant", None), ("tool", None), ("assistant", None)]
    assert first.finish_reason == "stop" and second.finish_reason == "stop"
    # the rubric's weighted sum (correct x1 + concise x0.5) is the reward; every function is logged
    assert (first.reward, second.reward) == (1.0 * 1 + 0.5 * 1, 1.0 * 0 + 0.5 * 0)
    assert {k: v for k, v in first.metrics.items() if k.startswith("env/")} == {
        "env/correct": 1.0, "env/concise": 1.0, "env/num_turns": 2.0, "env/total_tool_calls": 1.0,
        "env/calculator_calls": 1.0, "env/divide_calls": 0.0}
    assert first.metrics["tool_calls"] == 1.0 and second.metrics["env/num_turns"] == 1.0


def test_the_token_client_tokenizes_and_sends_prompt_ids_and_gets_the_same_trajectory(envs, tiny_tokenizer, monkeypatch):
    """prime-rl's client: logprobs and token ids back, then /tokenize twice and
    /v1/chat/completions/tokens with the ids it stitched; they extend the context exactly."""
    from agentrl.agent.openai_endpoint import EndpointSession

    routes: list[str] = []
    tokenize, complete = EndpointSession.tokenize, EndpointSession.complete
    monkeypatch.setattr(EndpointSession, "tokenize", lambda self, body: routes.append("tokenize") or tokenize(self, body))

    async def recording(self, body, *, with_tokens=False):
        routes.append(f"tokens(logprobs={body.get('logprobs')}, ids={body.get('return_token_ids')})" if with_tokens
                      else f"chat(logprobs={body.get('logprobs')}, ids={body.get('return_token_ids')})")
        return await complete(self, body, with_tokens=with_tokens)

    monkeypatch.setattr(EndpointSession, "complete", recording)
    env_ref = ref("load_calculator", rows=1)
    by_client = {}
    for client in ("chat", "token"):
        engine = ScriptedEngine(tiny_tokenizer, {"r0": [CALL, "It is 408"]})
        (by_client[client],) = rollout(context(engine, tiny_tokenizer, env_ref, client=client), env_ref)
    assert routes == ["chat(logprobs=None, ids=None)", "chat(logprobs=None, ids=None)",
                      "chat(logprobs=True, ids=True)", "tokenize", "tokenize", "tokens(logprobs=True, ids=True)"]
    chat, token = by_client["chat"], by_client["token"]
    assert token.metrics["segment_splits"] == 0 and token.reward == chat.reward == 1.5
    assert (token.prompt_ids, token.response_ids, token.response_mask, token.logprobs) == (
        chat.prompt_ids, chat.response_ids, chat.response_mask, chat.logprobs)


def test_a_multi_turn_env_answers_as_the_user_and_its_step_rewards_become_turn_rewards(envs, tiny_tokenizer):
    env_ref = ref("load_guess", rows=1)
    engine = ScriptedEngine(tiny_tokenizer, {"r0": ["5", "7"]})
    ctx = context(engine, tiny_tokenizer, env_ref)
    (t,) = rollout(ctx, env_ref)
    r = ctx.renderer
    s1, s2 = (tiny_tokenizer.encode(x, add_special_tokens=False) + [r.eos_id] for x in ("5", "7"))
    observed = r.observation_ids([{"role": "user", "content": "Higher."}])  # env_response, as a user turn
    assert t.prompt_ids == r.prompt_ids([{"role": "user", "content": "Guess my number (1-9)."}])
    assert t.response_ids == s1 + observed + s2 + r.separator_ids
    assert t.response_mask == [1] * len(s1) + [0] * len(observed) + [1] * len(s2) + [0] * len(r.separator_ids)
    # each guess's step reward on its own turn; the @vf.stop condition ended the episode
    assert [(x.role, x.reward) for x in t.turns] == [("assistant", 0.0), ("user", None), ("assistant", 1.0)]
    assert t.finish_reason == "stop" and t.metrics["turns"] == 2.0
    # solved x1 + fewest_guesses x0.5 (alone in its group) + length x0.25 ("5" and "7": 2 of 400 characters)
    assert t.reward == pytest.approx(1.0 + 0.5 + 0.25 * 2 / 400, abs=1e-12)


def test_a_group_reward_function_sees_the_whole_group_before_any_member_is_handed_on(envs, tiny_tokenizer):
    env_ref = ref("load_guess", rows=1)

    def script(row_id, call, request):  # sample 0 guesses right away, the others need two guesses
        first = "7" if request.session_id.endswith("#0") else "5"
        return [first, "7"][call]

    engine = ScriptedEngine(tiny_tokenizer, script)
    ctx = context(engine, tiny_tokenizer, env_ref)
    handed_on = []
    group = rollout(ctx, env_ref, n=3, on_done=lambda t: handed_on.append((t.sample_index, t.reward)))
    import vf_test_envs

    assert vf_test_envs.GROUP_SIZES == [3]
    assert [t.metrics["env/fewest_guesses"] for t in group] == [1.0, 0.0, 0.0]
    # solved + 0.5 x fewest_guesses + 0.25 x characters/400
    assert [t.reward for t in group] == pytest.approx([1.0 + 0.5 + 0.25 / 400, 1.0 + 0.25 * 2 / 400, 1.0 + 0.25 * 2 / 400])
    assert sorted(handed_on) == [(t.sample_index, t.reward) for t in group]  # rewards set before on_done saw them


def test_the_environments_failures_end_the_trajectory_as_environment_errors_counted_by_kind(envs, tiny_tokenizer):
    division = '<tool_call>\n{"name": "divide", "arguments": {"a": 1, "b": 0}}\n</tool_call>'
    stopping = ref("load_calculator", rows=1, stop_on_division_error=True)
    engine = ScriptedEngine(tiny_tokenizer, {"r0": [division, "done"]})
    (t,) = rollout(context(engine, tiny_tokenizer, stopping), stopping)
    assert t.finish_reason == "environment_error" and t.reward == 0.0
    assert t.metrics["env_errors/ToolCallError"] == 1.0 and t.reward_info["error_kind"] == "ToolCallError"
    assert sum(t.response_mask) > 0 and len(engine.requests) == 1  # its sampled turn is kept (out of the loss)
    import vf_test_envs

    assert len(vf_test_envs.RELEASED) == 1  # not scored, but the rubric's cleanup released its resources

    broken = ref("load_broken")
    engine = ScriptedEngine(tiny_tokenizer, {"r0": ["hi", "hi"]})
    (t,) = rollout(context(engine, tiny_tokenizer, broken), broken)
    assert t.finish_reason == "environment_error" and t.metrics["env_errors/exception"] == 1.0
    assert t.reward_info["error"] == "RuntimeError: the environment's own code failed"

    # without the environment asking to stop on it, a tool's exception is the model's to read
    lenient = ref("load_calculator", rows=1)
    engine = ScriptedEngine(tiny_tokenizer, {"r0": [division, "done"]})
    (t,) = rollout(context(engine, tiny_tokenizer, lenient), lenient)
    assert t.finish_reason == "stop" and "division by zero" in tiny_tokenizer.decode(t.response_ids)


def test_the_dataset_becomes_rows_that_survive_parquet_and_give_the_environment_its_own_row_back(envs, tmp_path):
    env_ref = ref("load_calculator", rows=2)
    env = av.load(env_ref)
    path = av.write_rows(env_ref, tmp_path / "calc.parquet")
    rows = [Row.model_validate(raw) for _, raw in iter_raw_rows(path)]
    assert [r.ground_truth for r in rows] == ["408", "442"] and rows[0].data_source == "verifiers/vf_test_envs:load_calculator"
    assert rows[0].environment_ref() == env_ref and rows[0].agent_name is None
    assert rows[1].messages() == [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 13 * 34?"}]
    own = env.get_dataset().to_list()
    assert [av.rollout_input(r, example_id=i) for i, r in enumerate(rows)] == own
    assert [r["reward_model"]["ground_truth"] for r in av.dataset_rows(env_ref, "eval")] == ["6"]
    assert av.rows(ref("load_broken"), split="eval") == []
    # an agentrl row of its own, mapped onto the environment: prompt, answer, info
    plain = Row.model_validate({"data_source": "mine", "prompt": [{"role": "user", "content": "What is 2 * 3?"}],
                                "reward_model": {"ground_truth": "6"}, "extra_info": {"index": 4, "verifiers_info": {"k": 1}}})
    assert av.rollout_input(plain, example_id=4) == {"prompt": [{"role": "user", "content": "What is 2 * 3?"}],
                                                      "answer": "6", "info": {"k": 1}, "example_id": 4}


def test_a_name_that_is_no_verifiers_environment_is_refused_naming_it(envs):
    with pytest.raises(PluginError, match=r"'vf_test_envs:not_an_env'.*has no load_environment"):
        av.load(ref("not_an_env"))
    with pytest.raises(PluginError, match=r"load_environment\(\*\*\{'nope': 1\}\) raised TypeError"):
        av.load(ref("load_guess", nope=1))
    with pytest.raises(PluginError, match="returned str, not a verifiers Environment"):
        av.load(EnvironmentRef(library="verifiers", name="json:dumps", args={"obj": 1}))


def test_a_group_that_cannot_be_scored_is_handed_on_as_loop_errors_with_the_reason(envs, tiny_tokenizer):
    from agentrl_agent_loops.verifiers_env import VerifiersEnvLoop

    class Unreachable(VerifiersEnvLoop):
        async def finish_group(self, group):
            raise RuntimeError("the judge is unreachable")

    class Loops(LoopTable):
        def get(self, name):
            return loop

    loop = Unreachable()
    env_ref = ref("load_guess", rows=1)
    ctx = context(ScriptedEngine(tiny_tokenizer, {"r0": ["7"]}), tiny_tokenizer, env_ref)
    rows = [("r0", Row.model_validate(av.rows(env_ref)[0]))]
    group = asyncio.run(RolloutRunner(ctx, Loops("tool_agent")).run(rows, n=2))
    assert [t.finish_reason for t in group] == ["loop_error", "loop_error"]
    assert {t.reward_info["error"] for t in group} == {"finishing the group failed: RuntimeError: the judge is unreachable"}


def test_a_stateful_tool_env_hides_the_argument_it_fills_in_from_the_rows_state(envs, tiny_tokenizer):
    env_ref = ref("load_vault")
    call = '<tool_call>\n{"name": "open_vault", "arguments": {"guess": "42"}}\n</tool_call>'
    engine = ScriptedEngine(tiny_tokenizer, {"r0": [call, "Done."]})
    ctx = context(engine, tiny_tokenizer, env_ref)
    (t,) = rollout(ctx, env_ref)
    r = ctx.renderer
    prompt = tiny_tokenizer.decode(t.prompt_ids)
    assert '"guess"' in prompt and '"code"' not in prompt  # the model is shown guess only
    sampled1 = tiny_tokenizer.encode(call, add_special_tokens=False) + [r.eos_id]
    observed = r.observation_ids([{"role": "tool", "content": "open"}])  # the row's code reached the tool
    assert t.response_ids[: len(sampled1) + len(observed)] == sampled1 + observed
    assert t.finish_reason == "stop" and t.reward == 1.0 and t.metrics["env/open_vault_calls"] == 1.0


def test_rollout_on_a_configured_environment_runs_its_eval_dataset_else_its_dataset(envs, tiny_model_dir, tmp_path, capsys):
    """``agentrl rollout environment.library=verifiers environment.name=X`` needs no data files:
    the rows are the environment's eval dataset (load_calculator has one: "What is 2 * 3?"),
    else its dataset (load_vault has none), as ``agentrl train`` builds them."""
    from agentrl.agent.rollout_cli import cli_main
    from agentrl.data.rollout_store import RolloutStore

    script = tmp_path / "answers.jsonl"
    script.write_text(json.dumps({"row": "verifiers/vf_test_envs:load_calculator:0", "answers": ["6"]}) + "\n"
                      + json.dumps({"row": "verifiers/vf_test_envs:load_vault:0", "answers": [
                          '<tool_call>\n{"name": "open_vault", "arguments": {"guess": "42"}}\n</tool_call>', "Done."]}) + "\n")
    stored = {}
    for name, run in (("load_calculator", "calc"), ("load_vault", "vault")):
        argv = ["environment.library=verifiers", f"environment.name=vf_test_envs:{name}", f"model.path={tiny_model_dir}",
                "engine=scripted", f"engine.script={script}", "rollout.n=2", f"trainer.runs_root={tmp_path}",
                f"trainer.run_name={run}", "logging.progress=false"]
        assert cli_main(argv) == 0
        err = capsys.readouterr().err
        stored[name] = [s.trajectory for s in RolloutStore(tmp_path / run / "rollouts").iter_stored()]
        if name == "load_calculator":
            assert "rows: 1 from the eval dataset of the verifiers environment 'vf_test_envs:load_calculator'" in err
        else:
            assert "rows: 1 from the dataset (it has no eval dataset) of the verifiers environment 'vf_test_envs:load_vault'" in err
    calc, vault = stored["load_calculator"], stored["load_vault"]
    assert [(t.row_id, t.sample_index, t.agent_name) for t in calc] == [
        ("verifiers/vf_test_envs:load_calculator:0", 0, "verifiers_env"), ("verifiers/vf_test_envs:load_calculator:0", 1, "verifiers_env")]
    assert [t.ground_truth for t in calc] == ["6", "6"] and [t.reward for t in calc] == [1.5, 1.5]  # correct x1 + concise x0.5
    assert [(t.ground_truth, t.reward, t.metrics["env/open_vault_calls"]) for t in vault] == [("open", 1.0, 1.0)] * 2


def test_replay_rerun_scores_a_group_rubric_over_the_stored_group(envs, tiny_tokenizer, tmp_path):
    """``agentrl replay rerun`` hands a re-run group to the loop's finish_group, as the runner
    does: fewest_guesses sees the 3 re-run samples and the rewards equal the stored ones; a
    filter that selects one sample re-runs the rest of its group beside it (not reported)."""
    from agentrl.data.rollout_store import RolloutStore
    from agentrl.replay.rerun import group_companions, rerun_trajectories

    env_ref = ref("load_guess", rows=1)

    def script(row_id, call, request):  # sample 0 guesses right away, the others need two guesses
        return ["7" if request.session_id.endswith("#0") else "5", "7"][call]

    ctx = context(ScriptedEngine(tiny_tokenizer, script), tiny_tokenizer, env_ref)
    rows = [(f"r{i}", Row.model_validate(r)) for i, r in enumerate(av.rows(env_ref))]
    store = RolloutStore(tmp_path / "rollouts")
    store.write_step(0, asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run(rows, n=3)), rows=rows)
    records = list(store.iter_stored())
    stored = [r.trajectory.reward for r in records]
    assert stored == pytest.approx([1.0 + 0.5 + 0.25 / 400, 1.0 + 0.25 * 2 / 400, 1.0 + 0.25 * 2 / 400])
    import vf_test_envs

    vf_test_envs.GROUP_SIZES.clear()
    loops = LoopTable("tool_agent")
    results = asyncio.run(rerun_trajectories(records, context(None, tiny_tokenizer, env_ref), loops))
    assert [r.differences for r in results] == [[]] * 3 and [r.rerun.reward for r in results] == stored
    assert [r.rerun.metrics["env/fewest_guesses"] for r in results] == [1.0, 0.0, 0.0] and vf_test_envs.GROUP_SIZES == [3]
    # one sample selected: its two group members re-run beside it, only it is compared
    picked = records[1:2]
    companions = group_companions(store, picked, loops)
    assert [c.trajectory.sample_index for c in companions] == [0, 2]
    [alone] = asyncio.run(rerun_trajectories(picked, context(None, tiny_tokenizer, env_ref), loops, companions=companions))
    assert alone.matches and alone.rerun.reward == stored[1] and vf_test_envs.GROUP_SIZES == [3, 3]
    # without them it is a group of one, where its two guesses are the fewest: a different reward
    [solo] = asyncio.run(rerun_trajectories(picked, context(None, tiny_tokenizer, env_ref), loops))
    assert [d.kind for d in solo.differences] == ["reward"] and solo.rerun.reward == pytest.approx(stored[1] + 0.5)


class LengthFirst(ScriptedEngine):
    """An engine that checks the length limit before the stop ids, as SGLang and agentrl's builtin
    engine do: an end-of-turn id sampled as the last allowed token comes back as ``length``."""

    async def generate(self, request):
        result = await super().generate(request)
        if result.finish_reason.value == "stop" and len(result.output_ids) == request.sampling.max_new_tokens:
            result = dataclasses.replace(result, finish_reason=FinishReason.LENGTH, matched_stop=None)
        return result


def test_an_end_of_turn_id_sampled_as_the_last_allowed_token_ends_the_turn_and_a_rerun_gives_the_stored_tokens(
        envs, tiny_tokenizer, tmp_path):
    """A malformed call whose end-of-turn id is the turn's last allowed token: the engine says
    ``length``, the content verifiers echoes back has no ``<|im_end|>``, the observation after it
    is the template's (separator first), and ``agentrl replay rerun`` (whose engine says ``stop``)
    re-runs the stored tokens exactly."""
    from agentrl.data.rollout_store import RolloutStore
    from agentrl.replay.rerun import rerun_trajectories

    env_ref = ref("load_guess", rows=1)
    bad = '<tool_call>\n{"name": oops}\n</tool_call>'
    limit = len(tiny_tokenizer.encode(bad, add_special_tokens=False)) + 1  # the end-of-turn id is the last allowed
    engine = LengthFirst(tiny_tokenizer, {"r0": [bad, "7"]})
    ctx = context(engine, tiny_tokenizer, env_ref, max_new_tokens=limit)
    (t,) = rollout(ctx, env_ref)
    r = ctx.renderer
    s1, s2 = (tiny_tokenizer.encode(x, add_special_tokens=False) + [r.eos_id] for x in (bad, "7"))
    observed = r.observation_ids([{"role": "user", "content": "Answer with a number."}])
    assert tiny_tokenizer.decode(observed).startswith("\n<|im_start|>user\n")  # the separator the template writes
    assert t.response_ids == s1 + observed + s2 + r.separator_ids
    assert t.response_mask == [1] * len(s1) + [0] * len(observed) + [1] * len(s2) + [0] * len(r.separator_ids)
    assert t.messages[1] == {"role": "assistant", "content": bad}  # no end-of-turn text in what verifiers read
    assert t.prompt_ids + t.response_ids[:-len(r.separator_ids)] == r.render_ids(t.messages)[:-len(r.separator_ids)]
    assert t.finish_reason == "stop" and t.metrics["tool_errors/bad_json"] == 1.0
    store = RolloutStore(tmp_path / "rollouts")
    store.write_step(0, [t], rows=[("r0", Row.model_validate(av.rows(env_ref)[0]))])
    [again] = asyncio.run(rerun_trajectories(list(store.iter_stored()), context(None, tiny_tokenizer, env_ref, max_new_tokens=limit),
                                             LoopTable("tool_agent")))
    assert again.differences == [] and again.rerun.response_ids == t.response_ids


def test_the_environments_final_reply_ends_the_messages_and_the_token_stream_ends_with_the_answer(envs, tiny_tokenizer,
                                                                                                  tmp_path, capsys):
    """final_env_response ("Correct!", what verifiers' own completion ends with) is kept as the
    trajectory's last message; the tokens, masks and logprobs are what they were without it (the
    last answer, then the template's separator), so nothing trained changes; replay show prints it."""
    from agentrl.data.rollout_store import RolloutStore
    from agentrl.replay.cli import cli_main

    env_ref = ref("load_verdict")
    ctx = context(ScriptedEngine(tiny_tokenizer, {"r0": ["5", "7"]}), tiny_tokenizer, env_ref)
    (t,) = rollout(ctx, env_ref)
    r = ctx.renderer
    s1, s2 = (tiny_tokenizer.encode(x, add_special_tokens=False) + [r.eos_id] for x in ("5", "7"))
    observed = r.observation_ids([{"role": "user", "content": "Higher."}])
    assert t.response_ids == s1 + observed + s2 + r.separator_ids
    assert t.response_mask == [1] * len(s1) + [0] * len(observed) + [1] * len(s2) + [0] * len(r.separator_ids)
    assert t.logprobs == [-0.5] * len(s1) + [0.0] * len(observed) + [-0.5] * len(s2) + [0.0] * len(r.separator_ids)
    assert t.messages[-3:] == [{"role": "user", "content": "Higher."}, {"role": "assistant", "content": "7"},
                               {"role": "user", "content": "Correct!"}]
    assert t.prompt_ids + t.response_ids == r.render_ids(t.messages[:-1])  # the stream: through the last answer
    assert t.finish_reason == "stop" and t.reward == 1.0  # the rubric judged verifiers' completion, verdict included
    store = RolloutStore(tmp_path / "rollouts")
    store.write_step(1, [t])
    assert cli_main(["show", str(store.root)]) == 0
    out = capsys.readouterr().out.splitlines()
    at = out.index("  ── user: the episode's last message, after its last turn (not in the tokens)")
    assert out[at + 1] == "    ┆ Correct!"
