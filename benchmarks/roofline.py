"""The roofline of a built-in engine step: the bytes it must move, the FLOPs it must do, and the
machine's measured streaming bandwidth and matmul rate (``agentrl bench engine``).

What a step *must* do, for a decoder with RMSNorm, rotary, grouped-query attention and SwiGLU in
fp32 (the engine's fast path; ``agentrl/engines/_packed.py``), given its packed tokens:

* bytes: every weight once (the layers' linear weights and norms, the final norm and the LM head;
  with tied embeddings the LM head *is* the embedding table, otherwise only the looked-up rows of
  the table count), the K/V of every position the step's attention reads, once (each decode row's
  context including its new token, each prefill span's prefix and new tokens), and the K/V of every
  computed token written once. Activations are left out (they stay in cache at these sizes);
* FLOPs: 2 x (linear weights) per computed token, 2 x (LM head) per row whose logits are sampled,
  and attention's 2 x head_dim per (query, key) pair for the scores and as many for the weighted
  values, per query head and layer. Norms, rotary and softmax are left out (linear in the tokens,
  small beside the matrix products).

The roofline time is ``max(bytes / bandwidth, FLOPs / matmul rate)``: the least time the machine
could take if the step did only what it must at the measured rates; the achieved fraction is that
time over the time measured. Both rates are measured at the start of the run with the run's
thread count (``measure_stream_gbps``, ``measure_matmul_gflops`` in ``engine.py``).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

__all__ = ["ModelShape", "StepCost", "step_cost", "measure_stream_gbps", "Machine", "roofline_s", "run_roofline"]

FP32 = 4


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool  # the LM head is the embedding table
    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3's per-head norms
    element_bytes: int = FP32

    @classmethod
    def of(cls, config) -> "ModelShape":
        heads = config.num_attention_heads
        return cls(
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            heads=heads,
            kv_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate=config.intermediate_size,
            vocab=config.vocab_size,
            tied=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
            qk_norm=config.model_type == "qwen3",
        )

    @property
    def layer_linear_weights(self) -> int:
        """Elements of one layer's matrices: q, k, v, o, gate, up, down."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate

    @property
    def layer_other_weights(self) -> int:
        """One layer's vectors: two norms, the q/k/v biases, Qwen3's head norms."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return 2 * self.hidden + (q + 2 * kv if self.qkv_bias else 0) + (2 * self.head_dim if self.qk_norm else 0)

    @property
    def kv_bytes_per_position(self) -> int:
        """K and V of one position in every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.element_bytes


@dataclass(frozen=True)
class StepCost:
    weight_bytes: int
    kv_read_bytes: int
    kv_write_bytes: int
    linear_flops: int
    attention_flops: int

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes

    @property
    def flops(self) -> int:
        return self.linear_flops + self.attention_flops


def step_cost(shape: ModelShape, *, tokens: int, logit_rows: int, kv_positions: int, attended_pairs: int) -> StepCost:
    """What one step of ``tokens`` computed tokens must move and compute. ``logit_rows``: rows whose
    next-token logits are computed (one per decode row and per prefill span); ``kv_positions``: K/V
    positions its attention reads (``StepRecord.kv_positions``); ``attended_pairs``: (query, key)
    pairs per layer and query head (``StepRecord.attended_pairs``)."""
    e = shape.element_bytes
    lm_head = shape.vocab * shape.hidden
    weights = shape.layers * (shape.layer_linear_weights + shape.layer_other_weights) + shape.hidden + lm_head
    looked_up = 0 if shape.tied else tokens * shape.hidden  # embedding rows read besides the LM head
    return StepCost(
        weight_bytes=(weights + looked_up) * e,
        kv_read_bytes=kv_positions * shape.kv_bytes_per_position,
        kv_write_bytes=tokens * shape.kv_bytes_per_position,
        linear_flops=2 * tokens * shape.layers * shape.layer_linear_weights + 2 * logit_rows * lm_head,
        attention_flops=4 * shape.head_dim * shape.heads * shape.layers * attended_pairs,
    )


@dataclass(frozen=True)
class Machine:
    stream_gbps: float  # GB/s read from memory, a tensor far larger than the last-level cache
    matmul_gflops: float  # the fp32 rate of a large matrix product, in billions of operations a second

    def memory_s(self, cost: StepCost) -> float:
        return cost.bytes / (self.stream_gbps * 1e9)

    def compute_s(self, cost: StepCost) -> float:
        return cost.flops / (self.matmul_gflops * 1e9)


def roofline_s(cost: StepCost, machine: Machine) -> float:
    return max(machine.memory_s(cost), machine.compute_s(cost))


def measure_stream_gbps(megabytes: int = 256, trials: int = 5) -> float:
    """Best-of-``trials`` rate of a sum over an fp32 tensor of ``megabytes`` (a streaming read,
    the access pattern of a step's weights and K/V) with the current torch thread count."""
    x = torch.ones(megabytes * (1 << 20) // FP32)
    x.sum()  # warm-up (pages touched)
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * FP32 / best / 1e9


def _cost_of(shape: ModelShape, record) -> StepCost:
    rows = len(record.decode_rids) + len(record.prefill_rids)
    return step_cost(shape, tokens=len(record.decode_rids) + record.prefill_tokens, logit_rows=rows,
                     kv_positions=record.kv_positions, attended_pairs=record.attended_pairs)


def run_roofline(shape: ModelShape, machine: Machine, records: list, wall_s: float, *, full_rows: int | None = None) -> dict:
    """The roofline of a run's logged steps (``BuiltinEngine.step_log``) against its wall time,
    and of its decode-only steps with at least ``full_rows`` rows against their period (start to
    the next step's start: the step's own work and the scheduling and Python between steps)."""
    costs = [_cost_of(shape, r) for r in records]
    total = StepCost(*(sum(getattr(c, f) for c in costs) for f in StepCost.__dataclass_fields__))
    roof = sum(roofline_s(c, machine) for c in costs)
    in_steps = sum(r.ended - r.started for r in records)
    out = {
        "steps": len(records),
        **asdict(total),
        "bytes": total.bytes,
        "flops": total.flops,
        "memory_bound_steps": sum(1 for c in costs if machine.memory_s(c) >= machine.compute_s(c)),
        "roofline_s": round(roof, 4),
        "in_steps_s": round(in_steps, 4),
        "wall_s": round(wall_s, 4),
        # the floor's reading: the roofline of every computed token over the run's wall time
        "fraction_of_wall": round(roof / wall_s, 4) if wall_s > 0 else None,
        "fraction_in_steps": round(roof / in_steps, 4) if in_steps > 0 else None,
    }
    if full_rows:
        periods, roofs, durations, contexts = [], [], [], []
        for record, following, cost in zip(records, records[1:], costs):
            if record.prefill_rids or len(record.decode_rids) < full_rows:
                continue
            periods.append(following.started - record.started)
            durations.append(record.ended - record.started)
            roofs.append(roofline_s(cost, machine))
            contexts.append(record.kv_positions / len(record.decode_rids))
        if periods:
            out["decode_steps"] = {
                "rows_at_least": full_rows,
                "steps": len(periods),
                "mean_context": round(sum(contexts) / len(contexts), 1),
                "roofline_ms": round(sum(roofs) / len(roofs) * 1e3, 3),
                "step_ms": round(sum(durations) / len(durations) * 1e3, 3),
                "period_ms": round(sum(periods) / len(periods) * 1e3, 3),
                # the floor's reading: the roofline over the step's period (scheduling included)
                "fraction": round(sum(roofs) / sum(periods), 4),
                "fraction_in_step": round(sum(roofs) / sum(durations), 4),
            }
    return out
