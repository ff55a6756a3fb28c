"""``hf_export.write_hf_checkpoint``: the policy's state written as a transformers checkpoint
without building a model, beside the starting checkpoint's config and tokenizer, whole or not at
all; the built-in engine reloads it with exactly the logprobs of the same weights loaded directly."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from agentrl.engines.base import GenerateRequest, SamplingParams
from agentrl.engines.builtin import BuiltinEngine
from agentrl.trainer.dist import drop_tied_duplicates
from agentrl.trainer.hf_export import write_hf_checkpoint

pytestmark = pytest.mark.timeout(120)


def moved_state(model_dir) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The tiny model with every weight moved (unlike any initialisation), and its state as the
    trainer hands it over: HF names, the tied head dropped."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5 * p.std())
    return model, drop_tied_duplicates(model, dict(model.state_dict()))


def test_the_checkpoint_holds_exactly_the_state_in_hf_names_beside_the_sources_config_and_tokenizer(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, state = moved_state(tiny_model_dir)
    assert "lm_head.weight" not in state
    out = write_hf_checkpoint(state, tmp_path / "hf", source=tiny_model_dir)
    written = load_file(str(out / "model.safetensors"))
    assert set(written) == set(state)
    for name, tensor in state.items():
        assert torch.equal(written[name], tensor), name
    assert (out / "config.json").read_bytes() == (tiny_model_dir / "config.json").read_bytes()
    assert AutoTokenizer.from_pretrained(out)("12 * 34").input_ids == AutoTokenizer.from_pretrained(tiny_model_dir)("12 * 34").input_ids
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for name, tensor in model.state_dict().items():  # the tied head comes back from the embedding
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no staging left beside it


def test_the_checkpoint_is_written_in_the_dtype_its_config_declares(tiny_model_dir, tmp_path):
    source = tmp_path / "bf16-source"
    shutil.copytree(tiny_model_dir, source)
    config = json.loads((source / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (source / "config.json").write_text(json.dumps(config))
    _, state = moved_state(tiny_model_dir)
    written = load_file(str(write_hf_checkpoint(state, tmp_path / "hf", source=source) / "model.safetensors"))
    assert {t.dtype for t in written.values()} == {torch.bfloat16}
    for name, tensor in state.items():
        assert torch.equal(written[name], tensor.to(torch.bfloat16)), name
    assert all(t.dtype == torch.float32 for t in state.values())  # the caller's tensors are left as they were


def test_no_model_is_built_to_write_it(tiny_model_dir, tmp_path, monkeypatch):
    import transformers

    _, state = moved_state(tiny_model_dir)

    def refuse(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(transformers.PreTrainedModel, "__init__", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", refuse)
    write_hf_checkpoint(state, tmp_path / "hf", source=tiny_model_dir)
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_a_failed_write_leaves_the_previous_checkpoint_whole_and_no_staging(tiny_model_dir, tmp_path, monkeypatch):
    import safetensors.torch

    _, state = moved_state(tiny_model_dir)
    first = write_hf_checkpoint(state, tmp_path / "hf", source=tiny_model_dir)
    before = {p.name: p.read_bytes() for p in first.iterdir()}

    def broken(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    changed = {name: tensor + 1 for name, tensor in state.items()}
    with pytest.raises(OSError, match="disk full"):
        write_hf_checkpoint(changed, tmp_path / "hf", source=tiny_model_dir)
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_a_second_write_replaces_the_first(tiny_model_dir, tmp_path):
    _, state = moved_state(tiny_model_dir)
    write_hf_checkpoint(state, tmp_path / "hf", source=tiny_model_dir)
    changed = {name: tensor + 1 for name, tensor in state.items()}
    write_hf_checkpoint(changed, tmp_path / "hf", source=tiny_model_dir)
    written = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert torch.equal(written["model.norm.weight"], changed["model.norm.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_bad_input_is_refused_naming_what_is_wrong_before_anything_is_written(tiny_model_dir, tmp_path):
    _, state = moved_state(tiny_model_dir)
    with pytest.raises(RuntimeError, match="no tensor for model.norm.weight"):
        write_hf_checkpoint({k: v for k, v in state.items() if k != "model.norm.weight"}, tmp_path / "hf",
                            source=tiny_model_dir, expected=list(state))
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        write_hf_checkpoint(state, tmp_path / "hf", source=tmp_path)
    with pytest.raises(TypeError, match="'model.norm.weight' is a list"):
        write_hf_checkpoint({**state, "model.norm.weight": [1.0]}, tmp_path / "hf", source=tiny_model_dir)
    assert list(tmp_path.iterdir()) == []


def test_the_builtin_engine_reloads_it_with_the_exact_logprobs_of_the_same_weights_loaded_directly(tiny_model_dir, tmp_path):
    model, state = moved_state(tiny_model_dir)
    direct = tmp_path / "direct"
    model.save_pretrained(direct)  # the same weights through transformers' own writer
    written = write_hf_checkpoint(state, tmp_path / "hf", source=tiny_model_dir)
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5)
    prompts = [[5, 17, 42, 99, 3], [64, 128, 7]]

    async def run(engine: BuiltinEngine, path=None):
        if path is not None:
            await engine.update_weights(path=str(path), version=1)
        return [await engine.generate(GenerateRequest(p, sampling, rid=f"r{i}")) for i, p in enumerate(prompts)]

    reloaded_engine = BuiltinEngine(tiny_model_dir, max_batch_size=4, seed=0)
    direct_engine = BuiltinEngine(direct, max_batch_size=4, seed=0)
    try:
        reloaded = asyncio.run(run(reloaded_engine, written))
        expected = asyncio.run(run(direct_engine))
    finally:
        reloaded_engine.close()
        direct_engine.close()
    for got, want in zip(reloaded, expected):
        assert got.output_ids == want.output_ids
        assert got.logprobs == want.logprobs  # exact: the same fp32 weights
