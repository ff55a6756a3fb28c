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
whole mini-batch, whatever the number of ranks and micro-batches (``rank.py``, with what else
every rank shares).

``WorkerGroup`` (``groups.py``) starts the ranks as Ray actors (gloo on CPU, NCCL on GPU) and
calls them; ``cluster.py`` starts Ray and plans each group's resources.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Sequence

import torch

from agentrl.agent.setup import RolloutSetup
from agentrl.config.schema import ActorConfig, CriticConfig, OptimConfig
from agentrl.errors import CheckpointError
from agentrl.trainer.algorithms.kl import kl_penalty
from agentrl.trainer.algorithms.losses import aggregate_loss, policy_loss, value_loss
from agentrl.trainer.algorithms.masked import masked_mean
from agentrl.trainer.algorithms.recipes import rollout_correction_weights
from agentrl.trainer.batch import TrainBatch
from agentrl.trainer.checkpoint_io import expected_tensors, read_state, write_state
from agentrl.trainer.dist import (
    drop_tied_duplicates,
    gather_model_state,
    gather_optimizer_state,
    load_model_state,
    load_optimizer_state,
    reshard,
    shard_model,
)
from agentrl.trainer.hf_export import write_hf_checkpoint
from agentrl.trainer.lora import merged_state, trainable_parameters
from agentrl.trainer.optim import build_lr_scheduler, build_optimizer
from agentrl.trainer.prefix import response_logprobs, response_values
from agentrl.trainer.rank import Worker, train_on_mini_batches

__all__ = ["ActorWorker", "ReferenceWorker", "CriticWorker", "ValueModel"]


class ActorWorker(Worker):
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
        self.background = None  # asynchronous training's rollouts (rank 0)
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
                                        api_key=setup.api_key, partial=setup.max_staleness > 0 and setup.partial,
                                        tokenizer=self.tokenizer)  # partial: stop strings checked across interruptions
        else:
            self.engine = self._builtin_engine(setup)
        # engine_stats reports what happened between calls, from here on
        self._last_engine_stats = (time.perf_counter(), self.engine.stats()) if hasattr(self.engine, "stats") else None
        self.contexts = {
            validation: build_context(self.engine, self.tokenizer, setup, validation=validation) for validation in (False, True)
        }
        self.loops = LoopTable(setup.default_loop, PluginRegistry(setup.plugin_prefer))
        self.background = None
        if setup.max_staleness > 0:  # asynchronous training: rollouts keep running while this rank trains
            from agentrl.agent.async_rollout import BackgroundRollout
            from agentrl.agent.runner import RolloutRunner

            runner = RolloutRunner(self.contexts[False], self.loops, max_concurrency=setup.max_concurrency)
            self.background = BackgroundRollout(runner, loop=getattr(self, "_engine_loop", None))

    def _builtin_engine(self, setup: RolloutSetup):
        from torch.distributed.fsdp import FSDPModule

        from agentrl.engines.builtin import BuiltinEngine

        # The engine computes in the trainer's compute dtype. An unwrapped policy already in it (one
        # fp32 rank, the CPU default) is shared with the engine: no second copy, and a weight sync
        # copies nothing (``weights_changed``). Otherwise (FSDP2 shards, bf16 compute over fp32
        # parameters, a LoRA policy: merged weights under the base names) the engine loads its own
        # copy and syncs by copy. Asynchronous training (rollout.max_staleness > 0) never shares:
        # the trainer updates while the engine samples, so the engine takes each new version
        # through update_weights (which drains running requests, or interrupts them with
        # rollout.partial), in a process of its own by default (engine.process: own threads and
        # weights, engines/process.py; a sync through a shared file mapping or the exported
        # checkpoint), or on its own thread with engine.process=false.
        asynchronous = setup.max_staleness > 0
        self.shares_model = (
            setup.weight_sync == "memory" and not isinstance(self.model, FSDPModule) and self.lora is None
            and all(p.dtype == self.param_dtype for p in self.model.parameters()) and not asynchronous
            and not setup.engine_process
        )
        if setup.engine_process:
            from agentrl.engines.process import EngineProcess

            return EngineProcess(
                self.model_path, threads=setup.engine_threads, sync_timeout_s=setup.sync_timeout_s,
                name="the built-in engine process of the actor's rank 0", wait_ready=False,  # it loads while the trainer starts
                device=str(self.device), dtype=self.param_dtype,
                max_batch_size=setup.engine_max_batch_size, seed=setup.seed, decode_graphs=setup.engine_decode_graphs,
                partial=asynchronous and setup.partial,
            )
        return BuiltinEngine(
            self.model if self.shares_model else self.model_path, device=str(self.device), dtype=self.param_dtype,
            max_batch_size=setup.engine_max_batch_size, seed=setup.seed, decode_graphs=setup.engine_decode_graphs,
            # the rollout's event loop runs on this process's training thread: one OpenMP team
            # for both (see "Where the steps run" in builtin.py)
            steps_on="thread" if asynchronous else "event_loop",
            partial=asynchronous and setup.partial,
        )

    def _run_async(self, coro):
        background = getattr(self, "background", None)
        if background is not None:  # asynchronous training: everything of the rollout on its loop
            return background.run(coro)
        loop = getattr(self, "_engine_loop", None)
        return loop.run_until_complete(coro) if loop is not None else asyncio.run(coro)

    def rollout(self, rows: Sequence[tuple[str, Any]], *, n: int, seed: int, group_prefix: str, validation: bool, policy_version: int, progress: bool | str = False):
        from agentrl.agent.runner import RolloutRunner

        ctx = self.contexts[validation]
        ctx.policy_version = policy_version
        assert self.rollout_setup is not None, "rollout() on an actor built without a rollout_setup"
        runner = RolloutRunner(ctx, self.loops, max_concurrency=self.rollout_setup.max_concurrency)
        return self._run_async(runner.run(rows, n=n, seed=seed, group_prefix=group_prefix, progress=progress))

    def submit_rollout(self, rows: Sequence[tuple[str, Any]], *, n: int, seed: int, group_prefix: str, version: int) -> list[str]:
        """Asynchronous training: start the rows' groups in the background; returns their group ids."""
        assert self.background is not None, "submit_rollout needs rollout.max_staleness > 0"
        return self.background.submit(rows, n=n, seed=seed, group_prefix=group_prefix, version=version)

    def finished_rollouts(self, wait_s: float) -> list:
        """Asynchronous training: the groups finished since the last call (waits up to ``wait_s`` for one)."""
        assert self.background is not None, "finished_rollouts needs rollout.max_staleness > 0"
        return self.background.finished(wait_s=wait_s)

    def sync_weights(self, version: int) -> None:
        """Collective: copy the updated policy into the colocated engine (rank 0). In memory by
        default (nothing to copy when the engine shares the module: it is only told that the
        weights changed); with ``engine.weight_sync=disk`` through a transformers checkpoint that
        the engine reloads (``update_weights(path=...)``), as SGLang servers do."""
        if self.rollout_setup is not None and self.rollout_setup.weight_sync == "disk":
            directory = self.rollout_setup.weights_dir
            assert directory is not None, "engine.weight_sync=disk: the rollout setup has no weights_dir"
            self.export_hf(directory)
            if self.engine is not None:
                self._run_async(_bounded_sync(self, self.engine.update_weights(path=directory, version=version), version,
                                              f"a reload from {directory}"))
            return
        if self.engine is not None and self.shares_model:
            asyncio.run(_bounded_sync(self, self.engine.weights_changed(version=version), version, "the weights-changed notice"))
            return
        from agentrl.engines.builtin import BuiltinEngine
        # an engine in this process on a GPU copies device to device (to its dtype; the fp32 master
        # weights stay as they are); an engine in a process of its own reads CPU tensors
        state = self.policy_state(on_device=self.device.type != "cpu" and isinstance(self.engine, BuiltinEngine))
        if self.engine is not None:
            asyncio.run(_bounded_sync(self, self.engine.update_weights(state_dict=state, version=version), version,
                                      "an in-memory copy"))

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
                weights, rc_metrics = rollout_correction_weights(
                    old, m.engine_logprobs, mask, rc.level, rc.cap, rc.outlier_threshold, rc.method)
            loss, pg = policy_loss(
                cfg.policy_loss, logprobs, old, m.advantages, mask, clip_ratio_low=low, clip_ratio_high=high,
                clip_ratio_c=cfg.clip_ratio_c, loss_agg_mode=cfg.loss_agg_mode, norm_length=cfg.loss_scale_factor,
                rollout_is_weights=weights,
            )
            metrics = {"actor/pg_loss": loss.item(), **{f"actor/{k}": v.item() for k, v in pg.items()},
                       **{f"rollout_corr/{k}": v.item() for k, v in rc_metrics.items()}}
            if cfg.entropy_coeff != 0:
                ent = aggregate_loss(entropy, mask, cfg.loss_agg_mode, cfg.loss_scale_factor)
                loss = loss - cfg.entropy_coeff * ent
                metrics["actor/entropy_loss"] = ent.item()
            if use_kl_loss:
                kl = aggregate_loss(kl_penalty(logprobs, m.ref_logprobs, cfg.kl_loss_type), mask,
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
            return -masked_mean(logprobs, m.response_mask), {"sft/loss_sum": float(-(logprobs.detach() * m.response_mask).sum())}

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
        """Collective: rank 0 writes a transformers checkpoint of the policy: its state as it is,
        in the starting checkpoint's dtype, beside that checkpoint's config and tokenizer files,
        whole or not at all (``hf_export.write_hf_checkpoint``; no model is built: building one,
        even on the meta device, cost far more than the bytes, docs/gpu.md)."""
        state = self.policy_state()
        if rank_is_zero(self.rank):
            # a LoRA policy's merged state is under the base model's names, not the wrapper's
            expected = None if self.lora is not None else list(drop_tied_duplicates(self.model, dict.fromkeys(self.model.state_dict())))
            write_hf_checkpoint(state, directory, source=self.model_path, expected=expected)

    def policy_state(self, *, on_device: bool = False) -> dict[str, torch.Tensor]:
        """Collective: the policy's weights under the base model's names, LoRA adapters merged, tied
        duplicates dropped (on rank 0; ``{}`` elsewhere): what engines and HF exports load; on the
        model's device with ``on_device``, else on the CPU."""
        state = gather_model_state(self.model, to_cpu=not on_device)
        if self.lora is not None:
            state = merged_state(state, self.lora)
        return drop_tied_duplicates(self.model, state)

    def full_state(self) -> dict[str, torch.Tensor]:
        """Collective: the full policy state dict (on rank 0; ``{}`` elsewhere)."""
        return gather_model_state(self.model)

    def engine_weight_version(self) -> int | None:
        """The weight version the engine reports holding (None: no engine on this rank): the
        built-in engine's scheduler, the engine process's last confirmed update, SGLang servers'
        own ``/get_model_info`` (the lowest, when several), not the version the trainer sent."""
        if self.engine is None:
            return None
        served = getattr(self.engine, "served_weight_version", None)
        reported = self._run_async(served()) if served is not None else None
        return int(self.engine.weight_version) if reported is None else reported

    def probe_engine(self, prompt_ids: list[int], max_new_tokens: int, seed: int) -> tuple[list[int], list[float], list[int]]:
        """A few tokens sampled by the engine at the rollouts' temperature: (ids, logprobs, the
        version of each), for the trainer to score under the version it just synced (trainer/health.py)."""
        from agentrl.engines.base import GenerateRequest, SamplingParams

        assert self.engine is not None, "probe_engine on a rank without an engine"
        sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=self.temperature, seed=seed)
        result = self._run_async(self.engine.generate(GenerateRequest(list(prompt_ids), sampling, rid=f"health-probe-{seed}")))
        return list(result.output_ids), list(result.logprobs), result.token_versions()

    def engine_stats(self) -> dict[str, float]:
        if self.engine is None:
            return {}
        if not hasattr(self.engine, "stats"):  # SGLang: the servers keep their own counters, the client its interruptions
            counts = (self.engine.interrupted_requests, self.engine.resumed_requests)
            before = getattr(self, "_last_sglang_counts", (0, 0))
            self._last_sglang_counts = counts
            return {"engine/weight_version": float(self.engine.weight_version),
                    "engine/interrupted_requests": float(counts[0] - before[0]),
                    "engine/resumed_requests": float(counts[1] - before[1])}
        stats = self.engine.stats()
        now = time.perf_counter()
        last = getattr(self, "_last_engine_stats", None)
        self._last_engine_stats = (now, stats)
        metrics = {"engine/weight_version": float(stats.weight_version), "engine/generated_tokens": float(stats.generated_tokens)}
        if last is not None:  # since the last call: a step's share of time the engine stepped, requests interrupted
            then, before = last
            metrics["engine/busy_fraction"] = (stats.busy_s - before.busy_s) / max(now - then, 1e-9)
            metrics["engine/interrupted_requests"] = float(stats.interrupted_requests - before.interrupted_requests)
            metrics["engine/resumed_requests"] = float(stats.resumed_requests - before.resumed_requests)
        return metrics

    def close(self) -> None:
        background = getattr(self, "background", None)
        if background is not None:
            background.close()
            self.background = None
        if self.engine is not None:
            loop = getattr(self, "_engine_loop", None)
            if loop is not None:
                loop.run_until_complete(self.engine.aclose())
                loop.close()
                self._engine_loop = None
            else:
                self.engine.close()
            self.engine = None


class ReferenceWorker(Worker):
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


class CriticWorker(Worker):
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
            loss, metrics = value_loss(self._values(m), m.values, m.returns, m.response_mask, cfg.cliprange_value,
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


def rank_is_zero(rank: int) -> bool:
    return rank == 0


def _pad_right(x: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[1])) if x.shape[1] < width else x


async def _bounded_sync(worker: "ActorWorker", update: Any, version: int, what: str) -> None:
    """``update`` within ``engine.sync_timeout_s``; past it an ``EngineTimeout`` names the engine and
    what the sync was waiting for. A function, not a method: one coroutine method makes Ray run
    every method of the actor on an event loop, where ``asyncio.run`` fails."""
    from agentrl.errors import EngineTimeout

    limit = worker.rollout_setup.sync_timeout_s if worker.rollout_setup is not None else 600.0
    task = asyncio.ensure_future(update)
    try:
        await asyncio.wait_for(asyncio.shield(task), limit)
    except asyncio.TimeoutError:
        engine = worker.engine
        urls = getattr(worker.rollout_setup, "server_urls", ()) if getattr(worker.rollout_setup, "engine_backend", "") == "sglang" else ()
        where = f"the SGLang server(s) {', '.join(urls)}" if urls else getattr(engine, "name", "the built-in engine of the actor's rank 0")
        waiting = ""
        if hasattr(engine, "stats"):
            stats = engine.stats()
            waiting = f" ({stats.running} requests running, {stats.waiting} waiting: a sync drains the running ones first)"
        elif hasattr(engine, "sync_waiting"):  # SGLang: the servers that have not answered
            waiting = f" ({engine.sync_waiting()})"
        task.cancel()  # described first: cancelling it ends the calls it waits on
        await asyncio.gather(task, return_exceptions=True)
        raise EngineTimeout(
            f"weight sync to version {version} ({what}) into {where} did not finish within "
            f"engine.sync_timeout_s={limit} s{waiting}") from None
