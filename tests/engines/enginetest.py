"""Helpers for the engine tests: a tiny Qwen2 and a reference forward of the same weights.

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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServeProcess:
    """`agentrl serve` in a subprocess on 127.0.0.1 (restartable on the same port)."""

    def __init__(self, model: Path, port: int | None = None, extra: tuple[str, ...] = ()):
        self.model, self.port, self.extra = model, port or free_port(), extra
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0) -> "ServeProcess":
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "agentrl.engines.serve", "--model", str(self.model), "--port", str(self.port), *self.extra]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"agentrl serve exited with {self.proc.returncode}: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"agentrl serve on port {self.port} not healthy after {timeout_s}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()
        self.proc = None
