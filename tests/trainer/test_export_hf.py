"""``ActorWorker.export_hf`` writes the policy's own weights (straight from its state through
``hf_export.write_hf_checkpoint``, no model built, never a fresh initialisation): a 1-rank gloo
actor on the tiny model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from agentrl.config.schema import ActorConfig, OptimConfig
from agentrl.trainer.dist import free_port
from agentrl.trainer.workers import ActorWorker


@pytest.fixture
def actor(tiny_model_dir):
    worker = ActorWorker(
        model_path=str(tiny_model_dir), config=ActorConfig(optim=OptimConfig(lr=1e-2)), total_steps=1,
        rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(), device="cpu", seed=0,
    )
    yield worker
    if dist.is_initialized():
        dist.destroy_process_group()


def test_export_writes_exactly_the_policy_state_and_loads_back(actor, tmp_path):
    from transformers import AutoModelForCausalLM

    with torch.no_grad():  # a policy unlike any initialisation, so a re-initialised export cannot pass
        for p in actor.model.parameters():
            p.add_(0.25)
    state = actor.policy_state()
    actor.export_hf(str(tmp_path / "hf"))
    written = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(written) == set(state)
    for name, tensor in state.items():
        assert torch.equal(written[name], tensor), name
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert torch.equal(loaded.lm_head.weight, state["model.embed_tokens.weight"])  # tied head restored
    assert (tmp_path / "hf" / "tokenizer_config.json").exists()


def test_export_refuses_a_state_missing_a_tensor(actor, tmp_path, monkeypatch):
    state = actor.policy_state()
    del state["model.norm.weight"]
    monkeypatch.setattr(actor, "policy_state", lambda: state)
    with pytest.raises(RuntimeError, match="no tensor for model.norm.weight"):
        actor.export_hf(str(tmp_path / "hf"))
    assert not (tmp_path / "hf" / "model.safetensors").exists()


def test_export_keeps_the_checkpoints_own_dtype(tiny_model_dir, tmp_path):
    import json
    import shutil

    bf16_dir = tmp_path / "bf16-model"
    shutil.copytree(tiny_model_dir, bf16_dir)
    config = json.loads((bf16_dir / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (bf16_dir / "config.json").write_text(json.dumps(config))
    worker = ActorWorker(model_path=str(bf16_dir), config=ActorConfig(), total_steps=1,
                         rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(), device="cpu", seed=0)
    try:
        state = worker.policy_state()
        assert all(t.dtype == torch.float32 for t in state.values())  # the trainer's master weights
        worker.export_hf(str(tmp_path / "hf"))
    finally:
        dist.destroy_process_group()
    written = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert {t.dtype for t in written.values()} == {torch.bfloat16}
    for name, tensor in state.items():
        assert torch.equal(written[name], tensor.to(torch.bfloat16)), name
