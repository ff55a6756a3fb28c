"""The trainer's workers: one class per role, each an FSDP2 group of Ray actors.

* ``ActorWorker``: the policy. Recomputes logprobs (and entropy), runs the PPO update and SFT
  steps, saves/loads checkpoints, exports a transformers checkpoint. Its rank 0 also hosts the
  built-in inference engine and runs the rollouts (agent loops) in the same process and on the
  same thread, so a weight sync after an update is an in-memory copy, or nothing at all when the
  engine shares the policy module (one fp32 rank). With ``engine=sglang`` rank 0 holds an
  ``SGLangEngine`` client of the job's servers instead and syncs by disk (``engines/managed.py``).
* ``ReferenceWorker``: the frozen initial policy, for KL.
* ``CriticWorker``: a value head on the same architecture, with its own optimizer.

Every method is called on every rank of the group with that rank's share of the batch (FSDP2
collectives need all ranks). Losses are scaled so that the gradient equals the one of the
whole mini-batch, whatever the number of ranks and micro-batches.

``WorkerGroup`` starts the ranks as Ray actors (gloo on CPU, NCCL on GPU) and calls them.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from agentrl.agent.setup import RolloutSetup
from agentrl.config.schema import ActorConfig, CriticConfig, LoraConfig, OptimConfig, TrainConfig
from agentrl.errors import WorkerDied
from agentrl.trainer import algorithms as algo
from agentrl.errors import CheckpointError
from agentrl.trainer.batch import TrainBatch
from agentrl.trainer.checkpoint_io import expected_tensors, read_state, write_state
from agentrl.trainer.dist import (
    agree_max,
    drop_tied_duplicates,
    gather_model_state,
    gather_optimizer_state,
    init_distributed,
    load_model_state,
    load_optimizer_state,
    needs_agreement,
    reshard,
    resolve_device,
    shard_model,
)
from agentrl.trainer.lora import apply_lora, merged_state, trainable_parameters
from agentrl.trainer.optim import build_lr_scheduler, build_optimizer
from agentrl.trainer.prefix import response_logprobs, response_values

__all__ = [
    "ActorWorker", "ReferenceWorker", "CriticWorker", "ValueModel", "WorkerGroup", "WorkerDied", "CollectiveTimeout",
    "response_logprobs", "mini_batch_denominator", "worker_env", "train_on_mini_batches",
]


# trainer.collective_timeout_s's default (the schema's): long enough for a slow CPU step's gaps
# between collectives, short of NCCL's and gloo's own defaults (10 and 30 minutes).
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
# What the driver adds to the collective timeout before it gives up on a rank: the rank's stack
# dump fires at the timeout, and the file must be written.
_STACK_GRACE_S = 3.0
# The least time the ranks of a group get to start (``WorkerGroup``'s first call).
_START_TIMEOUT_S = 600.0


def _loss_scale(mask: torch.Tensor, mode: str, global_denominator: float, world_size: int) -> float:
    """Turns a micro-batch's own aggregated loss into its share of the mini-batch's loss over all
    ranks: its own denominator over the mini-batch's (``algo.loss_denominator``: tokens,
    sequences, or 1 for seq-mean-token-sum-norm, a plain sum), times ``world_size`` since FSDP
    averages gradients over ranks. The scaled micro-batch losses sum to the whole mini-batch's
    ``aggregate_loss`` however the rows are split."""
    return algo.loss_denominator(mask, mode) / max(global_denominator, 1.0) * world_size


def mini_batch_denominator(mask: torch.Tensor, mode: str) -> float:
    """The whole mini-batch's denominator for ``_loss_scale`` (``algo.loss_denominator``)."""
    return algo.loss_denominator(mask, mode)


# the worker methods that run the trainer's model forward (and backward)
_MODEL_PASSES = frozenset({"compute_logprobs", "greedy_matches", "update", "update_on_policy", "sft_step", "compute_values"})


class _Worker:
    """Shared plumbing: process group, device, dtype, seeding."""

    def __init__(self, *, rank: int, world_size: int, master_addr: str, master_port: int, device: str, seed: int,
                 collective_timeout_s: float | None = None):
        self.rank, self.world_size = rank, world_size
        self.collective_timeout_s = collective_timeout_s
        self.device = resolve_device(device)
        self.mesh = init_distributed(
            rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port, device=self.device,
            timeout_s=collective_timeout_s,
        )
        # fp32 on CPU (bf16 is many times slower there, see docs/benchmarks.md), bf16 compute on GPU
        self.param_dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        # one rank is not wrapped in FSDP2 (dist.shard_model), whose mixed precision casts for
        # several ranks: its bf16 compute comes from autocast around each call
        self.autocast_dtype = self.param_dtype if world_size == 1 and self.param_dtype != torch.float32 else None
        torch.manual_seed(seed + rank)
        random.seed(seed + rank)

    def _load_causal_lm(self, path: str, lora: LoraConfig | None = None) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(self.device)
        if lora is not None and lora.rank > 0:  # adapters before sharding: FSDP2 shards them with their layer
            model = apply_lora(model, lora)
        return shard_model(model, self.mesh, param_dtype=self.param_dtype)

    def ready(self) -> int:
        return self.rank

    def call(self, method: str, stacks_file: str, *args: Any, **kwargs: Any) -> Any:
        """``method(*args, **kwargs)`` with a watchdog: when the call runs longer than the
        collective timeout, every thread's Python stack is written to ``stacks_file`` (by
        faulthandler's own thread, so even a rank stuck in C++ inside a collective is seen). The
        file is kept when the call fails or never returns, and removed when it returns. A rank
        computing in bf16 without FSDP2 runs its forward and backward passes under autocast
        (``autocast_dtype``; the rollout's engine keeps its own bf16 weights and numerics)."""
        dtype = self.autocast_dtype if method in _MODEL_PASSES else None
        if dtype is None:
            return self._watched(method, stacks_file, *args, **kwargs)
        with torch.autocast(self.device.type, dtype=dtype):
            return self._watched(method, stacks_file, *args, **kwargs)

    def _watched(self, method: str, stacks_file: str, *args: Any, **kwargs: Any) -> Any:
        import faulthandler

        if self.collective_timeout_s is None:
            return getattr(self, method)(*args, **kwargs)
        path = Path(stacks_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as out:
            out.write(f"rank {self.rank} (pid {os.getpid()}) in `{method}`, started {time.strftime('%H:%M:%S')}; "
                      f"stacks dumped {self.collective_timeout_s:g} s later:\n")
            out.flush()
            faulthandler.dump_traceback_later(self.collective_timeout_s, file=out)
            try:
                result = getattr(self, method)(*args, **kwargs)
            finally:
                faulthandler.cancel_dump_traceback_later()
        path.unlink(missing_ok=True)  # returned: not a hang (a slow call that finished is fine)
        return result

    def micro_batches(self, batch: TrainBatch, size: int, model: torch.nn.Module) -> list[tuple[TrainBatch, bool]]:
        """``batch`` split into micro-batches of ``size`` rows, each with whether it is real.

        With several FSDP2 ranks every rank must run as many micro-batches as the others (each is
        at least one collective forward), whatever its share of the rows: the ranks agree on the
        most, and the short ones append fillers (row 0 with an empty loss mask), whose outputs
        are dropped and whose loss is scaled by zero."""
        micros = batch.split(size)
        if not needs_agreement(model):
            return [(m, True) for m in micros]
        count = agree_max(len(micros), self.device)
        if count > len(micros) and len(batch) == 0:
            raise ValueError(f"rank {self.rank}: an empty shard cannot make the {count} micro-batches of the other ranks")
        filler = batch.select([0]).replace(response_mask=torch.zeros_like(batch.response_mask[:1]))
        return [(m, True) for m in micros] + [(filler, False)] * (count - len(micros))

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class ActorWorker(_Worker):
    def __init__(
        self,
        *,
        model_path: str,
        config: ActorConfig,
        total_steps: int,
        rollout_setup: RolloutSetup | None = None,
        gradient_checkpointing: bool = False,
        temperature: float = 1.0,
        share_prompts: bool = True,
        **dist_kwargs: Any,
    ):
        super().__init__(**dist_kwargs)
        self.config = config
        self.temperature = temperature  # the rollout's sampling temperature (see response_logprobs)
        self.share_prompts = share_prompts
        self.model_path = model_path
        self.lora = config.lora if config.lora.rank > 0 else None
        self.model = self._load_causal_lm(model_path, self.lora)
        if gradient_checkpointing:  # transformers 5.x: activation_checkpointing_enable (the old name warns)
            enable = getattr(self.model, "activation_checkpointing_enable", None) or self.model.gradient_checkpointing_enable
            enable()
        # with LoRA only the adapters require grad: the optimizer holds state for them alone
        self.optimizer = build_optimizer(trainable_parameters(self.model), config.optim)
        self.scheduler = build_lr_scheduler(self.optimizer, config.optim, total_steps)
        self.engine = None
        self.shares_model = False
        self.rollout_setup = rollout_setup
        if rank_is_zero(self.rank) and rollout_setup is not None:
            self._start_engine(rollout_setup)

    def parameter_counts(self) -> dict[str, int]:
        """The policy's parameters and those that train (all of them, or LoRA's adapters); global
        counts on every rank (an FSDP2 parameter is a DTensor of the whole shape)."""
        return {"actor/parameters": sum(p.numel() for p in self.model.parameters()),
                "actor/trainable_parameters": sum(p.numel() for p in trainable_parameters(self.model))}

    # ------------------------------------------------------------------ rollout (rank 0)
    def _start_engine(self, setup: RolloutSetup) -> None:
        from transformers import AutoTokenizer

        from agentrl.agent.runner import LoopTable, build_context
        from agentrl.plugins import PluginRegistry

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        if setup.engine_backend == "sglang":
            from agentrl.engines.sglang import SGLangEngine

            # SGLangEngine's HTTP clients belong to one event loop: every rollout and weight sync
            # of this worker runs on this one (asyncio.run would give each call a new loop).
            self._engine_loop = asyncio.new_event_loop()
            self.engine = SGLangEngine(setup.server_urls, timeout_s=setup.request_timeout_s, max_retries=setup.max_retries,
                                        api_key=setup.api_key)
        else:
            self.engine = self._builtin_engine(setup)
        self.contexts = {
            validation: build_context(self.engine, self.tokenizer, setup, validation=validation) for validation in (False, True)
        }
        self.loops = LoopTable(setup.default_loop, PluginRegistry(setup.plugin_prefer))

    def _builtin_engine(self, setup: RolloutSetup):
        from torch.distributed.fsdp import FSDPModule

        from agentrl.engines.builtin import BuiltinEngine

        # The engine computes in the trainer's compute dtype. An unwrapped policy already in it (one
        # fp32 rank, the CPU default) is shared with the engine: no second copy, and a weight sync
        # copies nothing (``weights_changed``). Otherwise (FSDP2 shards, bf16 compute over fp32
        # parameters) the engine loads its own copy and syncs by copy.
        # A LoRA policy is never shared: the engine gets merged weights under the base names.
        self.shares_model = (
            setup.weight_sync == "memory" and not isinstance(self.model, FSDPModule) and self.lora is None
            and all(p.dtype == self.param_dtype for p in self.model.parameters())
        )
        return BuiltinEngine(
            self.model if self.shares_model else self.model_path, device=str(self.device), dtype=self.param_dtype,
            max_batch_size=setup.engine_max_batch_size, seed=setup.seed,
            # the rollout's event loop runs on this process's training thread: one OpenMP team
            # for both (see "Where the steps run" in builtin.py)
            steps_on="event_loop",
        )

    def _run_async(self, coro):
        loop = getattr(self, "_engine_loop", None)
        return loop.run_until_complete(coro) if loop is not None else asyncio.run(coro)

    def rollout(self, rows: Sequence[tuple[str, Any]], *, n: int, seed: int, group_prefix: str, validation: bool, policy_version: int, progress: bool | str = False):
        from agentrl.agent.runner import RolloutRunner

        ctx = self.contexts[validation]
        ctx.policy_version = policy_version
        assert self.rollout_setup is not None, "rollout() on an actor built without a rollout_setup"
        runner = RolloutRunner(ctx, self.loops, max_concurrency=self.rollout_setup.max_concurrency)
        return self._run_async(runner.run(rows, n=n, seed=seed, group_prefix=group_prefix, progress=progress))

    def sync_weights(self, version: int) -> None:
        """Collective: copy the updated policy into the colocated engine (rank 0).

        In memory by default (nothing to copy when the engine shares the module: it is only told
        that the weights changed); with ``engine.weight_sync=disk`` through a transformers checkpoint
        that the engine reloads (``update_weights(path=...)``), the path SGLang servers take
        (``/update_weights_from_disk``).
        """
        if self.rollout_setup is not None and self.rollout_setup.weight_sync == "disk":
            directory = self.rollout_setup.weights_dir
            assert directory is not None, "engine.weight_sync=disk: the rollout setup has no weights_dir"
            self.export_hf(directory)
            if self.engine is not None:
                self._run_async(self.engine.update_weights(path=directory, version=version))
            return
        if self.engine is not None and self.shares_model:
            asyncio.run(self.engine.weights_changed(version=version))
            return
        state = self.policy_state()
        if self.engine is not None:
            asyncio.run(self.engine.update_weights(state_dict=state, version=version))

    # ------------------------------------------------------------------ training
    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, micro_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.model.eval()
        logprobs, entropies = [], []
        R = batch.response_length
        for micro, real in self.micro_batches(batch, micro_batch_size, self.model):
            trimmed = micro.trim().to(self.device)
            lp, ent = response_logprobs(self.model, trimmed, temperature=self.temperature, with_entropy=True,
                                        share_prompts=self.share_prompts)
            if real:
                logprobs.append(_pad_right(lp.cpu(), R))
                entropies.append(_pad_right(ent.cpu(), R))
        reshard(self.model)
        return torch.cat(logprobs), torch.cat(entropies)

    @torch.no_grad()
    def greedy_matches(self, batch: TrainBatch, micro_batch_size: int) -> torch.Tensor:
        """(B,) 1.0 where every response-mask token is the model's argmax given the tokens before
        it: greedy decoding would write that sequence's trained tokens exactly."""
        self.model.eval()
        out = []
        for micro, real in self.micro_batches(batch, micro_batch_size, self.model):
            m = micro.trim().to(self.device)
            R = m.response_length
            logits = self.model(input_ids=m.input_ids, attention_mask=m.attention_mask, position_ids=m.position_ids,
                                use_cache=False, logits_to_keep=R + 1).logits[:, :R]  # (b, R, V)
            hit = (logits.argmax(-1) == m.input_ids[:, -R:]) | (m.response_mask == 0)  # (b, R)
            if real:
                out.append(hit.all(-1).float().cpu())
        reshard(self.model)
        return torch.cat(out)

    def update(self, mini_batches: Sequence[TrainBatch], denominators: Sequence[float], *, use_kl_loss: bool,
               _seen: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> dict[str, float]:
        """PPO: one optimizer step per mini-batch (this rank's share), micro-batches accumulated.

        ``_seen`` (used by ``update_on_policy``): the batch has no old logprobs; each micro-batch's
        own forward provides them, and its (logprobs, entropy) are appended to the list.
        """
        cfg = self.config
        low = cfg.clip_ratio_low if cfg.clip_ratio_low is not None else cfg.clip_ratio
        high = cfg.clip_ratio_high if cfg.clip_ratio_high is not None else cfg.clip_ratio

        def micro_loss(m: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
            mask = m.response_mask
            logprobs, entropy = response_logprobs(
                self.model, m, temperature=self.temperature, with_entropy=cfg.entropy_coeff != 0 or _seen is not None,
                share_prompts=self.share_prompts, entropy_grad=cfg.entropy_coeff != 0,
            )
            old = m.old_logprobs
            if _seen is not None:
                old = logprobs.detach()  # the weights that sampled are the ones being updated: ratio 1
                _seen.append((old.cpu(), entropy.detach().cpu()))
            weights, rc_metrics = None, {}
            rc = cfg.rollout_correction
            if rc.level is not None:  # truncated IS: the trainer's logprobs against the engine's
                weights, rc_metrics = algo.rollout_correction_weights(
                    old, m.engine_logprobs, mask, rc.level, rc.cap, rc.outlier_threshold)
            loss, pg = algo.policy_loss(
                cfg.policy_loss, logprobs, old, m.advantages, mask, clip_ratio_low=low, clip_ratio_high=high,
                clip_ratio_c=cfg.clip_ratio_c, loss_agg_mode=cfg.loss_agg_mode, norm_length=cfg.loss_scale_factor,
                rollout_is_weights=weights,
            )
            metrics = {"actor/pg_loss": loss.item(), **{f"actor/{k}": v.item() for k, v in pg.items()},
                       **{f"rollout_corr/{k}": v.item() for k, v in rc_metrics.items()}}
            if cfg.entropy_coeff != 0:
                ent = algo.aggregate_loss(entropy, mask, cfg.loss_agg_mode, cfg.loss_scale_factor)
                loss = loss - cfg.entropy_coeff * ent
                metrics["actor/entropy_loss"] = ent.item()
            if use_kl_loss:
                kl = algo.aggregate_loss(algo.kl_penalty(logprobs, m.ref_logprobs, cfg.kl_loss_type), mask,
                                         cfg.loss_agg_mode, cfg.loss_scale_factor)
                loss = loss + cfg.kl_loss_coef * kl
                metrics["actor/kl_loss"] = kl.item()
            return loss, metrics

        out = train_on_mini_batches(self, mini_batches, denominators, micro_size=cfg.ppo_micro_batch_size_per_gpu,
                                    mode=cfg.loss_agg_mode, prefix="actor", micro_loss=micro_loss)
        out["actor/lr"] = self.scheduler.get_last_lr()[0]
        return out

    def update_on_policy(self, batch: TrainBatch, denominator: float, *, use_kl_loss: bool) -> tuple[dict[str, float], torch.Tensor, torch.Tensor]:
        """PPO when the step's batch is one mini-batch trained for one epoch (the default).

        The policy that sampled the batch is exactly the one being updated, so the update's own
        forward pass gives the old logprobs (``logprobs.detach()``, ratio 1 before the step) and
        the separate old-logprob pass is skipped (TRL and verl do the same). Returns the metrics
        and this rank's (B, R) old logprobs and entropies, for the step's metrics.
        """
        seen: list[tuple[torch.Tensor, torch.Tensor]] = []
        metrics = self.update([batch], [denominator], use_kl_loss=use_kl_loss, _seen=seen)
        seen = seen[: len(batch.split(self.config.ppo_micro_batch_size_per_gpu))]  # fillers come last
        R = batch.response_length
        logprobs = torch.cat([_pad_right(lp, R) for lp, _ in seen])
        entropy = torch.cat([_pad_right(ent, R) for _, ent in seen])
        return metrics, logprobs * batch.response_attention_mask, entropy * batch.response_attention_mask

    def sft_step(self, batch: TrainBatch, denominator: float, micro_batch_size: int) -> dict[str, float]:
        """One optimizer step of cross-entropy on the response mask (assistant tokens)."""

        def micro_loss(m: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
            logprobs, _ = response_logprobs(self.model, m, share_prompts=self.share_prompts)
            return -algo.masked_mean(logprobs, m.response_mask), {"sft/loss_sum": float(-(logprobs.detach() * m.response_mask).sum())}

        out = train_on_mini_batches(self, [batch], [denominator], micro_size=micro_batch_size, mode="token-mean",
                                    prefix="sft", micro_loss=micro_loss, average=False)
        out["sft/lr"] = self.scheduler.get_last_lr()[0]
        return out

    def reset_optimizer(self, optim: OptimConfig, total_steps: int) -> None:
        """A fresh optimizer and schedule (RL after an SFT warm start)."""
        self.config = self.config.model_copy(update={"optim": optim})
        reshard(self.model)  # the registered (sharded) parameters, whatever ran before
        self.optimizer = build_optimizer(trainable_parameters(self.model), optim)
        self.scheduler = build_lr_scheduler(self.optimizer, optim, total_steps)

    # ------------------------------------------------------------------ checkpoints
    def save(self, directory: str) -> None:
        """Collective: rank 0 writes the full model, optimizer, scheduler and RNG state (safetensors +
        JSON under ``directory/actor``, see checkpoint_io: no pickle)."""
        reshard(self.model)
        model_state = gather_model_state(self.model)
        optim_state = gather_optimizer_state(self.model, self.optimizer)
        if rank_is_zero(self.rank):
            write_state(directory, "actor", {"model": model_state, "optimizer": optim_state,
                                             "scheduler": self.scheduler.state_dict(), "rng": torch.get_rng_state().tolist()})

    def load(self, directory: str) -> None:
        """Collective: every rank checks the files (so all refuse a bad checkpoint together, before
        any collective); rank 0's full state is broadcast; the schedule is replicated on every rank."""
        zero = rank_is_zero(self.rank)
        state = read_state(directory, "actor", expect_model=expected_tensors(self.model), load_tensors=zero)
        load_model_state(self.model, state["model"] if zero else {})
        load_optimizer_state(self.model, self.optimizer, state["optimizer"] if zero else {})
        restore_schedule(self.optimizer, self.scheduler, state["scheduler"])
        if zero:
            torch.set_rng_state(_rng_state(state["rng"], directory))

    def export_hf(self, directory: str) -> None:
        """Collective: rank 0 writes a transformers checkpoint (model + tokenizer) of the policy."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        state = self.policy_state()
        if rank_is_zero(self.rank):
            config = AutoConfig.from_pretrained(self.model_path)
            # built on the meta device and given the state's tensors: initialising a model on the
            # CPU first was nearly all of an export's time for a 0.5B model (docs/gpu.md)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
            # written in the checkpoint's own dtype (a bf16 model stays bf16), as loading into a
            # model built from its config did
            dtypes = {name: tensor.dtype for name, tensor in model.state_dict().items()}
            state = {name: tensor.to(dtypes.get(name, tensor.dtype)) for name, tensor in state.items()}
            model.load_state_dict(state, strict=False, assign=True)
            model.tie_weights()
            missing = [name for name, p in model.named_parameters() if p.is_meta]
            if missing:
                raise RuntimeError(f"export_hf: the policy state has no tensor for {', '.join(missing[:5])}")
            model.save_pretrained(directory)
            AutoTokenizer.from_pretrained(self.model_path).save_pretrained(directory)

    def policy_state(self) -> dict[str, torch.Tensor]:
        """Collective: the policy's weights under the base model's names, LoRA adapters merged, tied
        duplicates dropped (on rank 0; ``{}`` elsewhere): what engines and HF exports load."""
        state = gather_model_state(self.model)
        if self.lora is not None:
            state = merged_state(state, self.lora)
        return drop_tied_duplicates(self.model, state)

    def full_state(self) -> dict[str, torch.Tensor]:
        """Collective: the full policy state dict (on rank 0; ``{}`` elsewhere)."""
        return gather_model_state(self.model)

    def engine_stats(self) -> dict[str, float]:
        if self.engine is None:
            return {}
        if not hasattr(self.engine, "stats"):  # SGLang: the servers keep their own counters
            return {"engine/weight_version": float(self.engine.weight_version)}
        stats = self.engine.stats()
        return {"engine/weight_version": float(stats.weight_version), "engine/generated_tokens": float(stats.generated_tokens)}

    def close(self) -> None:
        if self.engine is not None:
            loop = getattr(self, "_engine_loop", None)
            if loop is not None:
                loop.run_until_complete(self.engine.aclose())
                loop.close()
                self._engine_loop = None
            else:
                self.engine.close()
            self.engine = None


class ReferenceWorker(_Worker):
    def __init__(self, *, model_path: str, temperature: float = 1.0, share_prompts: bool = True, **dist_kwargs: Any):
        super().__init__(**dist_kwargs)
        self.temperature = temperature
        self.share_prompts = share_prompts
        self.model = self._load_causal_lm(model_path)
        self.model.eval()

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, micro_batch_size: int) -> torch.Tensor:
        R = batch.response_length
        parts = [
            (_pad_right(response_logprobs(self.model, micro.trim().to(self.device), temperature=self.temperature,
                                          share_prompts=self.share_prompts)[0].cpu(), R), real)
            for micro, real in self.micro_batches(batch, micro_batch_size, self.model)
        ]
        reshard(self.model)
        parts = [part for part, real in parts if real]
        return torch.cat(parts)


class ValueModel(torch.nn.Module):
    """The policy's backbone with a scalar head: V(state before each token).

    Called like a causal LM (``past_key_values``, ``use_cache``, ``logits_to_keep``), with the
    values as ``.logits`` of width 1, and with a causal LM's ``base_model`` (the decoder stack)
    and ``get_output_embeddings()`` (the head), so the trainer's forwards (``prefix.py``,
    ``packed.py``) compute values the same way they compute logprobs."""

    def __init__(self, model_path: str):
        super().__init__()
        from transformers import AutoModel

        self.backbone = AutoModel.from_pretrained(model_path, dtype=torch.float32)
        self.config = self.backbone.config
        self._no_split_modules = self.backbone._no_split_modules
        self.head = torch.nn.Linear(self.backbone.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    @property
    def base_model(self) -> torch.nn.Module:
        return self.backbone

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head

    def forward(self, input_ids, attention_mask, position_ids, past_key_values=None, use_cache: bool = False,
                logits_to_keep: int = 0):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            past_key_values=past_key_values, use_cache=use_cache)
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return CausalLMOutputWithPast(logits=self.head(hidden.float()), past_key_values=out.past_key_values)  # (B, L, 1)


class CriticWorker(_Worker):
    def __init__(self, *, model_path: str, config: CriticConfig, total_steps: int, share_prompts: bool = True, **dist_kwargs: Any):
        super().__init__(**dist_kwargs)
        self.config = config
        self.share_prompts = share_prompts
        model = ValueModel(model_path).to(self.device)
        self.model = shard_model(model, self.mesh, param_dtype=self.param_dtype)
        self.optimizer = build_optimizer(self.model.parameters(), config.optim)
        self.scheduler = build_lr_scheduler(self.optimizer, config.optim, total_steps)

    def _values(self, batch: TrainBatch) -> torch.Tensor:
        return response_values(self.model, batch, share_prompts=self.share_prompts)  # (B, R)

    @torch.no_grad()
    def compute_values(self, batch: TrainBatch, micro_batch_size: int) -> torch.Tensor:
        self.model.eval()
        R = batch.response_length
        values = torch.cat([
            _pad_right(values.cpu(), R)
            for values, real in [(self._values(m.trim().to(self.device)), real)
                                 for m, real in self.micro_batches(batch, micro_batch_size, self.model)]
            if real
        ])
        reshard(self.model)
        return values

    def update(self, mini_batches: Sequence[TrainBatch], denominators: Sequence[float], loss_agg_mode: str) -> dict[str, float]:
        cfg = self.config

        def micro_loss(m: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
            loss, metrics = algo.value_loss(self._values(m), m.values, m.returns, m.response_mask, cfg.cliprange_value,
                                            loss_agg_mode, cfg.loss_scale_factor)
            return loss, {"critic/vf_loss": loss.item(), "critic/vf_clipfrac": metrics["vf_clipfrac"].item()}

        return train_on_mini_batches(self, mini_batches, denominators, micro_size=cfg.ppo_micro_batch_size_per_gpu,
                                     mode=loss_agg_mode, prefix="critic", micro_loss=micro_loss)

    def save(self, directory: str) -> None:
        """Collective: rank 0 writes the value model, optimizer and scheduler under ``directory/critic``."""
        reshard(self.model)
        model_state = gather_model_state(self.model)
        optim_state = gather_optimizer_state(self.model, self.optimizer)
        if rank_is_zero(self.rank):
            write_state(directory, "critic", {"model": model_state, "optimizer": optim_state, "scheduler": self.scheduler.state_dict()})

    def load(self, directory: str) -> None:
        zero = rank_is_zero(self.rank)
        state = read_state(directory, "critic", expect_model=expected_tensors(self.model), load_tensors=zero)
        load_model_state(self.model, state["model"] if zero else {})
        load_optimizer_state(self.model, self.optimizer, state["optimizer"] if zero else {})
        restore_schedule(self.optimizer, self.scheduler, state["scheduler"])


def restore_schedule(optimizer: torch.optim.Optimizer, scheduler: Any, state: dict[str, Any]) -> None:
    """The schedule's position, and the learning rate it had set (a stateless optimizer's state
    dict, which would carry it, is not loaded)."""
    scheduler.load_state_dict(state)
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr


def _rng_state(values: Any, directory: str) -> torch.Tensor:
    """The CPU generator's state saved as a list of byte values."""
    if not isinstance(values, list) or not all(isinstance(v, int) and 0 <= v < 256 for v in values):
        raise CheckpointError(f"{directory}: actor/state.json: rng must be a list of byte values (0-255)")
    return torch.tensor(values, dtype=torch.uint8)


def train_on_mini_batches(worker, mini_batches, denominators, *, micro_size: int, mode: str, prefix: str, micro_loss,
                          average: bool = True) -> dict[str, float]:
    """One optimizer step per mini-batch; its micro-batches accumulate gradients, each loss scaled
    to its share of the mini-batch over all ranks. A step whose gradient is not finite is
    skipped (and counted) rather than poisoning the weights. The LR schedule moves once per call.
    Returns the micro-batch metrics (means, or sums with ``average=False``), the mean gradient
    norm and the skipped steps."""
    started = time.perf_counter()
    worker.model.train()
    if needs_agreement(worker.model) and agree_max(len(mini_batches), worker.device) != len(mini_batches):
        # a filler mini-batch would still move the weights (Adam's momentum): the driver must not do this
        raise ValueError(f"rank {worker.rank} got {len(mini_batches)} mini-batches, another rank more: "
                         "every rank must make the same optimizer steps")
    sums: dict[str, float] = {}
    micro_count, grad_norms, skipped, losses = 0, [], 0, []
    for mini, denominator in zip(mini_batches, denominators):
        worker.optimizer.zero_grad(set_to_none=True)
        loss_share = 0.0
        for micro, real in worker.micro_batches(mini, micro_size, worker.model):
            m = micro.trim().to(worker.device)
            loss, metrics = micro_loss(m)
            # a filler's mask is empty: scale 0, so its backward (the same collectives as the
            # other ranks') adds nothing
            scaled = loss * _loss_scale(m.response_mask, mode, denominator, worker.world_size)
            scaled.backward()
            loss_share += scaled.item()
            if not real:
                continue
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + value
            micro_count += 1
        norm = torch.nn.utils.clip_grad_norm_(worker.model.parameters(), worker.config.optim.grad_clip)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        grad_norms.append(norm)
        losses.append(loss_share)
        if math.isfinite(norm):
            worker.optimizer.step()
        else:
            worker.optimizer.zero_grad(set_to_none=True)
            skipped += 1
    worker.scheduler.step()
    out = {k: v / max(micro_count, 1) for k, v in sums.items()} if average else sums
    # the loss whose gradient the step took, and that gradient's norm before clipping (means over
    # the mini-batches). A rank's scaled losses sum to world_size times its share, so the
    # driver's mean over the ranks is the mini-batch's loss, whatever the ranks and micro-batches.
    out[f"{prefix}/loss"] = sum(losses) / max(len(losses), 1)
    out[f"{prefix}/grad_norm"] = sum(grad_norms) / max(len(grad_norms), 1)
    out[f"{prefix}/skipped_steps"] = float(skipped)
    out[f"timing/{prefix}_update_in_worker_s"] = time.perf_counter() - started  # the rest of the phase is transport
    return out


def rank_is_zero(rank: int) -> bool:
    return rank == 0


def _pad_right(x: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[1])) if x.shape[1] < width else x


class CollectiveTimeout(WorkerDied):
    """Some ranks of a group did not finish a call within the collective timeout of the others:
    a hang (ranks making different collectives, a rank stuck) turned into an error."""


# Calls whose rank 0 keeps working alone after the collective part (writing a checkpoint, loading
# an engine): the other ranks' early answers do not start the clock on rank 0.
_RANK0_TAIL = frozenset({"save", "export_hf", "sync_weights", "close", "engine_stats"})


class WorkerGroup:
    """``world_size`` Ray actors of one worker class forming one process group.

    No wait is unbounded while ranks disagree: a call that some ranks finished (or failed) and
    others did not within ``collective_timeout_s`` (plus a few seconds for the stack dump) raises
    ``CollectiveTimeout``, naming the group, the call and the ranks, with the stacks those ranks
    wrote under ``stacks_dir`` (see ``_Worker.call``). Their collectives time out too (the
    process group's timeout), so ranks that all wait on each other fail as well. ``None``: no
    timeout at all (the process group's default)."""

    def __init__(self, cls: type, *, world_size: int, num_cpus: float, env: dict[str, str], name: str,
                 collective_timeout_s: float | None = DEFAULT_COLLECTIVE_TIMEOUT_S, stacks_dir: str | None = None,
                 placement: str = "PACK", wait: bool = True, num_gpus: float = 0.0,
                 bundle: dict[str, float] | None = None, colocate_with: "WorkerGroup | None" = None, **kwargs: Any):
        """``wait=False``: return once the ranks are spawned, so that several groups load their
        models at the same time; ``wait_ready()`` then waits for them (every call does too).

        Each rank takes ``num_cpus`` and ``num_gpus`` from its placement-group bundle. The group
        reserves one ``bundle`` per rank (default: the rank's own CPUs and GPUs), or, with
        ``colocate_with``, runs rank r in that group's bundle r: on GPUs a bundle is one device,
        so colocated ranks share their rank's GPU by fractions (Ray gives a rank that asks for no
        GPU every device of its node, and every rank would pick the first)."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.name, self.world_size = name, world_size
        self.timeout_s = collective_timeout_s
        self._watched = issubclass(cls, _Worker)  # other classes (test stand-ins) are called plainly
        # stack files of calls in flight (removed when a call returns); by default in the temp dir
        # under names of this driver's own
        self.stacks_dir = Path(stacks_dir) if stacks_dir else Path(tempfile.gettempdir())
        self._stacks_prefix = name if stacks_dir else f"agentrl-{os.getpid()}-{name}"
        self.broken: str | None = None  # set by a timeout: the ranks' collectives no longer line up
        # what the driver is doing ("step 3", "start-up"): errors begin with it, so that a hang or
        # a lost worker says when it happened as well as in which call (set by the driver)
        self.during = "start-up"
        # One bundle per rank, on one node where it fits (PACK) or over several (SPREAD); the
        # process group meets at rank 0's node, whose address and free port are asked there.
        start_wait = max(self.timeout_s or _START_TIMEOUT_S, _START_TIMEOUT_S)
        self.owns_placement = colocate_with is None
        if colocate_with is not None:
            if colocate_with.world_size != world_size:
                raise ValueError(f"{name} group: {world_size} ranks cannot share the {colocate_with.world_size} bundles of {colocate_with.name}")
            self.placement = colocate_with.placement
        else:
            reserve = bundle or {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})}
            self.placement = placement_group([dict(reserve)] * world_size, strategy=placement)
            ready, _ = ray.wait([self.placement.ready()], timeout=start_wait)
            if not ready:
                ray.util.remove_placement_group(self.placement)
                wanted = ", ".join(f"{v:g} {k}" for k, v in reserve.items())
                raise CollectiveTimeout(f"{self.during}: {name} group: {world_size} ranks of {wanted} could not be placed ({placement}) "
                                        f"within {start_wait:g} s: the cluster has not the free resources")
        in_bundle = [PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=r) for r in range(world_size)]
        remote = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, runtime_env={"env_vars": env})(cls)

        def spawn() -> None:
            meeting = ray.remote(_rendezvous).options(scheduling_strategy=in_bundle[0], num_cpus=0)
            master_addr, port = ray.get(meeting.remote(), timeout=start_wait)
            self.workers = [
                remote.options(name=None, scheduling_strategy=in_bundle[rank]).remote(
                    rank=rank, world_size=world_size, master_addr=master_addr, master_port=port,
                    collective_timeout_s=collective_timeout_s, **kwargs)
                for rank in range(world_size)
            ]
            self._starting = [self._remote(r, "ready") for r in range(world_size)]

        self._spawn = spawn
        self._starting: list[Any] | None = None
        spawn()
        if wait:
            self.wait_ready()

    @property
    def starting(self) -> bool:
        """Spawned with ``wait=False`` and not waited for yet."""
        return self._starting is not None

    def wait_ready(self) -> "WorkerGroup":
        """Wait until every rank has started. The ranks must all start (and join the process group)
        within the timeout: a rank that cannot be placed (no free CPU or GPU left in the cluster)
        is an error, not a wait."""
        for attempt in range(1, _PORT_ATTEMPTS + 1):
            starting, self._starting = self._starting, None
            if starting is None:
                break
            try:
                self._collect("ready", starting, from_start=True)
            except WorkerDied as exc:
                # rank 0's free port was taken by another process between the rendezvous picking
                # it and the process group binding it: the ranks start again on a new one
                if self.world_size == 1 or "EADDRINUSE" not in str(exc) or attempt == _PORT_ATTEMPTS:
                    raise
                import ray

                for worker in self.workers:
                    ray.kill(worker)
                self._spawn()
        return self

    def stacks_file(self, rank: int) -> Path:
        return self.stacks_dir / f"{self._stacks_prefix}-rank{rank}-stacks.txt"

    def _remote(self, rank: int, method: str, *args: Any, **kwargs: Any):
        if not self._watched:
            return getattr(self.workers[rank], method).remote(*args, **kwargs)
        return self.workers[rank].call.remote(method, str(self.stacks_file(rank)), *args, **kwargs)

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """The same call on every rank; returns each rank's result."""
        return self._collect(method, [self._remote(r, method, *args, **kwargs) for r in range(self.world_size)])

    def call_sharded(self, method: str, shards: Sequence[Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Rank r gets ``shards[r]`` as its first argument."""
        if len(shards) != self.world_size:
            raise ValueError(f"{self.name}.{method}: {len(shards)} shards for {self.world_size} ranks")
        return self._collect(method, [self._remote(r, method, s, *args, **kwargs) for r, s in enumerate(shards)])

    def call_rank0(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A call on rank 0 alone (a rollout): no collective, so no timeout here."""
        self.wait_ready()
        return self.get([getattr(self.workers[0], method).remote(*args, **kwargs)])[0]

    def get(self, refs: list[Any]) -> list[Any]:
        import ray

        try:
            return ray.get(refs)
        except ray.exceptions.RayActorError as exc:
            raise WorkerDied(f"{self.during}: a worker of the {self.name} group died: {exc}") from exc

    def _collect(self, method: str, refs: list[Any], from_start: bool = False) -> list[Any]:
        """Every rank's answer to ``method``; once one rank has answered, the others get
        ``timeout_s`` (and a grace for their stack dumps) to answer too (``from_start``: every
        rank gets ``timeout_s`` from now)."""
        import ray

        if not from_start:
            self.wait_ready()  # a group spawned with wait=False: its start-up errors come first

        if self.broken is not None:
            raise CollectiveTimeout(f"{self.during}: {self.name} group: not calling `{method}`, the group is broken ({self.broken})")
        if self.timeout_s is None:
            return self.get(refs)
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending, answered, failed = set(refs), {}, {}
        # starting takes longer than any collective: processes, imports and weights on a loaded machine
        deadline = time.monotonic() + max(self.timeout_s, _START_TIMEOUT_S) if from_start else None
        while pending:
            clocked = [r for r in pending if not (method in _RANK0_TAIL and rank_of[r] == 0)]
            wait = None if deadline is None or not clocked else max(0.0, deadline - time.monotonic())
            done, _ = ray.wait(list(pending), num_returns=1, timeout=wait)
            if not done:
                missing = sorted(rank_of[r] for r in pending)
                stacks = [str(self.stacks_file(r)) for r in range(len(refs)) if self.stacks_file(r).is_file()]
                finished = sorted(answered)
                errors = "".join(f"\n  rank {rank} failed: {str(error).strip().splitlines()[-1][:300]}" for rank, error in sorted(failed.items()))
                self.broken = f"`{method}` timed out"
                raise CollectiveTimeout(
                    f"{self.during}: {self.name} group: `{method}` hangs: rank(s) {missing} of {self.world_size} did not answer within "
                    + (f"{max(self.timeout_s, _START_TIMEOUT_S):g} s of their start." if from_start else
                       f"{self.timeout_s:g} s of rank(s) {sorted(finished + list(failed))} (trainer.collective_timeout_s).")
                    + f"{errors}\n  Python stacks of the ranks in the call: "
                    + (", ".join(stacks) if stacks else f"none written under {self.stacks_dir} (a rank that never started?)")
                )
            for ref in done:
                pending.discard(ref)
                try:
                    answered[rank_of[ref]] = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    raise WorkerDied(f"{self.during}: a worker of the {self.name} group died in `{method}`: {exc}") from exc
                except Exception as exc:  # the rank's own error: raised once every rank answered or timed out
                    failed[rank_of[ref]] = exc
            if deadline is None:
                deadline = time.monotonic() + self.timeout_s + _STACK_GRACE_S
        if failed:
            raise failed[min(failed)]
        return [answered[rank] for rank in range(len(refs))]

    def node_ids(self) -> list[str]:
        """The Ray node each rank runs on."""
        import ray

        return self.get([w.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id()) for w in self.workers])

    def kill(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w)
        if self.owns_placement:  # a colocated group's bundles go with the group that reserved them
            ray.util.remove_placement_group(self.placement)


def ranks_take_gpus(device: str) -> bool:
    """Whether the trainer's ranks reserve GPUs: ``trainer.device=cuda``, or ``auto`` on a Ray
    cluster that has GPUs (asked of the cluster: the driver's own node may have none)."""
    import ray

    if device == "cpu":
        return False
    return device == "cuda" or ray.cluster_resources().get("GPU", 0) > 0


# CPU each rank of the reference and critic groups reserves: they compute between the actor's
# phases, never beside it, so they take a token share of the node's cores
_SIDE_CPUS = 0.01


def group_resources(*, gpus: bool, actor_cpus: float, actor_ranks: int, reference: bool,
                    critic_ranks: int | None) -> dict[str, dict[str, Any]]:
    """``WorkerGroup`` resource arguments for the actor, reference and critic groups (those that
    exist; ``critic_ranks`` None: no critic). The reference's rank r, and the critic's when it has
    as many ranks as the actor, run in the actor's bundle r (``colocate``: the caller passes
    ``colocate_with=<actor group>``): on GPUs each bundle is one device, which they share by
    fractions, as verl colocates its roles; a critic of another size reserves its own devices."""
    colocated = (["reference"] if reference else []) + (["critic"] if critic_ranks == actor_ranks else [])
    share = 1.0 / (1 + len(colocated)) if gpus else 0.0
    plan = {"actor": {"num_cpus": actor_cpus, "num_gpus": share,
                      "bundle": {"CPU": actor_cpus + _SIDE_CPUS * len(colocated), **({"GPU": 1.0} if gpus else {})}}}
    for name in colocated:
        plan[name] = {"num_cpus": _SIDE_CPUS, "num_gpus": share, "colocate": True}
    if critic_ranks is not None and "critic" not in colocated:
        plan["critic"] = {"num_cpus": _SIDE_CPUS, "num_gpus": 1.0 if gpus else 0.0, "colocate": False}
    return plan


def plan_groups(cfg: Any, actor_cpus: float) -> dict[str, dict[str, Any]]:
    """``group_resources`` for a training config's groups (its device, ranks, reference, critic)."""
    return group_resources(gpus=ranks_take_gpus(cfg.trainer.device), actor_cpus=actor_cpus, actor_ranks=cfg.actor.world_size,
                           reference=cfg.use_reference, critic_ranks=cfg.critic.world_size if cfg.critic.enable else None)


def placed(plan: dict[str, dict[str, Any]], name: str, actor: "WorkerGroup | None" = None) -> dict[str, Any]:
    """``WorkerGroup`` keyword arguments of group ``name`` of a ``group_resources`` plan (the
    colocated ones in ``actor``'s bundles); none for a group the plan leaves out (in-process)."""
    entry = dict(plan.get(name, {}))
    return {**entry, "colocate_with": actor} if entry.pop("colocate", False) else entry


_PORT_ATTEMPTS = 3  # a group's start when another process took rank 0's port: rare, and never twice in a row


def _rendezvous() -> tuple[str, int]:
    """(this node's address, a free port on it): where the process group of a group meets."""
    import ray

    from agentrl.trainer.dist import free_port

    return ray.util.get_node_ip_address(), free_port()


def threads_per_worker(cfg: TrainConfig) -> int:
    """Torch threads of each training worker: ``trainer.threads_per_worker``; else
    ``OMP_NUM_THREADS`` where this process's environment sets it (whoever started the job bounded
    its threads: two jobs sharing a machine, a test suite on one worker per core); else the
    machine's cores shared by the actor's ranks. Why the bound matters: two jobs whose threads
    together exceed the cores each ran several times slower than the two of them with one thread
    each, as each job's OpenMP threads spin while waiting (docs/benchmarks.md)."""
    if cfg.trainer.threads_per_worker:
        return cfg.trainer.threads_per_worker
    bound = os.environ.get("OMP_NUM_THREADS", "")
    if bound.isdigit() and int(bound) >= 1:
        return int(bound)
    return max(1, (os.cpu_count() or 2) // cfg.actor.world_size)


def worker_env(threads: int) -> dict[str, str]:
    # RAY_AUTH_MODE must match the cluster's: workers take the driver's (see init_local_ray)
    keep = {k: v for k, v in os.environ.items() if k in ("PYTHONPATH", "AGENTRL_CACHE", "HF_HOME", "RAY_AUTH_MODE")}
    # transformers' weight-loading and shard-writing bars off in workers (their output reaches the
    # driver's console through Ray), unless the driver's environment sets it
    quiet = os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    return {**keep, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_PROGRESS_BARS": quiet}


def init_local_ray(ship_code: str = "auto") -> bool:
    """Start Ray for this job unless it is already up; returns whether it was started here.

    Without ``RAY_ADDRESS`` this is a private cluster for this job, started with token
    authentication off (``RAY_AUTH_MODE=disabled``, unless the environment says otherwise):
    with Ray 2.60's default our own worker processes were refused and the job hung. The address
    is ``local`` (a new cluster) rather than Ray's default lookup, which would find the cluster
    file a killed Ray session left in ``$TMPDIR/ray`` and try to join that dead cluster.

    ``ship_code`` (``trainer.ship_code``): whether the job's runtime environment carries agentrl
    and the driver's plugins to every node (``shipping.py``); ``auto`` does when joining."""
    import ray

    from agentrl.trainer.shipping import job_runtime_env, should_ship

    if ray.is_initialized():
        return False
    joining = bool(os.environ.get("RAY_ADDRESS"))
    with tempfile.TemporaryDirectory(prefix="agentrl-ship-") as staging:  # uploaded by ray.init, then not needed
        runtime_env = job_runtime_env(Path(staging)) if should_ship(ship_code, joining) else None
        if joining:  # an existing cluster: its resources and auth are its own
            ray.init(log_to_driver=True, logging_level="ERROR", runtime_env=runtime_env)
            return True
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(address="local", num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=True,
                 logging_level="ERROR", runtime_env=runtime_env)
    return True

