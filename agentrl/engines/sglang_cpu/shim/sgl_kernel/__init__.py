"""Pure-torch stand-in for the two ``sgl_kernel`` CPU ops SGLang calls on a plain x86 CPU.

With ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports ``assign_req_to_token_pool_cpu``
(``sglang/srt/mem_cache/allocation.py``: writes newly allocated KV slots into the request ->
token table) and ``copy_all_layer_kv_cache_cpu`` (``sglang/kernels/ops/kvcache/cache_move.py``:
moves KV rows between slots in every layer's buffer; called once at start-up with a no-op move)
from ``sgl_kernel``. The PyPI ``sgl_kernel`` ships only CUDA libraries, and SGLang's own CPU
kernels are built from source for AMX Xeons, so the server cannot start without these two.

This folder's parent goes FIRST on ``PYTHONPATH`` of the SGLang server process only (it shadows
the installed package there); agentrl itself never imports it under this name. The ops are also
registered as ``torch.ops.sgl_kernel.*`` so either call style SGLang uses finds them.
"""

from __future__ import annotations

import ctypes

import torch

# Imported by SGLang modules at import time on the CPU path (speculative decoding), never called
# when serving a plain model without a draft model: placeholders that fail loudly if they are.
_IMPORTED_NOT_CALLED = (
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "rotate_input_ids_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
)

__all__ = ["assign_req_to_token_pool_cpu", "copy_all_layer_kv_cache_cpu", *_IMPORTED_NOT_CALLED]
__version__ = "0.0.0+agentrl-cpu-shim"


@torch.library.custom_op("sgl_kernel::assign_req_to_token_pool_cpu", mutates_args=("req_to_token",))
def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,  # [batch] row of each request in req_to_token
    req_to_token: torch.Tensor,  # [max_requests, pool_len] KV slot of each token position
    start_offset: torch.Tensor,  # [batch] first position to fill
    end_offset: torch.Tensor,  # [batch] one past the last position to fill
    out_cache_loc: torch.Tensor,  # [sum(end - start)] new slots, request after request
    pool_len: int,
) -> None:
    """req_to_token[row_i, start_i:end_i] = the next (end_i - start_i) entries of out_cache_loc."""
    lengths = (end_offset - start_offset).to(torch.int64)  # [batch]
    total = int(lengths.sum())
    if total == 0:
        return
    if int(end_offset.max()) > pool_len:
        raise ValueError(f"end offset {int(end_offset.max())} is past the pool length {pool_len}")
    rows = req_pool_indices.to(torch.int64).repeat_interleave(lengths)  # [total]
    first_of_request = (torch.cumsum(lengths, 0) - lengths).repeat_interleave(lengths)  # [total]
    cols = torch.arange(total) - first_of_request + start_offset.to(torch.int64).repeat_interleave(lengths)
    req_to_token[rows, cols] = out_cache_loc[:total].to(req_to_token.dtype)


@torch.library.custom_op("sgl_kernel::copy_all_layer_kv_cache_cpu", mutates_args=())
def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,  # [buffers] uint64 address of each layer's K (then V) buffer
    strides: torch.Tensor,  # [buffers] bytes per slot (row) of each buffer
    tgt_loc: torch.Tensor,  # [n] destination slots
    src_loc: torch.Tensor,  # [n] source slots
) -> None:
    """In every buffer, copy row src_loc[j] to row tgt_loc[j] (reads all sources before writing)."""
    if tgt_loc.numel() == 0:
        return
    tgt, src = tgt_loc.to(torch.int64), src_loc.to(torch.int64)
    rows = int(torch.maximum(tgt.max(), src.max())) + 1
    # SGLang hands over raw addresses, not tensors: view the first `rows` rows of each buffer as
    # bytes. Advanced indexing gathers the sources into a copy first, so overlaps are safe.
    for address, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (rows * stride)).from_address(address)
        view = torch.frombuffer(raw, dtype=torch.uint8).view(rows, stride)
        view[tgt] = view[src]


def _not_provided(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not provided by agentrl's CPU stand-in: speculative decoding "
            "and SGLang's AMX kernels need SGLang's own CPU build of sgl_kernel"
        )

    op.__name__ = op.__qualname__ = name
    return op


for _name in _IMPORTED_NOT_CALLED:
    globals()[_name] = _not_provided(_name)
del _name
