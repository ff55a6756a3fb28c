"""One rank of a worker group, whatever its role: what ``workers.py``'s roles share.

``Worker`` joins the group's process group, picks the device and compute dtype, seeds, runs each
call from the driver under a watchdog (``call``: a call that outlives the collective timeout
leaves every thread's stack in a file) and splits a batch into micro-batches that every rank runs
alike (fillers where a rank has fewer rows). ``train_on_mini_batches`` is the optimizer step of
every role: one step per mini-batch, micro-batches accumulated, each micro-batch's loss scaled
(``_loss_scale``) so that the gradient equals the one of the whole mini-batch, whatever the number
of ranks and micro-batches.
"""

from __future__ import annotations

import math
import os
import random
import time
from pathlib import Path
from typing import Any

import torch

from agentrl.config.schema import LoraConfig, OptimConfig
from agentrl.trainer.algorithms.losses import loss_denominator
from agentrl.trainer.batch import TrainBatch
from agentrl.trainer.dist import agree_max, init_distributed, needs_agreement, resolve_device, shard_model
from agentrl.trainer.lora import apply_lora

__all__ = ["Worker", "mini_batch_denominator", "train_on_mini_batches"]


def _loss_scale(mask: torch.Tensor, mode: str, global_denominator: float, world_size: int) -> float:
    """Turns a micro-batch's own aggregated loss into its share of the mini-batch's loss over all
    ranks: its own denominator over the mini-batch's (``loss_denominator``: tokens,
    sequences, or 1 for seq-mean-token-sum-norm, a plain sum), times ``world_size`` since FSDP
    averages gradients over ranks. The scaled micro-batch losses sum to the whole mini-batch's
    ``aggregate_loss`` however the rows are split."""
    return loss_denominator(mask, mode) / max(global_denominator, 1.0) * world_size


def mini_batch_denominator(mask: torch.Tensor, mode: str) -> float:
    """The whole mini-batch's denominator for ``_loss_scale`` (``loss_denominator``)."""
    return loss_denominator(mask, mode)


# the worker methods that run the trainer's model forward (and backward)
_MODEL_PASSES = frozenset({"compute_logprobs", "greedy_matches", "update", "update_on_policy", "sft_step", "compute_values"})


class Worker:
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
    optim: OptimConfig = worker.config.optim  # the role's (ActorConfig's or CriticConfig's)
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
        norm = torch.nn.utils.clip_grad_norm_(worker.model.parameters(), optim.grad_clip)
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
