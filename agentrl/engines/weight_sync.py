"""The broadcast side channel of SGLang's distributed weight update, for both ends.

Protocol (SGLang's ``/init_weights_update_group`` + ``/update_weights_from_distributed``):

1. The trainer's rank 0 and every inference rank join a *separate* process group (not the
   trainer's own world): rendezvous over ``tcp://master_address:master_port``, trainer rank 0,
   server ``i``'s ranks ``rank_offset_i .. rank_offset_i + tp_i - 1``, ``world_size = 1 + sum(tp)``.
   The group is created the way SGLang creates it (a TCP store prefixed by the group name and
   torch's process-group helper), so an agentrl trainer can meet a real SGLang server.
2. For each update, the trainer posts ``{names, dtypes, shapes, group_name}`` to every server and,
   while those calls are in flight, broadcasts each tensor from rank 0 in exactly that order. The
   servers allocate each tensor, receive it, then load them all.

Trust: the HTTP calls that form the group and announce each update carry the servers' API key
(``SGLangClient``), and a server checks each announced name and shape against its model before
allocating anything; the rendezvous itself (torch's TCP store at ``master_address:master_port``)
has no authentication of its own, so ``master_address`` should be on a private network.

``backend`` is "nccl" between GPU processes; "gloo" makes the same path run on CPU, which is how
it is tested here (against ``agentrl serve``, which implements the server side).
"""

from __future__ import annotations

import inspect
from datetime import timedelta
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

__all__ = ["init_update_group", "broadcast_from_trainer", "receive_broadcast", "destroy_update_group", "dtype_name", "parse_dtype"]


def init_update_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float = 300.0,
) -> dist.ProcessGroup:
    """Join (and, at rank 0, host) the weight-update group; blocks until all ranks joined."""
    # Private torch API, the same calls SGLang uses: a group that is not the default world.
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    options = "backend_options" if "backend_options" in inspect.signature(_new_process_group_helper).parameters else "pg_options"
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name, timeout=timeout, **{options: None}
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def broadcast_from_trainer(group: dist.ProcessGroup, tensors: Iterable[torch.Tensor]) -> None:
    """Rank 0: send each tensor, in order, to every other rank of the group."""
    for tensor in tensors:
        dist.broadcast(tensor.contiguous(), src=0, group=group)


def receive_broadcast(
    group: dist.ProcessGroup,
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Server rank: receive the tensors rank 0 broadcasts, in the announced order."""
    received: dict[str, torch.Tensor] = {}
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        tensor = torch.empty(tuple(shape), dtype=parse_dtype(dtype), device=device)
        dist.broadcast(tensor, src=0, group=group)
        received[name] = tensor
    return received


def destroy_update_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (the form SGLang's payload carries)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype
