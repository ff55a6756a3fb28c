"""Helpers for the engine tests: a tiny Qwen2, a reference forward of the same weights, and a
trainer in this process (the SGLang training tests drive its steps themselves).

Imported by name (``from enginetest import ...``): pytest puts this folder on sys.path.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

VOCAB = 256


def build_qwen2(seed: int) -> Qwen2ForCausalLM:
    """A 2-layer Qwen2 small enough that a test decodes hundreds of tokens in well under a second."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        # A wide init makes the random model's greedy output varied (std 0.02 repeats one token).
        initializer_range=0.2,
        eos_token_id=None,
        bos_token_id=None,
    )
    model = Qwen2ForCausalLM(config).eval()
    return model


def load_reference(path: Path) -> Qwen2ForCausalLM:
    return Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


@torch.no_grad()
def reference_logprobs(model, prompt: list[int], output: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / T) of each output token from one full forward over prompt + output."""
    logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    scale = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits / scale, dim=-1).gather(1, torch.tensor(output)[:, None]).squeeze(1).tolist()


@torch.no_grad()
def reference_greedy(model, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def trainer_in_process(overrides: list[str]):
    """(trainer, run dir, metrics logger) of `agentrl train` with ``overrides``, in this process:
    the config checked as the command checks it, the run directory made and its config written."""
    from agentrl.config import load_config
    from agentrl.engines.managed import check_engine_config
    from agentrl.rundir import make_run_dir
    from agentrl.trainer.logging import MetricsLogger
    from agentrl.trainer.run import Trainer

    cfg = load_config("train", overrides)
    check_engine_config(cfg, training=True)
    run = make_run_dir(cfg)
    run.write_config(cfg)
    log = MetricsLogger(run.path, cfg.logging)
    return Trainer(cfg, run.path, log=log), run, log
