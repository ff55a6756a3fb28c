"""Keys that the configured run does not read (#47: no silent no-op configuration).

A key set on the command line that the run would ignore is named before any work, with why:
an SGLang server key with ``engine.backend=builtin``, a critic key with GRPO, an asynchronous key
with ``rollout.max_staleness=0``, ... Each rule says when its keys are inert and why; the keys
outside every rule are read by the run (``tests/trainer/test_config_consumed.py`` walks the
schema against short runs of representative configurations to prove it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from agentrl.config.health import GROUP_RELATIVE
from agentrl.config.schema import TrainConfig

__all__ = ["Inert", "RULES", "inert_reason", "inert_overrides"]

_SGLANG = ("engine.servers", "engine.launch_args", "engine.num_servers", "engine.tp_size", "engine.mem_fraction_static",
           "engine.context_length", "engine.attention_backend", "engine.max_total_tokens", "engine.device", "engine.python",
           "engine.launcher", "engine.ready_timeout_s", "engine.placement", "engine.placement_strategy",
           "engine.cpus_per_server", "engine.request_timeout_s", "engine.max_retries")
_BUILTIN = ("engine.max_batch_size", "engine.decode_graphs", "engine.process", "engine.threads")


@dataclass(frozen=True)
class Inert:
    keys: tuple[str, ...]  # keys, or sections ending in "."
    applies: Callable[[TrainConfig], bool]  # whether the keys are inert in this configuration
    why: Callable[[TrainConfig], str]

    exempt: tuple[str, ...] = ()  # keys of a covered section that the rule's condition itself reads

    def covers(self, key: str) -> bool:
        return key not in self.exempt and any(key == k or (k.endswith(".") and key.startswith(k)) for k in self.keys)


def _no_warm_start(c: TrainConfig) -> bool:  # as Trainer._setup decides (a resumed run skips it too)
    return not c.sft.enable or (c.model.path is not None and not c.sft.train_files)


RULES: tuple[Inert, ...] = (
    Inert(_SGLANG, lambda c: c.engine.backend != "sglang",
          lambda c: f"it configures SGLang servers and engine.backend={c.engine.backend}"),
    Inert(("engine.placement_strategy", "engine.cpus_per_server"), lambda c: c.engine.placement != "ray",
          lambda c: f"it places servers with Ray and engine.placement={c.engine.placement}"),
    Inert(_BUILTIN, lambda c: c.engine.backend != "builtin",
          lambda c: f"it configures the built-in engine and engine.backend={c.engine.backend}"),
    Inert(("engine.script",), lambda c: c.engine.backend != "scripted",
          lambda c: f"it is engine=scripted's answers and engine.backend={c.engine.backend}"),
    Inert(("critic.", "trainer.critic_warmup"), lambda c: not c.critic.enable,
          lambda c: f"the run has no critic (algorithm.adv_estimator={c.algorithm.adv_estimator}; algorithm=ppo, or "
                    "critic.enable=true, trains one)", exempt=("critic.enable",)),
    Inert(("rollout.stale_groups", "rollout.max_wait_s", "trainer.health.stale_groups."),  # rollout.partial: refused
          lambda c: c.rollout.max_staleness == 0,
          lambda c: "it configures asynchronous training and rollout.max_staleness=0 (synchronous)"),
    Inert(("rollout.max_failure_rate",), lambda c: True,
          lambda c: "it is agentrl rollout's bound; agentrl train stops at trainer.max_failure_rate"),
    Inert(("algorithm.filter_groups.",), lambda c: c.rollout.max_staleness > 0,
          lambda c: f"rollout.max_staleness={c.rollout.max_staleness}: an asynchronous step trains the groups as they "
                    "finish; dynamic sampling is the synchronous trainer's"),
    Inert(("actor.lora.alpha", "actor.lora.dropout", "actor.lora.target_modules"), lambda c: c.actor.lora.rank == 0,
          lambda c: "actor.lora.rank=0: no adapters (full fine-tuning)"),
    Inert(("algorithm.kl_ctrl.", "algorithm.kl_penalty"), lambda c: not c.algorithm.use_kl_in_reward,
          lambda c: "algorithm.use_kl_in_reward=false: no KL penalty in the reward (actor.use_kl_loss is the loss's)"),
    Inert(("algorithm.kl_ctrl.target_kl", "algorithm.kl_ctrl.horizon"), lambda c: c.algorithm.kl_ctrl.type == "fixed",
          lambda c: "algorithm.kl_ctrl.type=fixed: only the adaptive controller has a target"),
    Inert(("actor.kl_loss_coef", "actor.kl_loss_type"), lambda c: not c.actor.use_kl_loss,
          lambda c: "actor.use_kl_loss=false"),
    Inert(("algorithm.filter_groups.max_num_gen_batches",), lambda c: not c.algorithm.filter_groups.enable,
          lambda c: "algorithm.filter_groups.enable=false"),
    Inert(("algorithm.overlong_buffer.len", "algorithm.overlong_buffer.penalty_factor"),
          lambda c: not c.algorithm.overlong_buffer.enable, lambda c: "algorithm.overlong_buffer.enable=false"),
    Inert(("actor.rollout_correction.method", "actor.rollout_correction.cap", "actor.rollout_correction.outlier_threshold"),
          lambda c: c.actor.rollout_correction.level is None, lambda c: "actor.rollout_correction.level=null (off)"),
    Inert(("trainer.health.uniform_groups.",), lambda c: c.algorithm.adv_estimator not in GROUP_RELATIVE,
          lambda c: f"algorithm.adv_estimator={c.algorithm.adv_estimator} still has advantages where a group's samples "
                    "all got one reward (uniform groups stop only the group-relative estimators)"),
    Inert(("algorithm.lam",), lambda c: c.algorithm.adv_estimator != "gae",
          lambda c: f"only GAE has a lambda (algorithm.adv_estimator={c.algorithm.adv_estimator})"),
    Inert(("algorithm.gamma",), lambda c: c.algorithm.adv_estimator not in ("gae", "reinforce_plus_plus"),
          lambda c: f"only gae and reinforce_plus_plus discount (algorithm.adv_estimator={c.algorithm.adv_estimator})"),
    Inert(("algorithm.norm_adv_by_std_in_grpo",), lambda c: c.algorithm.adv_estimator != "grpo",
          lambda c: f"it is GRPO's (algorithm.adv_estimator={c.algorithm.adv_estimator})"),
    Inert(("algorithm.grpo_turn_credit", "algorithm.turn_gamma"), lambda c: c.algorithm.adv_estimator not in ("grpo", "drgrpo"),
          lambda c: f"it is GRPO's (algorithm.adv_estimator={c.algorithm.adv_estimator})"),
    Inert(("algorithm.turn_gamma",), lambda c: not c.algorithm.grpo_turn_credit, lambda c: "algorithm.grpo_turn_credit=false"),
    Inert(("algorithm.rpp_reset_at_observations",), lambda c: c.algorithm.adv_estimator != "reinforce_plus_plus",
          lambda c: f"it is REINFORCE++'s (algorithm.adv_estimator={c.algorithm.adv_estimator})"),
    Inert(("sft.",), _no_warm_start,
          lambda c: "there is no SFT warm start (sft.enable=false, or model.path set without sft.train_files)",
          exempt=("sft.enable",)),
    Inert(("model.tiny.",), lambda c: c.model.path is not None, lambda c: "model.path is set: the tiny model is not built"),
    Inert(("logging.project",), lambda c: not {"wandb", "mlflow"} & set(c.logging.loggers),
          lambda c: "only wandb and mlflow have projects (logging.loggers)"),
)


def inert_reason(cfg: TrainConfig, key: str) -> str | None:
    """Why ``key`` (``actor.lora.alpha``) has no effect in ``cfg``; None when the run reads it."""
    for rule in RULES:
        if rule.covers(key) and rule.applies(cfg):
            return rule.why(cfg)
    return None


def inert_overrides(cfg: TrainConfig, overrides: Iterable[str]) -> list[tuple[str, str]]:
    """(override, why) for each ``key=value`` of ``overrides`` (a command line's) that ``cfg`` does
    not read; verl's names are read as agentrl's, group choices (``algorithm=ppo``) are skipped."""
    from agentrl.config.verl import translate

    found = []
    for text in overrides:
        key, sep, value = text.lstrip("+~").partition("=")
        if not sep or "." not in key:
            continue
        ours = translate(key, value).key or key
        why = inert_reason(cfg, ours)
        if why is not None:
            found.append((text, why))
    return found
