"""Decode steps on a static layout, replayed as CUDA graphs on a GPU.

A decode step of a small model on a GPU is bound by kernel launches and Python, not by the GPU
(docs/gpu.md): the same few hundred small kernels are launched every step. Here a decode-only
step (no prefill, no prefix copy) runs with shapes that depend on nothing but a *bucket*:

* the ``n`` decode rows are padded to the smallest bucket ``B >= n`` (powers of two up to the
  engine's ``max_batch_size``, as SGLang and vLLM capture per batch size); padded rows decode
  token 0 at position 0 of a *scratch slot*, one slot past the requests' own, which no request is
  ever given (``Scheduler``) and whose outputs are dropped;
* attention reads every slot of the cache over its whole capacity, masked by each slot's length
  (computed inside the step from the rows' slots and positions), instead of the smallest span the
  step needs.

The inputs (ids, positions, slots) live in fixed buffers, so on CUDA each (bucket, cache capacity)
is captured once as a CUDA graph and replayed with new inputs; a cache that grows (a new capacity)
gets new graphs. Weight updates copy into the parameters in place, so graphs stay valid. On the
CPU the same static step runs eagerly (no graphs): the tests compare it with the default path.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from agentrl.engines import _ragged
from agentrl.engines._packed import PackedDecoderForward, rms_norm, rotate_half

__all__ = ["StaticDecode", "buckets"]


def buckets(max_batch_size: int) -> list[int]:
    """Powers of two below ``max_batch_size``, and ``max_batch_size`` itself."""
    out, b = [], 1
    while b < max_batch_size:
        out.append(b)
        b *= 2
    return out + [max_batch_size]


class StaticDecode:
    """Decode-only steps through a ``PackedDecoderForward``'s weights with bucket-shaped inputs."""

    def __init__(self, forward: PackedDecoderForward, cache: _ragged.SlotKVCache, *, max_batch_size: int,
                 device: torch.device, graphs: bool):
        if cache.slots != max_batch_size + 1:
            raise ValueError(f"static decode needs a scratch slot: cache has {cache.slots} slots for {max_batch_size} requests")
        self.forward, self.cache, self.device = forward, cache, device
        self.scratch = max_batch_size
        self.buckets = buckets(max_batch_size)
        self.graphs = graphs and device.type == "cuda"
        biggest = self.buckets[-1]
        self.ids = torch.zeros(biggest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(biggest, dtype=torch.int64, device=device)
        self.slots = torch.full((biggest,), self.scratch, dtype=torch.int64, device=device)
        self._captured: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._capacity = cache.capacity
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self.capture_error: str | None = None
        self.steps = 0  # decode steps taken here, and how many of them replayed a graph
        self.replays = 0

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} decode rows exceed the largest bucket {self.buckets[-1]}")

    @torch.inference_mode()
    def __call__(self, ids: list[int], positions: list[int], slots: list[int]) -> torch.Tensor:
        """Next-token logits ``[n, vocab]`` (float32) for ``n`` decode rows."""
        n = len(ids)
        b = self.bucket(n)
        self.steps += 1
        pad = b - n
        self.ids[:b].copy_(torch.tensor(ids + [0] * pad), non_blocking=True)
        self.positions[:b].copy_(torch.tensor(positions + [0] * pad), non_blocking=True)
        self.slots[:b].copy_(torch.tensor(slots + [self.scratch] * pad), non_blocking=True)
        if not self.graphs:
            return self._step(b)[:n]
        if self.cache.capacity != self._capacity:  # the cache grew: its tensors are new
            # the old graphs go, and with the last of them their memory pool: capturing into that
            # pool's handle again trips the CUDA allocator's assertion, so the new graphs take a new one
            self._captured.clear()
            self._pool = torch.cuda.graph_pool_handle()
            self._capacity = self.cache.capacity
        key = (b, self.cache.capacity)
        held = self._captured.get(key)
        if held is None:
            try:
                held = self._capture(b)
            except RuntimeError as exc:  # a capture refused: keep decoding, eagerly, and say why
                self.graphs, self.capture_error = False, f"{type(exc).__name__}: {exc}"[:2000]
                warnings.warn(f"decode graphs off after a failed capture: {self.capture_error}", stacklevel=2)
                torch.cuda.synchronize(self.device)
                return self._step(b)[:n]
            self._captured[key] = held
        graph, out = held
        graph.replay()
        self.replays += 1
        return out[:n]

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm-up runs on a side stream (what capture needs); they compute this very step, so the
        # K/V they write are the step's own, written again by the replay.
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(b)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread-local: the engine's thread captures while others may use the GPU
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self._step(b)
        return graph, out

    def _step(self, b: int) -> torch.Tensor:
        fw, cache = self.forward, self.cache
        ids, positions, slots = self.ids[:b], self.positions[:b], self.slots[:b]
        capacity, total_slots = cache.capacity, cache.slots
        # each slot's length: a decoding row's position + 1; every other slot sees position 0 only
        lengths = torch.ones(total_slots, dtype=torch.int64, device=ids.device)
        lengths.scatter_(0, slots, positions + 1)
        columns = torch.arange(capacity, device=ids.device)
        mask = torch.zeros((total_slots, capacity), dtype=torch.float32, device=ids.device)
        mask.masked_fill_(columns[None, :] >= lengths[:, None], float("-inf"))
        mask = mask[:, None, None, :]  # [slots, 1, 1, capacity]
        cos = fw.cos[positions][:, None, :]  # [B, 1, head_dim]
        sin = fw.sin[positions][:, None, :]
        hidden = F.embedding(ids, fw.embed.weight)  # [B, hidden]
        width = hidden.shape[-1]
        linear = fw.linear
        heads, kv_heads, head_dim = fw.heads, fw.kv_heads, fw.head_dim
        group = heads // kv_heads
        for index, layer in enumerate(fw.layers):
            attn, mlp = layer.self_attn, layer.mlp
            x = rms_norm(hidden, layer.input_layernorm, width, fw.eps)
            q = linear(x, attn.q_proj).view(b, heads, head_dim)
            k = linear(x, attn.k_proj).view(b, kv_heads, head_dim)
            v = linear(x, attn.v_proj).view(b, kv_heads, head_dim)
            if hasattr(attn, "q_norm"):
                q = rms_norm(q, attn.q_norm, head_dim, fw.eps)
                k = rms_norm(k, attn.k_norm, head_dim, fw.eps)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            cache_k, cache_v = cache.keys[index], cache.values[index]
            cache_k[slots, :, positions] = k
            cache_v[slots, :, positions] = v
            rows = q.new_zeros((total_slots, heads, head_dim))
            rows[slots] = q
            rows = rows.view(total_slots, kv_heads, group, head_dim)
            scores = torch.matmul(rows, cache_k.transpose(-1, -2))  # [slots, kv_heads, group, capacity]
            scores.mul_(fw.scaling).add_(mask)
            attended = torch.matmul(scores.softmax(dim=-1), cache_v).view(total_slots, heads, head_dim)[slots]
            hidden = hidden + linear(attended.reshape(b, -1), attn.o_proj)
            x = rms_norm(hidden, layer.post_attention_layernorm, width, fw.eps)
            gate = linear(x, mlp.gate_proj)
            hidden = hidden + linear(F.silu(gate).mul_(linear(x, mlp.up_proj)), mlp.down_proj)
        hidden = rms_norm(hidden, fw.norm, width, fw.eps)
        return linear(hidden, fw.lm_head).float()  # [B, vocab]
