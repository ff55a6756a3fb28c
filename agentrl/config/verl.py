"""verl's names at the command line: the one table from verl's dotted keys to agentrl's.

A verl user's ``main_ppo`` overrides are accepted unchanged. Each verl key is either

* **mapped** onto agentrl's own setting (``actor_rollout_ref.actor.optim.lr`` sets
  ``actor.optim.lr``), with the value translated where verl's sentinel differs
  (``trainer.save_freq=-1``, verl's "never", is agentrl's ``0``);
* **accepted without effect**, with one warning line saying why (``actor_rollout_ref.rollout.mode``:
  agentrl's rollouts are always asynchronous);
* **refused**, where silently ignoring it would train something else than asked
  (``actor_rollout_ref.actor.optim.lr_warmup_steps_ratio``).

Keys that verl and agentrl spell alike (``algorithm.adv_estimator``, ``data.train_batch_size``,
``trainer.critic_warmup``, ...) need no entry. agentrl's own names stay primary: errors and docs
use them, and ``docs/verl.md`` lists every entry of this table (a test keeps the two equal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["Mapped", "NoEffect", "Refused", "VERL_KEYS", "VERL_PREFIXES", "Translation", "translate"]


@dataclass(frozen=True)
class Mapped:
    """The verl key sets ``target``; ``convert`` turns verl's value text into agentrl's."""

    target: str
    convert: Callable[[str], str] | None = None
    note: str = ""


@dataclass(frozen=True)
class NoEffect:
    """Accepted so verl's scripts run unchanged; ``why`` is printed once."""

    why: str


@dataclass(frozen=True)
class Refused:
    """A verl option whose meaning agentrl cannot honour."""

    why: str


Rule = Mapped | NoEffect | Refused


def _never_is_zero(value: str) -> str:
    """verl's ``-1`` ("never") for a frequency is agentrl's ``0``."""
    return "0" if value.strip() in ("-1", "-1.0") else value


def _as_list(value: str) -> str:
    """verl's scripts give one file as a plain string; agentrl's file keys are lists."""
    text = value.strip()
    return text if text.startswith("[") else f"[{text}]"


_FSDP = "agentrl sets FSDP2 itself (each decoder layer and the root sharded; no CPU offload)"
_ENGINE = "agentrl's engine is chosen with engine=builtin or engine=sglang and sized by engine.*"
_MICRO = "agentrl's log-prob passes use actor.ppo_micro_batch_size_per_gpu"

# verl key (exact) -> rule. Grouped as verl's ppo_trainer.yaml is.
VERL_KEYS: dict[str, Rule] = {
    # data
    "data.train_files": Mapped("data.train_files", _as_list),
    "data.val_files": Mapped("data.val_files", _as_list),
    "data.val_batch_size": NoEffect("the whole validation set is rolled out at once (verl deprecates this key too)"),
    "data.return_raw_chat": NoEffect("agentrl always renders the raw chat messages with the policy's chat template"),
    "data.filter_overlong_prompts": NoEffect("a prompt over data.max_prompt_length is an error naming the row when its batch is built"),
    "data.filter_overlong_prompts_workers": NoEffect("see data.filter_overlong_prompts"),
    "data.truncation": NoEffect("agentrl never truncates a prompt: one over data.max_prompt_length is an error"),
    "data.prompt_key": NoEffect("rows are read with verl's schema: the prompt is the `prompt` column"),
    "data.reward_fn_key": NoEffect("rewards are chosen by data_source through reward.by_data_source / reward.default"),
    "data.dataloader_num_workers": NoEffect("rows are read in record batches on the driver; there are no loader workers"),
    "data.trust_remote_code": NoEffect("agentrl loads tokenizers from local directories only"),
    # actor_rollout_ref.model
    "actor_rollout_ref.model.path": Mapped("model.path"),
    "actor_rollout_ref.model.enable_gradient_checkpointing": Mapped("model.gradient_checkpointing"),
    "actor_rollout_ref.model.use_remove_padding": NoEffect("the trainer already packs sequences or cuts rows into length buckets (little padding)"),
    "actor_rollout_ref.model.enable_activation_offloading": NoEffect("activation offloading is not implemented; gradient checkpointing is"),
    "actor_rollout_ref.model.use_shm": NoEffect("models are read from a local directory"),
    "actor_rollout_ref.model.trust_remote_code": NoEffect("agentrl loads architectures that transformers ships"),
    "actor_rollout_ref.model.use_fused_kernels": NoEffect("the trainer's forward is agentrl's own (see docs/architecture.md)"),
    "actor_rollout_ref.model.lora_rank": Mapped("actor.lora.rank", note="LoRA on the actor through peft (agentrl[lora])"),
    "actor_rollout_ref.model.lora_alpha": Mapped("actor.lora.alpha"),
    "actor_rollout_ref.model.target_modules": Mapped("actor.lora.target_modules", _as_list, note="verl's all-linear is peft's"),
    "actor_rollout_ref.hybrid_engine": NoEffect("the actor's rank 0 always hosts the rollout engine (built-in engine)"),
    # actor_rollout_ref.actor (keys agentrl spells alike are mapped by VERL_PREFIXES)
    "actor_rollout_ref.actor.grad_clip": Mapped("actor.optim.grad_clip"),
    "actor_rollout_ref.actor.strategy": NoEffect(_FSDP),
    "actor_rollout_ref.actor.ppo_micro_batch_size": NoEffect("verl deprecates the global micro-batch size; set actor.ppo_micro_batch_size_per_gpu"),
    "actor_rollout_ref.actor.use_dynamic_bsz": NoEffect("micro-batches hold actor.ppo_micro_batch_size_per_gpu trajectories, trimmed to their longest"),
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": NoEffect("see actor_rollout_ref.actor.use_dynamic_bsz"),
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": NoEffect("sequence parallelism is not implemented; each rank holds whole sequences"),
    "actor_rollout_ref.actor.shuffle": NoEffect("mini-batches are taken in batch order (groups stay together)"),
    "actor_rollout_ref.actor.use_torch_compile": NoEffect("agentrl does not compile the model"),
    "actor_rollout_ref.actor.optim.warmup_style": Mapped("actor.optim.lr_scheduler"),
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": Refused("give actor.optim.lr_warmup_steps (a step count) instead"),
    "actor_rollout_ref.actor.optim.total_training_steps": NoEffect("the schedule spans trainer.total_steps"),
    # actor_rollout_ref.ref: the reference is the initial policy, computed like the actor
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": NoEffect(_MICRO),
    "actor_rollout_ref.ref.log_prob_micro_batch_size": NoEffect(_MICRO),
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": NoEffect(_MICRO),
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": NoEffect("sequence parallelism is not implemented"),
    # actor_rollout_ref.rollout
    "actor_rollout_ref.rollout.response_length": Mapped("rollout.max_new_tokens", note="verl's response_length is per generate call"),
    "actor_rollout_ref.rollout.prompt_length": NoEffect("prompts are bounded by data.max_prompt_length"),
    "actor_rollout_ref.rollout.name": NoEffect(_ENGINE),
    "actor_rollout_ref.rollout.mode": NoEffect("agentrl's rollouts are always asynchronous (agent loops on an event loop)"),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": NoEffect(_ENGINE),
    "actor_rollout_ref.rollout.gpu_memory_utilization": NoEffect(_ENGINE),
    "actor_rollout_ref.rollout.dtype": NoEffect("the engine computes in the trainer's dtype (fp32 on CPU, bf16 on GPU)"),
    "actor_rollout_ref.rollout.enforce_eager": NoEffect(_ENGINE),
    "actor_rollout_ref.rollout.free_cache_engine": NoEffect(_ENGINE),
    "actor_rollout_ref.rollout.load_format": NoEffect(_ENGINE),
    "actor_rollout_ref.rollout.max_model_len": NoEffect("lengths are bounded by data.max_prompt_length and data.max_response_length"),
    "actor_rollout_ref.rollout.max_num_batched_tokens": NoEffect(_ENGINE),
    "actor_rollout_ref.rollout.max_num_seqs": Mapped("engine.max_batch_size"),
    "actor_rollout_ref.rollout.enable_chunked_prefill": NoEffect(_ENGINE),
    "actor_rollout_ref.rollout.disable_log_stats": NoEffect(_ENGINE),
    "actor_rollout_ref.rollout.calculate_log_probs": NoEffect("the engine's logprobs are always kept and compared with the trainer's"),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": NoEffect(_MICRO),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": NoEffect(_MICRO),
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": NoEffect(_MICRO),
    "actor_rollout_ref.rollout.do_sample": NoEffect("sampling is set by rollout.temperature (0: greedy)"),
    "actor_rollout_ref.rollout.val_kwargs.temperature": Mapped("rollout.val_temperature"),
    "actor_rollout_ref.rollout.val_kwargs.n": Mapped("rollout.val_n"),
    "actor_rollout_ref.rollout.val_kwargs.do_sample": NoEffect("validation sampling is set by rollout.val_temperature (0: greedy)"),
    "actor_rollout_ref.rollout.val_kwargs.top_p": NoEffect("validation uses rollout.top_p"),
    "actor_rollout_ref.rollout.val_kwargs.top_k": NoEffect("validation uses rollout.top_k"),
    "actor_rollout_ref.rollout.multi_turn.enable": NoEffect("multi-turn is always on: each row runs the loop its agent_name names"),
    "actor_rollout_ref.rollout.multi_turn.format": Mapped("agent.tool_parser"),
    "actor_rollout_ref.rollout.multi_turn.tool_config_path": Mapped("agent.tool_config_path", note="verl's tool YAML, read as verl reads it"),
    "actor_rollout_ref.rollout.multi_turn.interaction_config_path": Mapped("agent.interaction_config_path", note="verl's interaction YAML"),
    "actor_rollout_ref.rollout.multi_turn.max_tool_response_length": Mapped("agent.max_tool_response_tokens"),
    "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side": NoEffect("a tool response over agent.max_tool_response_tokens keeps its head"),
    "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template": NoEffect("observations are rendered as chat-template deltas; sampled tokens are never re-rendered"),
    "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode": NoEffect("the trajectory is token-exact by construction (sampled ids kept as sampled)"),
    "actor_rollout_ref.rollout.multi_turn.max_parallel_calls": Mapped("agent.max_parallel_calls"),
    "actor_rollout_ref.rollout.agent.num_workers": NoEffect("agent loops run as asyncio tasks in the rollout process (rollout.max_concurrency)"),
    "actor_rollout_ref.rollout.agent.default_agent_loop": Mapped("agent.default_loop"),
    "actor_rollout_ref.rollout.trace.backend": NoEffect("every trajectory is stored in the run's rollouts/ (agentrl replay show)"),
    "actor_rollout_ref.rollout.trace.token2text": NoEffect("see actor_rollout_ref.rollout.trace.backend"),
    # reward
    "reward_model.enable": NoEffect("agentrl scores with rule-based reward functions (agentrl.rewards); a model reward is not implemented"),
    "reward_model.reward_manager": NoEffect("rewards are computed per trajectory as each one finishes"),
    "reward_model.launch_reward_fn_async": NoEffect("rewards are computed as each trajectory finishes"),
    # trainer
    "trainer.total_training_steps": Mapped("trainer.total_steps"),
    "trainer.save_freq": Mapped("trainer.save_freq", _never_is_zero),
    "trainer.test_freq": Mapped("trainer.test_freq", _never_is_zero),
    "trainer.logger": Mapped("logging.loggers"),
    "trainer.project_name": Mapped("logging.project"),
    "trainer.experiment_name": Mapped("trainer.run_name"),
    "trainer.n_gpus_per_node": NoEffect("ranks are placed by actor.world_size (and critic.world_size)"),
    "trainer.nnodes": NoEffect("ranks are placed by actor.world_size over the Ray cluster's nodes"),
    "trainer.default_local_dir": NoEffect("checkpoints go to <trainer.runs_root>/<run>/checkpoints"),
    "trainer.resume_mode": NoEffect("resume with trainer.resume=auto (the last run with a checkpoint) or trainer.resume=<run directory>"),
    "trainer.log_val_generations": NoEffect("validation trajectories are stored in rollouts/ and shown in report.html"),
    "trainer.balance_batch": NoEffect("rows are shared over ranks by agentrl"),
    "trainer.val_only": Refused("run `agentrl rollout` on the validation files instead"),
}

# Whole subtrees: the first matching prefix (longest first) decides. A key not in VERL_KEYS is
# moved under the agentrl section that spells the rest alike (actor_rollout_ref.actor.clip_ratio
# -> actor.clip_ratio); the schema then checks it like any key.
VERL_PREFIXES: tuple[tuple[str, Rule | str], ...] = (
    ("actor_rollout_ref.actor.fsdp_config.", NoEffect(_FSDP)),
    ("actor_rollout_ref.ref.fsdp_config.", NoEffect(_FSDP)),
    ("actor_rollout_ref.actor.checkpoint.", NoEffect("checkpoints hold the model, optimizer, scheduler, data position and RNG")),
    ("actor_rollout_ref.actor.profiler.", NoEffect("profiling is not implemented")),
    ("actor_rollout_ref.rollout.engine_kwargs.", NoEffect(_ENGINE)),
    ("actor_rollout_ref.rollout.multi_turn.", "agent."),
    ("actor_rollout_ref.rollout.", "rollout."),
    ("actor_rollout_ref.model.", "model."),
    ("actor_rollout_ref.actor.", "actor."),
    ("critic.model.", NoEffect("the critic is the policy's architecture with a value head, loaded from model.path")),
    ("critic.fsdp_config.", NoEffect(_FSDP)),
    ("custom_reward_function.", Refused("register the function as an `agentrl.rewards` entry point and name it in reward.default")),
)


@dataclass(frozen=True)
class Translation:
    """What one override becomes: agentrl's key and value, or nothing (with a warning), or an error."""

    key: str | None
    value: str
    warning: str | None = None
    error: str | None = None


def _rule_for(key: str) -> Rule | None:
    rule = VERL_KEYS.get(key)
    if rule is not None:
        return rule
    for prefix, target in VERL_PREFIXES:
        if key.startswith(prefix):
            return target if not isinstance(target, str) else Mapped(target + key[len(prefix) :])
    return None


def translate(key: str, value: str) -> Translation:
    """agentrl's form of the override ``key=value`` (unchanged when the key is not verl's)."""
    rule = _rule_for(key)
    if rule is None:
        return Translation(key, value)
    if isinstance(rule, NoEffect):
        return Translation(None, value, warning=f"{key}={value}: accepted, no effect in agentrl: {rule.why}")
    if isinstance(rule, Refused):
        return Translation(None, value, error=f"this verl option is not supported by agentrl: {rule.why}")
    return Translation(rule.target, rule.convert(value) if rule.convert else value)
