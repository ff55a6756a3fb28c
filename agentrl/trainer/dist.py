"""torch.distributed plumbing for the FSDP2 workers: process group, sharding, full state dicts.

Every worker rank is one process: ``init_distributed`` joins the group (gloo on CPU, NCCL on
GPU) and returns a 1-D device mesh; ``shard_model`` applies FSDP2's ``fully_shard`` to each
decoder layer and then to the root (which takes the embeddings, the tied head and the norm).
Full state dicts are gathered to rank 0 (on the CPU) for weight sync, checkpoints and export,
and loaded back by broadcasting from rank 0, so a checkpoint does not depend on the world size.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

__all__ = [
    "free_port",
    "resolve_device",
    "init_distributed",
    "shard_model",
    "reshard",
    "gather_model_state",
    "load_model_state",
    "gather_optimizer_state",
    "load_optimizer_state",
    "drop_tied_duplicates",
    "agree_max",
    "needs_agreement",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_device(name: str) -> torch.device:
    """``auto`` is CUDA when a GPU is visible, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but no CUDA device is visible to this process")
    return torch.device(name)


def init_distributed(*, rank: int, world_size: int, master_addr: str, master_port: int, device: torch.device,
                     timeout_s: float | None = None) -> DeviceMesh:
    """Join (or reuse) the default process group and return a 1-D mesh over all ranks.

    ``timeout_s`` bounds every collective (and the group's rendezvous): a rank that waits longer
    for its peers raises instead of hanging (``trainer.collective_timeout_s``)."""
    if world_size == 1:
        # no peer needs to find the store: port 0 lets it bind a free port itself, atomically,
        # where a port picked earlier (free_port) may have been taken by another process since
        master_port = 0
    os.environ.update(
        MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    elif dist.get_world_size() != world_size:
        raise RuntimeError(
            f"this process already belongs to a process group of {dist.get_world_size()} ranks, not {world_size}"
        )
    return init_device_mesh(device.type, (world_size,))


def needs_agreement(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward is a collective over more than one rank (FSDP2 gathers its
    parameters in each call), so that every rank must make the same sequence of calls."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule) and dist.is_initialized() and dist.get_world_size() > 1


def agree_max(value: int, device: torch.device | str = "cpu") -> int:
    """Collective: the largest ``value`` over all ranks (``value`` itself with one rank).

    Each rank counts the forward calls (or micro-batches) its own rows need; every rank then
    makes the agreed number, the short ones padding with calls that add nothing to the loss."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    count = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    # transformers names the classes a layer must not be split across: the decoder layers.
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise RuntimeError(f"{type(model).__name__}: no decoder layers found to shard (_no_split_modules={names})")
    return layers


def shard_model(model: torch.nn.Module, mesh: DeviceMesh, *, param_dtype: torch.dtype) -> torch.nn.Module:
    """FSDP2: one unit per decoder layer, then the root. Parameters stay fp32 (the optimizer's
    master copy); with ``param_dtype=bfloat16`` compute runs in bf16 and gradients reduce in fp32.

    One rank gets the module unwrapped: FSDP2 would have nothing to shard, yet its per-layer
    gather and reduce copies cost about a quarter of an update step on the CPU, and an FSDP2
    module cannot take the trainer's packed forward (``packed.py``), much the faster on a GPU
    too (docs/gpu.md). In bf16 such a rank computes under autocast instead
    (``Worker.call``, ``rank.py``): fp32 parameters, bf16 matrix products. Everything else (state dicts,
    optimizer state, ``reshard``) treats both forms alike."""
    if mesh.size() == 1:
        return model
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def reshard(model: torch.nn.Module) -> None:
    """Put every FSDP2 unit back in its sharded state. FSDP2 keeps the root's parameters
    unsharded after a forward until the backward; after a forward without backward (scoring,
    the SFT stop check) they would stay so, and ``model.parameters()`` would then hand out the
    unsharded copies: an optimizer built from those updates tensors the module no longer uses."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


# torch.distributed.checkpoint is imported where it is used: it costs about a second to import,
# and the driver process, which imports this module, never gathers or loads a state dict.


def gather_model_state(model: torch.nn.Module, *, to_cpu: bool = True) -> dict[str, torch.Tensor]:
    """Collective: the full state dict on rank 0; ``{}`` on the other ranks. ``to_cpu``: CPU
    tensors (checkpoints, exports, an engine in another process); else the tensors stay on the
    model's device, for an engine beside it there: on a GPU the copy through the host was nearly
    all of an in-memory weight sync (docs/gpu.md). Its cost: every rank holds the full fp32
    tensors on its device until the gather returns (the offload keeps one tensor at a time)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=to_cpu))
    if not to_cpu and dist.is_initialized() and dist.get_rank() != 0:
        return {}  # without the offload every rank is handed the full tensors; rank 0 alone keeps them
    return state


def load_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Collective: load a full state dict held by rank 0 (the others may pass ``{}``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def gather_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if isinstance(optimizer, torch.optim.SGD) and all(group.get("momentum", 0) == 0 for group in optimizer.param_groups):
        # plain SGD keeps no state (torch's loader refuses an empty one); its learning rate is the
        # schedule's, which the caller restores. Decided from the optimizer, so every rank agrees.
        return

    set_optimizer_state_dict(
        model, optimizer, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )


def drop_tied_duplicates(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove keys that alias another parameter (``lm_head.weight`` when embeddings are tied).

    The gathered state dict lists a tied tensor under both names; sending both doubles the
    transfer and makes a receiver copy the same storage twice.
    """
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "tie_word_embeddings", False):
        return state
    tied = getattr(model, "_tied_weights_keys", None) or {}
    aliases = tied.keys() if isinstance(tied, dict) else tied
    return {k: v for k, v in state.items() if k not in aliases}
