"""``agentrl bench export``: the disk weight sync against the cost of its bytes.

Builds a Qwen2 of the chosen shape from a config (random weights; ``0.5b`` is Qwen2.5-0.5B's
shape) and hands its state to the trainer's disk writer, ``hf_export.write_hf_checkpoint``, as the
trainer does (HF names, tied head dropped), several times, alternating with the floor, the same
tensors in the checkpoint's dtype written by ``safetensors.save_file`` alone, and with
transformers' ``save_pretrained`` of the model. The reload is the built-in engine's
(``read_checkpoint`` + ``copy_weights_into`` the model); sync = write + reload. Prints one JSON
object of medians (seconds) and ratios (also the median of each round's export/raw ratio).

    agentrl bench export [--shape 0.5b] [--dtype float32] [--repeats 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

__all__ = ["main", "SHAPES"]

SHAPES = {
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
                 rms_norm_eps=1e-6, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=1060, max_position_embeddings=2048, rope_theta=10000.0,
                 rms_norm_eps=1e-6, tie_word_embeddings=True),
}


def _model(shape: str, dtype):
    """A randomly initialised model, built on the meta device and filled in place (a model's own
    initialisation is many times slower on the CPU and is not what is measured)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPES[shape], use_sliding_window=False)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    model = model.to_empty(device="cpu").to(dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    model.tie_weights()
    model.config.dtype = dtype
    return model.eval()


def _source(model, directory: Path) -> Path:
    """A starting checkpoint's side files: the model's config and the shipped tiny tokenizer."""
    import agentrl

    directory.mkdir(parents=True)
    model.config.save_pretrained(directory)
    tokenizers = sorted((Path(agentrl.__file__).parent / "tiny_models").glob("*/tokenizer.json"))
    for file in tokenizers[0].parent.iterdir() if tokenizers else ():
        if file.name.startswith("tokenizer") or file.name == "chat_template.jinja":
            shutil.copyfile(file, directory / file.name)
    return directory


def run(shape: str, dtype_name: str, repeats: int, root: Path) -> dict:
    import torch
    from safetensors.torch import save_file

    from agentrl.engines.weights import copy_weights_into, read_checkpoint
    from agentrl.trainer.dist import drop_tied_duplicates
    from agentrl.trainer.hf_export import write_hf_checkpoint

    dtype = getattr(torch, dtype_name)
    started = time.perf_counter()
    model = _model(shape, dtype)
    build_s = time.perf_counter() - started
    state = drop_tied_duplicates(model, dict(model.state_dict()))
    source = _source(model, root / "source")
    times: dict[str, list[float]] = {"export_s": [], "raw_s": [], "save_pretrained_s": [], "load_s": []}

    def timed(key: str, fn) -> None:
        t0 = time.perf_counter()
        fn()
        times[key].append(time.perf_counter() - t0)

    for i in range(repeats):
        steps = [
            ("export_s", lambda: write_hf_checkpoint(state, root / "ckpt", source=source)),
            ("raw_s", lambda: save_file(state, str(root / "raw.safetensors"))),
            ("save_pretrained_s", lambda: model.save_pretrained(root / "hf")),
        ]
        for key, fn in steps if i % 2 == 0 else reversed(steps):  # alternate the order: drift hits all alike
            timed(key, fn)
        timed("load_s", lambda: copy_weights_into(model, read_checkpoint(root / "ckpt")))
        (root / "raw.safetensors").unlink()
        shutil.rmtree(root / "hf")
    size = sum(f.stat().st_size for f in (root / "ckpt").glob("*.safetensors"))
    medians = {key: round(statistics.median(values), 4) for key, values in times.items()}
    return {
        "shape": shape, "dtype": dtype_name, "parameters": sum(p.numel() for p in model.parameters()),
        "bytes": size, "repeats": repeats, "model_build_s": round(build_s, 2), **medians,
        "export_over_raw": round(medians["export_s"] / medians["raw_s"], 2),
        # each round's two writes side by side: steadier than the ratio of medians on a busy machine
        "export_over_raw_paired_median": round(statistics.median(e / r for e, r in zip(times["export_s"], times["raw_s"])), 2),
        "save_pretrained_over_raw": round(medians["save_pretrained_s"] / medians["raw_s"], 2),
        "sync_s": round(medians["export_s"] + medians["load_s"], 4),
        "export_gb_per_s": round(size / 1e9 / medians["export_s"], 2),
        "all_s": {key: [round(v, 4) for v in values] for key, values in times.items()},
        "files": sorted(p.name for p in (root / "ckpt").iterdir()),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentrl bench export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory, removed after)")
    parser.add_argument("--json", action="store_true", help="accepted for symmetry with the other benchmarks (output is JSON)")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="agentrl-bench-export-", dir=args.dir))
    try:
        print(json.dumps(run(args.shape, args.dtype, args.repeats, root)))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0
