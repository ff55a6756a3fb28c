"""``gather_model_state(to_cpu=False)``, the gather an in-memory weight sync takes on a GPU (the
weights stay on the model's device, docs/gpu.md): on two FSDP2 ranks it must hand rank 0 exactly
the full tensors of the CPU gather and every other rank nothing, as the CPU gather does. Run on
two gloo ranks in processes of their own (the same collectives as on GPUs, CPU tensors)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from agentrl.trainer.dist import free_port

RANK = textwrap.dedent("""
    import sys, torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from agentrl.trainer.dist import init_distributed, shard_model, gather_model_state
    from torch.distributed.device_mesh import init_device_mesh
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2)
    reference = LlamaForCausalLM(config).state_dict()
    init_distributed(rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port, device=torch.device("cpu"), timeout_s=60)
    torch.manual_seed(0)  # the same weights on both ranks, the reference's
    model = shard_model(LlamaForCausalLM(config), init_device_mesh("cpu", (2,)), param_dtype=torch.float32)
    on_device = gather_model_state(model, to_cpu=False)
    on_cpu = gather_model_state(model, to_cpu=True)
    if rank == 0:
        assert on_device.keys() == on_cpu.keys() == reference.keys(), sorted(set(reference) ^ set(on_device))
        for name, tensor in on_device.items():
            assert type(tensor) is torch.Tensor, (name, type(tensor))  # a full tensor, not a DTensor shard
            assert torch.equal(tensor, on_cpu[name]) and torch.equal(tensor, reference[name]), name
        print("rank 0 full", len(on_device))
    else:
        print("rank 1 holds", len(on_device), len(on_cpu))
    # leave the group before exiting: a rank whose gloo threads are still running at exit aborts
    # ("terminate called without an active exception")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
""")


@pytest.mark.timeout(180)
def test_the_gather_that_stays_on_the_device_gives_rank_0_the_full_tensors_and_the_others_nothing():
    port = free_port()
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(rank), str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for rank in range(2)]
    outputs = [rank.communicate(timeout=150) for rank in ranks]
    for rank, (out, err) in zip(ranks, outputs):
        assert rank.returncode == 0, err[-3000:]
    assert outputs[0][0].strip().splitlines()[-1] == "rank 0 full 21"
    assert outputs[1][0].strip().splitlines()[-1] == "rank 1 holds 0 0"
