"""Build a skilled tiny model by its recipe and put it where agentrl ships it.

    .venv/bin/python scripts/build_skilled_base.py                  # calculator, 1m, seed 0
    .venv/bin/python scripts/build_skilled_base.py --fresh          # rebuild even if cached

Run after changing ``agentrl.tiny.SKILLS`` (or the tiny model's builder or chat template):
``tests/test_skilled_base.py`` fails while the shipped folder's recipe key is not the current
one. The build is ``agentrl.trainer.skilled_base.skilled_model_dir`` (cached in
``~/.cache/agentrl/tiny``; ``--fresh`` builds into a new temporary cache); the folder written is
``agentrl/tiny_models/<size>-seed<seed>-<skill>/`` with the model, its tokenizer and
``recipe.json``. Prints one JSON line: the folder, the key, the weights' sha256, build seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path

from agentrl.tiny import SHIPPED_MODELS, skill_recipe_key
from agentrl.trainer.skilled_base import skilled_model_dir

FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skill", default="calculator")
    parser.add_argument("--size", default="1m")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fresh", action="store_true", help="build into a new temporary cache, not reusing a cached build")
    args = parser.parse_args()

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="agentrl-skilled-") as scratch:
        built = skilled_model_dir(args.skill, args.size, args.seed, cache_root=scratch if args.fresh else None)
        out = SHIPPED_MODELS / f"{args.size}-seed{args.seed}-{args.skill}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        for name in FILES:
            shutil.copy(built / name, out / name)
    key = skill_recipe_key(args.skill, args.size, args.seed)
    (out / "recipe.json").write_text(json.dumps({"skill": args.skill, "size": args.size, "seed": args.seed, "key": key}, indent=1) + "\n")
    digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    print(json.dumps({"folder": str(out), "key": key, "weights_sha256": digest, "seconds": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    main()
