"""``agentrl rollout [overrides]``: run the agent loops over a dataset and store the trajectories.

Uses the ``rollout`` config (``configs/rollout.yaml``): rows from ``data.train_files`` (or the
built-in ``data.task``), the model from ``model.path`` (or the tiny model), the built-in engine,
``rollout.n`` samples per row. Trajectories are written as parquet in the rollout store format
(token ids, masks, logprobs, turn spans, messages, tool calls, rewards, turn rewards, metrics,
policy version) under ``<runs_root>/<run_name>/rollouts``, with a progress bar; the last
printed line is ``rollouts: <path>``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter

from agentrl.config import load_config

__all__ = ["cli_main"]


def cli_main(argv: list[str]) -> int:
    from transformers import AutoTokenizer

    from agentrl.agent.runner import LoopTable, RolloutRunner, build_context
    from agentrl.agent.setup import RolloutSetup
    from agentrl.data.dataset import RowDataset
    from agentrl.engines.builtin import BuiltinEngine
    from agentrl.plugins import PluginRegistry
    from agentrl.trainer.run import _to_yaml, make_run_dir, prepare_data, require_builtin_engine, resolve_model
    from agentrl.replay.store import RolloutStore

    cfg = load_config("rollout", argv)
    require_builtin_engine(cfg)
    run_dir = make_run_dir(cfg)
    (run_dir / "config.yaml").write_text(_to_yaml(cfg))  # replay finds the tokenizer and loops here
    files, _ = prepare_data(cfg, run_dir)  # validated before any generation
    dataset = RowDataset(files, batch_size=1, shuffle=False, seed=cfg.data.seed, drop_last=False)
    rows = [dataset.row(i) for i in range(dataset.num_rows)]
    model_path = resolve_model(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    started = time.perf_counter()
    engine = BuiltinEngine(model_path, max_batch_size=cfg.engine.max_batch_size, seed=cfg.trainer.seed)
    try:
        setup = RolloutSetup.from_config(cfg)
        ctx = build_context(engine, tokenizer, setup)
        runner = RolloutRunner(ctx, LoopTable(setup.default_loop, PluginRegistry(setup.plugin_prefer)), max_concurrency=setup.max_concurrency)
        trajectories = asyncio.run(runner.run(rows, n=cfg.rollout.n, seed=cfg.trainer.seed, progress=cfg.logging.progress and "rollout"))
    finally:
        engine.close()
    path = RolloutStore(run_dir / "rollouts").write_step(0, trajectories, rows=rows)
    finishes = Counter(t.finish_reason for t in trajectories)
    summary = {
        "trajectories": len(trajectories),
        "reward_mean": sum(t.reward for t in trajectories) / max(len(trajectories), 1),
        "finish_reasons": dict(finishes),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    print(f"rollouts: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(sys.argv[1:]))
