"""The configuration schema: every knob, its type and its default, in one place.

Hydra composes the YAML in ``configs/``; :func:`agentrl.config.validate_config` checks the
result against these models before any work starts and reports every problem at once. Each
section is flat and holds what a user tunes together. Where verl has a name for a knob, the
knob has verl's name (``adv_estimator``, ``clip_ratio``, ``ppo_mini_batch_size``, ...).

Components receive their own section (or plain values from it) at construction; none of them
reads the whole config.
"""

from __future__ import annotations

from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentrl.config.health import HealthBound, HealthConfig

__all__ = [
    "Section",
    "DataConfig",
    "ModelConfig",
    "TinyModelConfig",
    "EngineConfig",
    "RolloutConfig",
    "AgentConfig",
    "RewardConfig",
    "RewardComponents",
    "KLControlConfig",
    "FilterGroupsConfig",
    "OverlongBufferConfig",
    "AlgorithmConfig",
    "RolloutCorrectionConfig",
    "OptimConfig",
    "LoraConfig",
    "ActorConfig",
    "CriticConfig",
    "SFTConfig",
    "TrainerConfig", "HealthConfig", "HealthBound",
    "LoggingConfig",
    "PluginsConfig",
    "EnvironmentLibrary",
    "ENVIRONMENT_LOOPS",
    "ENVIRONMENT_EXTRAS",
    "environment_import_hint",
    "EnvironmentConfig",
    "OpenEnvEnvironmentConfig",
    "VerifiersEnvironmentConfig",
    "TrlEnvironmentConfig",
    "TrainConfig",
]


class Section(BaseModel):
    """A config section: unknown keys are errors, values are checked on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TinyModelConfig(Section):
    size: Literal["1m", "5m", "18m", "100m"] = "1m"
    seed: int = 0
    # "calculator": the tiny model after demonstrations of calculator use on word problems (built
    # once per machine, agentrl/trainer/skilled_base.py), the stand-in for a pretrained instruct model;
    # "checking": that model after demonstrations of checking an answer with the calculator as
    # well (solver_verifier's verifier, docs/roles.md)
    skills: Literal["none", "calculator", "checking"] = "none"


class ModelConfig(Section):
    # A local transformers checkpoint directory; null builds (or reuses) the tiny model below.
    path: str | None = None
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    # When set, overrides the tokenizer's chat template (path to a jinja file).
    chat_template: str | None = None
    gradient_checkpointing: bool = False
    # Rows with the same prompt (the n samples of a group) run it through the trainer's model
    # once, forward and backward (agentrl/trainer/prefix.py); false: every row in full.
    share_prompt_forward: bool = True


class DataConfig(Section):
    train_files: list[str] = Field(default_factory=list)
    val_files: list[str] = Field(default_factory=list)
    # With no train_files, rows are generated from a built-in task (data_prep.tasks).
    task: Literal["arith", "word", "arith_retry", "word_steps", "solver_verifier"] | None = "arith"
    task_train_size: int = Field(2000, ge=1)
    task_val_size: int = Field(64, ge=1)
    train_batch_size: int = Field(16, ge=1)  # prompts per step
    shuffle: bool = True
    seed: int = 0
    max_prompt_length: int = Field(512, ge=1)
    max_response_length: int = Field(512, ge=1)


class EngineConfig(Section):
    # builtin: the engine in the trainer's process; sglang: SGLang servers (engines/managed.py);
    # scripted: answers from engine.script, no model (agentrl rollout only; agent/script_file.py)
    backend: Literal["builtin", "sglang", "scripted"] = "builtin"
    script: str | None = None  # scripted: a JSONL file of {"row": ROW_ID, "answers": [...]} lines
    # sglang: base URLs of running servers (external mode); empty: agentrl launches
    # `num_servers` servers and stops them when the job ends (managed mode, engines/managed.py).
    servers: list[str] = Field(default_factory=list)
    launch_args: list[str] = Field(default_factory=list)  # extra server flags, passed as given (SGLang's; agentrl serve's with launcher=agentrl)
    num_servers: int = Field(1, ge=1)
    # managed sglang servers: the main SGLang flags (null: SGLang's own default)
    tp_size: int = Field(1, ge=1)  # GPUs per server (--tp-size)
    mem_fraction_static: float | None = Field(None, gt=0, lt=1)
    context_length: int | None = Field(None, ge=1)
    attention_backend: str | None = None  # null: SGLang's choice (torch_native on CPU)
    max_total_tokens: int | None = Field(None, ge=1)  # KV cache tokens (null on CPU: 65536)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when torch sees a GPU
    python: str | None = None  # the interpreter with sglang (null: the cached CPU venv on CPU, else this one)
    # what a managed server runs: real SGLang, or `agentrl serve` (same protocol; fast tests, CPU)
    launcher: Literal["sglang", "agentrl"] = "sglang"
    ready_timeout_s: float = Field(600.0, gt=0)  # start-up until /health_generate answers
    # managed servers: `driver` runs them as child processes of agentrl's process, on its machine;
    # `ray` (agentrl train) puts each in a bundle of a Ray placement group, on any node of the cluster
    placement: Literal["driver", "ray"] = "driver"
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "SPREAD"  # placement=ray: bundles over nodes
    cpus_per_server: float = Field(0.5, gt=0)  # placement=ray: CPUs each server's bundle reserves (GPUs: tp_size on cuda)
    request_timeout_s: float = Field(300.0, gt=0)  # sglang: one /generate call
    max_retries: int = Field(3, ge=0)  # sglang: transport errors and 5xx, per server, before failover
    max_batch_size: int = Field(64, ge=1)  # builtin: sequences decoded together
    # builtin: decode-only steps on a static layout replayed as CUDA graphs (null: on for CUDA, off
    # on the CPU; true on the CPU runs the same layout without graphs; docs/gpu.md)
    decode_graphs: bool | None = None
    weight_sync: Literal["auto", "memory", "disk", "nccl"] = "auto"
    # the longest one weight sync into the engine(s) may take (a drain of running requests, a
    # reload from disk); past it the run fails with an error naming the engine, never a hang
    sync_timeout_s: float = Field(600.0, gt=0)
    # builtin: in a process of its own (engines/process.py: its own threads and weight copy, engine
    # steps never hold the tools' event loop) or in the trainer's; null: its own process in
    # asynchronous training (rollout.max_staleness > 0), the trainer's otherwise
    process: bool | None = None
    # builtin in its own process: its torch threads (null: OMP_NUM_THREADS where the environment
    # sets it, else half the cores; the trainer's ranks share the rest, trainer.threads_per_worker)
    threads: int | None = Field(None, ge=1)


class RolloutConfig(Section):
    n: int = Field(4, ge=1)  # samples per prompt (a GRPO group)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    max_new_tokens: int = Field(128, ge=1)  # per assistant turn
    val_temperature: float = Field(0.0, ge=0)  # greedy evaluation by default
    val_n: int = Field(1, ge=1)
    max_concurrency: int = Field(256, ge=1)  # trajectories in flight
    # agentrl rollout exits 1 when more than this share of trajectories failed (loop, engine or interaction error, abort)
    max_failure_rate: float = Field(0.5, ge=0, le=1)
    # Asynchronous training (docs/training.md). How many policy versions a trained sample may lag the
    # policy that trains it: staleness = the training step's weight version minus the oldest
    # version among the sample's tokens, queue time included, bound inclusive. 0: the synchronous
    # trainer (roll out, train, sync). verl async_training.staleness_threshold, AReaL
    # max_head_offpolicyness, SkyRL max_staleness_steps, prime-rl max_off_policy_steps, TRL max_staleness.
    max_staleness: int = Field(0, ge=0)
    # a finished group older than max_staleness: drop it (prime-rl, verl) or make the trainer wait
    # for a group before it can become stale (AReaL's admission bound); a group ages as one unit
    stale_groups: Literal["drop", "wait"] = "drop"
    # async: the longest the trainer waits for the next finished group before the run fails
    max_wait_s: float = Field(1800.0, gt=0)
    # async: partial rollouts (verl partial_rollout, slime --partial-rollout, AReaL interruptible
    # generation): a weight sync interrupts the engine's running requests, which resume under the
    # new weights keeping the tokens and logprobs sampled so far (each token keeps its version);
    # false: a sync waits for the running requests to finish under the old weights
    partial: bool = False


class AgentConfig(Section):
    default_loop: str = "single_turn"  # used when a row has no agent_name (verl's default too)
    # the parser of every loop not in tool_parser_by_loop; auto: the family's native format, read from the chat template (agentrl.agent.families)
    tool_parser: str = "auto"
    # Loops that write calls in a format of their own: loop name -> parser name.
    tool_parser_by_loop: dict[str, str] = Field(default_factory=lambda: {"react": "react"})
    # extra variables for the chat template, e.g. {enable_thinking: false} for Qwen3 / SmolLM3
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    # The history each request shows the model. as_template: every request is the chat template's
    # own rendering of the messages so far, as a server gives it at inference; where the template
    # rewrites the history (Qwen3 / DeepSeek-R1 drop earlier <think> blocks, gpt-oss earlier
    # analysis, Mistral-Nemo moves the system prompt) the trajectory starts a new segment, trained
    # with the trajectory's advantage, shared prefixes computed once. as_sampled: one append-only
    # stream of what was sampled and observed, whatever the template does at inference
    # (docs/model_families.md, Histories).
    history: Literal["as_sampled", "as_template"] = "as_template"
    # Loops that keep another history policy: loop name -> as_sampled | as_template.
    history_by_loop: dict[str, Literal["as_sampled", "as_template"]] = Field(default_factory=dict)
    # Roles of a multi-agent episode (docs/roles.md): role -> shared (trained by the one policy, credited
    # per role) | frozen (the loop or program speaks for it, untrained) | trained (a policy of its own,
    # full weights with their own optimizer and weight version; agent.roles' page says which configs)
    roles: dict[str, Literal["shared", "trained", "frozen"]] = Field(default_factory=dict)
    max_assistant_turns: int = Field(8, ge=1)
    max_user_turns: int = Field(4, ge=0)
    max_tool_response_tokens: int = Field(256, ge=1)
    max_parallel_calls: int = Field(4, ge=1)
    # each tool call, create and calc_reward, and each interaction start, calculate_score and finalize
    # (the steps outside the turns that trajectory_timeout_s bounds): past it an error naming the step
    tool_timeout_s: float = Field(30.0, gt=0)
    trajectory_timeout_s: float = Field(600.0, gt=0)
    malformed_call_policy: Literal["feedback", "penalize", "end"] = "feedback"
    malformed_call_penalty: float = -0.1
    # the reward of an agent program's episode that ended in its own exception (openai_agent:
    # finish reason program_error, kept in the loss; docs/own-agent.md)
    program_error_reward: float = 0.0
    # Per-tool constructor kwargs, by tool name: {calculator: {...}}.
    tool_config: dict[str, dict[str, Any]] = Field(default_factory=dict)
    interaction_config: dict[str, dict[str, Any]] = Field(default_factory=dict)
    # A verl tool YAML (tools: [{class_name, config, tool_schema}]): its tools, offered with its schemas.
    tool_config_path: str | None = None
    # A verl interaction YAML (interaction: [{name, class_name, config}]).
    interaction_config_path: str | None = None


class RewardComponents(Section):
    # The trajectory reward that reaches the advantage, as a weighted sum of the end-of-trajectory
    # judgements: the reward function's score (verl's compute_score, or a loop's own score), each
    # tool's calc_reward (summed over the trajectory's tools) and the interaction's calculate_score.
    # The default is verl's: the score alone; the other two stay in reward_info. (Per-call tool
    # rewards and interaction turn rewards are turn rewards and reach the advantage regardless.)
    score: float = 1.0
    tool_calc_reward: float = 0.0
    interaction_score: float = 0.0

    def total(self, score: float, tool_rewards: Mapping[str, float], interaction_score: float | None) -> float:
        total = self.score * score
        if self.tool_calc_reward:
            total += self.tool_calc_reward * sum(tool_rewards.values())
        if self.interaction_score and interaction_score is not None:
            total += self.interaction_score * interaction_score
        return total

    @property
    def is_score_only(self) -> bool:
        return self.score == 1.0 and not self.tool_calc_reward and not self.interaction_score


class RewardConfig(Section):
    # Reward function (entry point name in agentrl.rewards) by data_source; then the reward a plugin
    # package declares for its data source (entry point group agentrl.data_source_rewards); then
    # `default`.
    default: str = "gsm8k"
    by_data_source: dict[str, str] = Field(default_factory=dict)
    format_score: float = 0.0
    components: RewardComponents = Field(default_factory=RewardComponents)


class KLControlConfig(Section):
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = Field(0.001, ge=0)
    target_kl: float = Field(0.1, gt=0)
    horizon: int = Field(10000, ge=1)


class FilterGroupsConfig(Section):
    # DAPO's dynamic sampling (verl's algorithm.filter_groups): drop groups whose rewards are all
    # equal and draw more batches until train_batch_size groups remain (algorithms/recipes.py, dynamic_sampling_filter)
    enable: bool = False
    max_num_gen_batches: int = Field(10, ge=1)  # batches drawn per step at most


class OverlongBufferConfig(Section):
    # DAPO's soft overlong punishment (verl's overlong_buffer): the reward falls linearly by up to
    # penalty_factor over the last `len` tokens before data.max_response_length
    enable: bool = False
    len: int = Field(128, ge=1)
    penalty_factor: float = Field(1.0, ge=0)


class AlgorithmConfig(Section):
    adv_estimator: Literal["gae", "grpo", "drgrpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"] = "grpo"
    norm_adv_by_std_in_grpo: bool = True
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(1.0, ge=0, le=1)
    # grpo/drgrpo: false is verl's outcome GRPO (a trajectory's summed reward, normalised in its
    # group); true is agentrl's per-turn credit (discounted turn returns normalised over the
    # group's turns, with turn_gamma). See docs/algorithms.md, "Deliberate differences".
    grpo_turn_credit: bool = False
    turn_gamma: float = Field(1.0, ge=0, le=1)  # discount between assistant turns (grpo_turn_credit)
    # reinforce_plus_plus: true is verl's (the running return restarts at every observed token);
    # false lets it run through observations to the earlier turns
    rpp_reset_at_observations: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: Literal["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"] = "k1"
    kl_ctrl: KLControlConfig = Field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = Field(default_factory=FilterGroupsConfig)
    overlong_buffer: OverlongBufferConfig = Field(default_factory=OverlongBufferConfig)
    overlong_filter: bool = False  # DAPO: truncated responses are left out of the loss


class OptimConfig(Section):
    # verl's optim.optimizer; SGD (no momentum): a step is exactly -lr * gradient (the parity tests use it)
    optimizer: Literal["AdamW", "SGD"] = "AdamW"
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    lr_warmup_steps: int = Field(0, ge=0)
    lr_scheduler: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    grad_clip: float = Field(1.0, gt=0)


class RolloutCorrectionConfig(Section):
    # Off-policy correction of trainer vs engine logprobs (algorithms/recipes.py, rollout_correction_weights)
    level: Literal["token", "sequence"] | None = None  # null: off
    # tis: truncated importance sampling, weights capped at cap (verl rollout_is); decoupled: AReaL's
    # decoupled PPO (use_decoupled_loss; verl's decoupled mode): the PPO ratio against the proximal
    # policy (the trainer's recomputation at the consuming step) times the behaviour weight
    # proximal / engine, tokens whose weight exceeds cap masked (AReaL behav_imp_weight_cap); token level
    method: Literal["tis", "decoupled"] = "tis"
    cap: float = Field(2.0, gt=0)  # verl's rollout_is_threshold, AReaL's behav_imp_weight_cap
    outlier_threshold: float | None = Field(None, gt=1)  # ratios outside [1/t, t] get weight 0


class LoraConfig(Section):
    # LoRA adapters on the actor through peft (agentrl[lora]); engines get merged weights
    rank: int = Field(0, ge=0)  # 0: off (full fine-tuning)
    alpha: float = Field(16.0, gt=0)  # scaling alpha / rank
    dropout: float = Field(0.0, ge=0, lt=1)
    # module names to adapt; [all-linear]: every linear layer but the output head (peft's, verl's default)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


class ActorConfig(Section):
    optim: OptimConfig = Field(default_factory=OptimConfig)
    world_size: int = Field(1, ge=1)  # FSDP2 ranks
    ppo_mini_batch_size: int = Field(16, ge=1)  # in prompts, as in verl (× rollout.n trajectories)
    ppo_micro_batch_size_per_gpu: int = Field(8, ge=1)  # in trajectories
    ppo_epochs: int = Field(1, ge=1)
    clip_ratio: float = Field(0.2, gt=0)
    clip_ratio_low: float | None = None  # null: clip_ratio
    clip_ratio_high: float | None = None  # null: clip_ratio
    clip_ratio_c: float = Field(3.0, gt=1)  # dual clip
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(0.001, ge=0)
    kl_loss_type: Literal["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"] = "low_var_kl"
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    # seq-mean-token-sum-norm's constant divisor (verl's name); null: data.max_response_length
    loss_scale_factor: int | None = Field(None, ge=1)
    # verl's policy_loss.loss_mode: vanilla (PPO clip), gspo (sequence ratio), cispo (clipped IS weight)
    policy_loss: Literal["vanilla", "gspo", "cispo"] = "vanilla"
    rollout_correction: RolloutCorrectionConfig = Field(default_factory=RolloutCorrectionConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)

    @model_validator(mode="after")
    def _gspo_aggregates_by_sequence(self) -> "ActorConfig":
        if self.policy_loss == "gspo" and self.loss_agg_mode != "seq-mean-token-mean":
            raise ValueError(
                f"actor.policy_loss=gspo needs actor.loss_agg_mode=seq-mean-token-mean (GSPO's sequence-level "
                f"loss), got {self.loss_agg_mode!r}"
            )
        return self


class CriticConfig(Section):
    enable: bool | None = None  # null: on exactly when adv_estimator is gae
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-4))
    world_size: int = Field(1, ge=1)
    ppo_mini_batch_size: int = Field(16, ge=1)
    ppo_micro_batch_size_per_gpu: int = Field(8, ge=1)
    ppo_epochs: int = Field(1, ge=1)
    cliprange_value: float = Field(0.5, gt=0)
    loss_scale_factor: int | None = Field(None, ge=1)  # as actor.loss_scale_factor (null: data.max_response_length)


class SFTConfig(Section):
    # Warm start before RL (the quickstart) or the whole job of `agentrl sft`.
    enable: bool = True
    train_files: list[str] = Field(default_factory=list)  # parquet with a `messages` column
    num_demos: int = Field(200, ge=1)  # generated demonstrations when no train_files
    # Generated demonstrations only: the chance that a demonstrated answer is prose ("The answer
    # is N.") rather than the required "#### N" (data_prep.tasks.sft_conversations).
    informal_rate: float = Field(0.0, ge=0, le=1)
    # Generated demonstrations only: the chance that the demonstrator works an answer out with the
    # calculator; otherwise it answers at once, one digit wrong ("mental arithmetic").
    tool_rate: float = Field(1.0, ge=0, le=1)
    epochs: int = Field(2, ge=1)
    batch_size: int = Field(16, ge=1)
    micro_batch_size: int = Field(16, ge=1)
    max_length: int = Field(512, ge=8)
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-3))
    # Stop once this fraction of held-out demonstrations is reproduced exactly by greedy decoding
    # (checked every `eval_every` steps on `eval_demos` demonstrations never trained on; generated
    # ones always use the required answer format): a warm start deliberately short of mastery,
    # wherever the model's learning curve turns. null: off.
    stop_at_success: float | None = Field(None, gt=0, le=1)
    eval_every: int = Field(10, ge=1)
    eval_demos: int = Field(64, ge=1)


class TrainerConfig(Section):
    total_steps: int = Field(20, ge=0)
    # when set, the run ends after this many passes over the training data if that comes before
    # total_steps (verl's rule: steps = min(total_steps, total_epochs x batches per epoch))
    total_epochs: int | None = Field(None, ge=1)
    critic_warmup: int = Field(0, ge=0)
    test_freq: int = Field(5, ge=0)  # validate every N steps (0: never)
    save_freq: int = Field(10, ge=0)  # checkpoint every N steps (0: never)
    val_before_train: bool = True
    # validate after the last step (summary.json's heldout_*_after); null: when test_freq > 0, so
    # that test_freq=0 validates after training no more than during it (val_before_train is its own switch)
    final_validation: bool | None = None
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # torch threads of each worker process; null: OMP_NUM_THREADS where the environment sets it,
    # else the machine's cores / actor.world_size
    threads_per_worker: int | None = Field(None, ge=1)
    runs_root: str = "runs"
    run_name: str | None = None  # null: a timestamp
    # a run directory to continue; auto: runs_root/run_name, or the newest run under runs_root,
    # when it holds a complete checkpoint, else a new run (verl's resume_mode=auto)
    resume: str | None = None
    export_hf: bool = True  # save the final policy as a transformers checkpoint
    max_checkpoints: int = Field(2, ge=1)
    # a step whose rollout failed for infrastructure reasons (engine_error, abort, loop_error) on
    # more than this fraction of trajectories stops the run (checkpoint first, then the first error)
    max_failure_rate: float = Field(0.5, ge=0, le=1)
    # every step's trajectories (train and validation) in rollouts/, the replay format; off:
    # nothing is kept for replay (a step's shard costs encoding, parquet and fsync; see docs/benchmarks.md)
    save_rollouts: bool = True
    # Seconds a rank may wait on the others in one collective (and the driver on the ranks that
    # have not answered a call the others finished) before the wait is a hang: an error naming the
    # call and the ranks, with their Python stacks. null: wait forever.
    collective_timeout_s: float | None = Field(600.0, gt=0)
    # A worker lost mid-run (its process died, its node went, a collective timed out) ends the
    # attempt; the run then starts every worker group again from its last checkpoint, at most this
    # many times (0: the error ends the run). Steps after the checkpoint are done again.
    max_restarts: int = Field(0, ge=0)
    # How each worker group's ranks (one placement-group bundle each) are laid over a Ray cluster's
    # nodes: PACK (on as few nodes as fit, the default), SPREAD (over as many as possible),
    # STRICT_PACK (one node or fail), STRICT_SPREAD (one rank per node or fail)
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    # Whether the job's Ray runtime environment carries agentrl and the plugins the driver sees to
    # every node (so other nodes need only the third-party libraries): auto does when joining a
    # running cluster (RAY_ADDRESS), not for the private one-machine cluster
    ship_code: Literal["auto", "always", "never"] = "auto"
    # Where the worker groups run: ray (Ray actors, one process per rank), local (one rank per
    # group, in the driver's process: no Ray, no second model load), or auto: local when every
    # group has one rank, no RAY_ADDRESS is set, no server is placed by Ray and
    # trainer.max_restarts is 0 (a restart needs worker processes to lose), else ray
    workers: Literal["auto", "ray", "local"] = "auto"
    health: HealthConfig = Field(default_factory=HealthConfig)

    def planned_steps(self, steps_per_epoch: int) -> int:
        """The steps this run takes: total_steps, capped at total_epochs passes over the data."""
        if self.total_epochs is None:
            return self.total_steps
        return min(self.total_steps, self.total_epochs * steps_per_epoch)


LoggerName = Literal["console", "jsonl", "tensorboard", "wandb", "mlflow"]


def _default_loggers() -> list[LoggerName]:
    return ["console", "jsonl"]


class LoggingConfig(Section):
    loggers: list[LoggerName] = Field(default_factory=_default_loggers)
    progress: bool = True
    project: str = "agentrl"


class PluginsConfig(Section):
    # {group: {plugin name: distribution}} when two distributions offer one name.
    prefer: dict[str, dict[str, str]] = Field(default_factory=dict)


EnvironmentLibrary = Literal["verifiers", "openenv", "trl"]
# The agent loop that runs a row of each library when the row names no agent_name.
ENVIRONMENT_LOOPS: dict[str, str] = {"verifiers": "verifiers_env", "openenv": "openenv_env", "trl": "trl_env"}
# The optional-dependency extra of agentrl that installs each library (pip install 'agentrl[<extra>]').
ENVIRONMENT_EXTRAS: dict[str, str] = {"verifiers": "verifiers", "openenv": "openenv", "trl": "trl-env"}


def environment_import_hint(library: str, name: str) -> str:
    """What to do when an environment's name does not import: install the library's extra when
    the library itself is missing; else the user's own package is (a reinstalled library would not help)."""
    import importlib.util

    import sys

    if importlib.util.find_spec(library) is None:  # the library's module has the library's name
        return f"the library installs with pip install 'agentrl[{ENVIRONMENT_EXTRAS[library]}]'"
    module, _, attr = name.partition(":")
    if attr and module in sys.modules:  # it imported: the name after ':' is what is wrong (a typo)
        return f"the module {module!r} imports: is {attr!r} the name it defines?"
    return f"{library} is installed: is the package that defines {name!r} installed or on PYTHONPATH?"


class TrlEnvironmentConfig(Section):
    # TRL reward functions (`pkg.mod:fn`), each called as GRPOTrainer calls its reward_funcs
    # (prompts=, completions=, completion_ids=, environments=, the row's columns, ...), once per
    # group, each argument a list over the row's rollout.n samples; empty: the class's get_reward
    # if it has one, else agentrl's reward (reward.*)
    reward_funcs: list[str] = Field(default_factory=list)
    reward_weights: list[float] | None = None  # TRL's reward_weights (null: 1.0 each)

    @model_validator(mode="after")
    def _one_weight_each(self) -> "TrlEnvironmentConfig":
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(f"environment.trl.reward_weights has {len(self.reward_weights)} weights for "
                             f"{len(self.reward_funcs)} reward_funcs: give one per function (or null for 1.0 each)")
        return self


class VerifiersEnvironmentConfig(Section):
    # the verifiers client a verifiers environment's rollout gets over agentrl's endpoint: chat
    # (verifiers' default OpenAIChatCompletionsClient) or token (the token client prime-rl uses:
    # logprobs, return_token_ids, /tokenize, /v1/chat/completions/tokens); docs/environments/verifiers.md
    client: Literal["chat", "token"] = "chat"


class OpenEnvEnvironmentConfig(Section):
    # OpenEnv environments (docs/environments/openenv.md). A running server to use (http://host:port);
    # null: agentrl starts one per worker process (uvicorn on a free local port) from environment.name
    url: str | None = None
    # trajectories in one server at once, each its own WebSocket session: the server's
    # max_concurrent_envs (OpenEnv's default is 1; a class served by agentrl gets this many when it
    # declares SUPPORTS_CONCURRENT_SESSIONS)
    max_sessions: int = Field(1, ge=1)
    start_timeout_s: float = Field(120.0, gt=0)  # from starting the server to its answering GET /health
    step_timeout_s: float = Field(60.0, gt=0)  # each connect, reset and step; then environment_error
    # the model's turn as the action: auto (an MCP environment's tools for OpenEnv's CallToolAction,
    # text for an action whose one field is a string, else a tool with the action's fields as
    # parameters), text, or tool
    action: Literal["auto", "text", "tool"] = "auto"
    observation_field: str | None = None  # the observation field shown (null: its only field, else all as JSON)
    # where step rewards go: turns (each on the assistant turn whose action it judges; the
    # trajectory reward is 0) or trajectory (their sum is the trajectory reward)
    reward: Literal["turns", "trajectory"] = "turns"


class EnvironmentConfig(Section):
    # The environment of every row that names none in extra_info.environment (a row's own wins;
    # docs/environments/index.md). library null: rows without a ref run as without environments.
    library: EnvironmentLibrary | None = None
    # an entry point name in group agentrl.environments, a module `pkg.mod`, or `pkg.mod:attr`
    name: str | None = None
    # the environment's arguments: verifiers load_environment(**args), a TRL class's constructor
    # Cls(**args), OpenEnv reset(**args) per trajectory (a row's own args replace these)
    args: dict[str, Any] = Field(default_factory=dict)
    openenv: OpenEnvEnvironmentConfig = Field(default_factory=OpenEnvEnvironmentConfig)
    verifiers: VerifiersEnvironmentConfig = Field(default_factory=VerifiersEnvironmentConfig)
    trl: TrlEnvironmentConfig = Field(default_factory=TrlEnvironmentConfig)  # library=trl (docs/environments/trl.md)

    @model_validator(mode="after")
    def _name_needs_library(self) -> "EnvironmentConfig":
        if self.name is not None and self.library is None:
            raise ValueError(f"environment.name {self.name!r} needs environment.library (one of verifiers, openenv, trl)")
        return self


class TrainConfig(Section):
    """The whole config of `agentrl train` (and, with their own defaults, rollout and sft)."""

    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    actor: ActorConfig = Field(default_factory=ActorConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    plugins: PluginsConfig = Field(default_factory=PluginsConfig)
    environment: EnvironmentConfig = Field(default_factory=EnvironmentConfig)

    @model_validator(mode="after")
    def _resolve_derived(self) -> "TrainConfig":
        if self.critic.enable is None:
            self.critic.enable = self.algorithm.adv_estimator == "gae"
        for section in (self.actor, self.critic):
            if section.loss_scale_factor is None:
                section.loss_scale_factor = self.data.max_response_length
        return self

    @property
    def use_reference(self) -> bool:
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    def groups_of_several_ranks(self) -> list[str]:
        """The worker groups with more than one rank, as ``role.world_size = N`` (the reference has
        the actor's): empty when every group can run in one process (``trainer.workers``)."""
        ranks = (("actor", self.actor.world_size), ("critic", self.critic.world_size if self.critic.enable else 1))
        return [f"{role}.world_size = {n}" for role, n in ranks if n > 1]
