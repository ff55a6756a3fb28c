"""Trained roles' own policies (agentrl.trainer.role_policies, docs/roles.md): a scripted two-role
episode (a shared solver, a trained verifier) trains the verifier's policy from the verifier's
rows only and the main policy from the solver's only, each exactly as a single-policy step on
those rows; versions and health are per policy; ``agentrl train data=solver_verifier
agent.roles.verifier=trained`` runs, records each policy's version and resumes exactly; the
configurations not built are refused naming their key."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil

import pytest
import torch.distributed as dist

from agentrl.agent.roles import RolesLoop
from agentrl.agent.runner import build_context
from agentrl.agent.scripted import ScriptedEngine
from agentrl.agent.setup import RolloutSetup
from agentrl.config import compose, load_config, validate_config
from agentrl.config.schema import TrainConfig
from agentrl.engines.policies import PolicyEngines
from agentrl.errors import ConfigError
from agentrl.trainer.dist import free_port
from agentrl.trainer.health import HealthStop
from agentrl.trainer.role_policies import RolePolicies
from agentrl.trainer.step import Groups, LocalGroup, RolloutFailed, TrainingStep
from agentrl.trainer.workers import ActorWorker
from agentrl.trajectory import TrajectoryFinish
from tests.agent.agent_helpers import make_row

# sample 0: a right answer and the verdict "right"; sample 1: a wrong answer and the verdict "wrong"
ANSWERS = {("solver", "0"): "#### 408", ("solver", "1"): "#### 407", ("verifier", "0"): "#### 1", ("verifier", "1"): "#### 0"}


def script(row_id, index, request):
    sample, role = request.session_id.rsplit("#", 1)[1].split("@")
    return ANSWERS[(role, sample)]


class Duel(RolesLoop):
    """The solver answers, the verifier judges; rewards by hand: solver [1, 0], verifier [1, 0]."""

    name = "duel"
    roles = {"solver": "shared", "verifier": "shared"}

    async def play_roles(self, game):
        answer = (await game.turn("solver")).parsed.content
        verdict = (await game.turn("verifier")).parsed.content
        game.rewards = {"solver": float(answer == "#### 408"), "verifier": float(verdict == "#### 1")}
        return "stop"


class Local(LocalGroup):
    def call_rank0(self, method, *args, **kwargs):
        return getattr(self.worker, method)(*args, **kwargs)


class EngineSide:
    """The main actor's side of a sync: records what each policy was sent; reports it held."""

    def __init__(self):
        self.synced = []

    def call_rank0(self, method, role, state, version):
        assert method == "sync_policy"
        self.synced.append((role, state, version))
        return version


CFG = TrainConfig.model_validate({
    "data": {"train_batch_size": 1, "max_response_length": 64}, "rollout": {"n": 2},
    "actor": {"ppo_mini_batch_size": 1, "ppo_micro_batch_size_per_gpu": 4, "optim": {"lr": 1e-2}},
    "algorithm": {"adv_estimator": "grpo"}, "agent": {"roles": {"verifier": "trained"}},
})


@pytest.fixture
def make_actor(tiny_model_dir):
    port = free_port()

    def make() -> ActorWorker:
        return ActorWorker(model_path=str(tiny_model_dir), config=CFG.actor, total_steps=4, rank=0, world_size=1,
                           master_addr="127.0.0.1", master_port=port, device="cpu", seed=0)

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()


def rollout(tiny_tokenizer):
    scripted = ScriptedEngine(tiny_tokenizer, script)  # one script answers both policies' requests
    ctx = build_context(PolicyEngines({"": scripted, "verifier": scripted}), tiny_tokenizer, RolloutSetup.from_config(CFG),
                        tool_names=[])
    row = make_row(agent="duel")
    return [t for i in range(2) for t in asyncio.run(Duel().run(row, ctx, row_id="r0", group_id="0:r0", sample_index=i))]


def distance(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_each_policy_trains_on_its_own_roles_rows_exactly_as_a_single_policy_step_on_them(tiny_tokenizer, make_actor):
    trajectories = rollout(tiny_tokenizer)
    assert [(t.role, t.sample_index, t.reward) for t in trajectories] == [
        ("solver", 0, 1.0), ("verifier", 0, 1.0), ("solver", 1, 0.0), ("verifier", 1, 0.0)]
    main, verifier, main_alone, verifier_alone = (make_actor() for _ in range(4))
    initial = {k: v.clone() for k, v in main.full_state().items()}
    policies = RolePolicies(CFG, {"verifier": Local(verifier)},
                            {"verifier": TrainingStep(CFG, Groups(Local(verifier)), pad_token_id=0)}, say=print)

    shared, own = policies.split(trajectories)
    assert [t.role for t in shared] == ["solver", "solver"] and [t.role for t in own["verifier"]] == ["verifier", "verifier"]
    TrainingStep(CFG, Groups(Local(main)), pad_token_id=0).online(shared, step=0)
    engine = EngineSide()
    metrics = policies.train(engine, own, step=0)

    # single-policy steps on just each role's rows, from the same starting weights
    TrainingStep(CFG, Groups(Local(main_alone)), pad_token_id=0).online(trajectories[0::2], step=0)
    TrainingStep(CFG, Groups(Local(verifier_alone)), pad_token_id=0).online(trajectories[1::2], step=0)
    assert distance(verifier.full_state(), verifier_alone.full_state()) < 1e-6
    assert distance(main.full_state(), main_alone.full_state()) < 1e-6
    # each trained, and differently: neither policy took the other's rows
    assert distance(verifier.full_state(), initial) > 1e-3 and distance(main.full_state(), initial) > 1e-3
    assert distance(verifier.full_state(), main.full_state()) > 1e-3

    # the verifier's policy went to the engine at its own next version, the weights it trained
    [(role, state, version)] = engine.synced
    assert (role, version) == ("verifier", 1) and distance(state, verifier.policy_state()) == 0.0
    assert policies.versions == {"verifier": 1}
    assert (metrics["policy/verifier/weight_version"], metrics["policy/verifier/health/synced_version"],
            metrics["policy/verifier/health/engine_version"], metrics["policy/verifier/health/weight_version"]) == (1.0, 1.0, 1.0, 0.0)
    assert metrics["policy/verifier/role/verifier/reward"] == 0.5 and "policy/verifier/role/solver/reward" not in metrics

    # the verifier's trajectories were sampled at version 0; its policy is at 1 now: a sync did not reach the engine
    with pytest.raises(RolloutFailed, match=r"step 2, role 'verifier''s policy: 2 trajectories were sampled by engine weights "
                                            r"older than version 1"):
        policies.train(engine, own, step=1)


def test_a_roles_failed_rollout_stops_the_step_before_any_policy_is_updated(tiny_tokenizer):
    _, own = RolePolicies(CFG, {"verifier": None}, {}, say=print).split(rollout(tiny_tokenizer))
    failed = [dataclasses.replace(t, finish_reason=TrajectoryFinish.ENGINE_ERROR) for t in own["verifier"]]
    policies = RolePolicies(CFG, {"verifier": None}, {}, say=print)
    with pytest.raises(RolloutFailed, match=r"step 4, role 'verifier''s policy: 2 of 2 trajectories failed .* above "
                                            r"trainer\.max_failure_rate=0\.5"):
        policies.check_rollout({"verifier": failed}, step=3)
    policies.check_rollout(own, step=3)  # sampled at version 0, the policy's: nothing to say


def test_a_policys_health_stop_names_the_policy():
    policies = RolePolicies(CFG, {"verifier": None}, {}, say=print)
    policies.check(3, {"policy/verifier/health/synced_version": 2.0, "policy/verifier/health/engine_version": 2.0,
                       "health/synced_version": 9.0, "health/engine_version": 1.0})  # the main policy's are the main monitor's
    with pytest.raises(HealthStop, match=r"policy 'verifier': step 3: after the weight sync to version 2 the engine reports "
                                         r"weight version 1") as info:
        policies.check(3, {"policy/verifier/health/synced_version": 2.0, "policy/verifier/health/engine_version": 1.0})
    assert info.value.measure == "policy/verifier/engine_version"


@pytest.mark.parametrize("override, key", [
    ("actor.world_size=2", "actor.world_size"), ("trainer.workers=ray", "trainer.workers"),
    ("trainer.max_restarts=1", "trainer.max_restarts"), ("engine=sglang", "engine.backend"), ("engine.process=true", "engine.process"),
    ("engine.weight_sync=disk", "engine.weight_sync"), ("rollout.max_staleness=1", "rollout.max_staleness"),
    ("critic.enable=true", "critic.enable"), ("algorithm.use_kl_in_reward=true", "algorithm.use_kl_in_reward"),
])
def test_a_configuration_a_trained_role_cannot_run_with_is_refused_naming_its_key(override, key):
    with pytest.raises(ConfigError) as info:
        validate_config(compose("train", ["data=solver_verifier", "agent.roles.verifier=trained", override]), check_files=False)
    [message] = [m for k, m in info.value.problems if k == key]
    assert message.startswith(f"{key}=") and "is not supported with agent.roles.verifier=trained: a trained role's own policy is " \
                                              "built for one actor rank in the trainer's process" in message



def test_a_job_whose_workers_run_under_ray_is_refused_naming_trainer_workers():
    with pytest.raises(ConfigError) as info:  # RAY_ADDRESS or engine.placement=ray: the config check cannot see it
        RolePolicies.start(CFG, object, in_process=False, policy_source="unused", total_steps=1, env={}, dist={}, reference=None,
                           pad_token_id=0, say=print)
    assert info.value.problems == [("trainer.workers", "agent.roles.verifier=trained runs in the trainer's process only; this "
                                    "job runs its workers under Ray (RAY_ADDRESS or engine.placement=ray)")]


def test_replay_retraining_refuses_a_trained_role_before_reading_the_store(tmp_path):
    from agentrl.replay.train import train_from_store

    with pytest.raises(ConfigError) as info:
        train_from_store(None, CFG, tmp_path)  # type: ignore[arg-type]  # never read: refused first
    assert info.value.problems == [("agent.roles.verifier", "trained: replay retraining trains one policy; a role's own "
                                    "policy is trained by agentrl train only (here use shared)")]


RUN = ["data=solver_verifier", "agent.roles.verifier=trained", "sft.enable=false", "trainer.total_steps=3", "trainer.save_freq=1",
       "trainer.max_checkpoints=3", "data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=2",
       "actor.ppo_micro_batch_size_per_gpu=4", "data.task_train_size=8", "data.task_val_size=2", "trainer.test_freq=0",
       "trainer.final_validation=false", "trainer.val_before_train=false", "logging.progress=false", "trainer.save_rollouts=false"]


def _steps(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if '"reward/mean"' in line]


def test_agentrl_train_with_a_trained_verifier_records_each_policys_version_and_resumes_exactly(tmp_path):
    from agentrl.trainer.run import train

    cfg = load_config("train", [*RUN, f"trainer.runs_root={tmp_path}", "trainer.run_name=r"])
    run = train(cfg).run_dir
    steps = _steps(run / "metrics.jsonl")
    assert [(s["step"], s["policy/verifier/weight_version"], s["health/synced_version"]) for s in steps] == [
        (1.0, 1.0, 1.0), (2.0, 2.0, 2.0), (3.0, 3.0, 3.0)]
    assert all(s["policy/verifier/health/engine_version"] == s["policy/verifier/weight_version"] for s in steps)
    # the verifier's tokens were scored by its own policy: the engine sampled them from its weights
    assert all(s["policy/verifier/health/mismatch_tokens"] > 0 and s["policy/verifier/health/logprob_mismatch"] < 1e-4 for s in steps)
    state = json.loads((run / "checkpoints" / "step_2" / "trainer_state.json").read_text())
    assert (state["weight_version"], state["policy_versions"]) == (2, {"verifier": 2})
    assert (run / "checkpoints" / "step_2" / "policy@verifier" / "actor").is_dir()
    assert (run / "policy@verifier" / "config.json").is_file()  # exported beside the main policy

    shutil.rmtree(run / "checkpoints" / "step_3")  # resume from step 2: step 3 again
    resumed = load_config("train", [*RUN, f"trainer.runs_root={tmp_path}", "trainer.run_name=r", f"trainer.resume={run}"])
    train(resumed)
    again = _steps(run / "metrics.jsonl")[-1]
    same = {k: v for k, v in steps[-1].items() if "timing" not in k and not k.startswith(("tokens/per_s", "perf/", "engine/busy"))}
    assert again["step"] == 3.0 and {k: again.get(k) for k in same} == same


def test_a_trained_role_with_lora_trains_its_own_adapter_and_the_engine_serves_it_merged(tmp_path):
    from agentrl.trainer.run import train

    args = [*RUN, "trainer.total_steps=2", "trainer.save_freq=0", "trainer.export_hf=false", "actor.lora.rank=4",
            "actor.optim.lr=0.01"]  # a step that moves the logprobs: an engine left with the old weights shows 1e-2, not 1e-7
    run = train(load_config("train", [*args, f"trainer.runs_root={tmp_path}", "trainer.run_name=r"])).run_dir
    steps = _steps(run / "metrics.jsonl")
    assert [s["policy/verifier/weight_version"] for s in steps] == [1.0, 2.0]
    # at version 1 the adapters differ from the start: the engine sampled with the role's merged weights
    assert steps[1]["policy/verifier/health/mismatch_tokens"] > 0 and steps[1]["policy/verifier/health/logprob_mismatch"] < 1e-4
