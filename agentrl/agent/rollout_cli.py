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

from agentrl.config import TrainConfig, load_config

__all__ = ["cli_main", "require_builtin_engine"]


def require_builtin_engine(cfg: TrainConfig) -> None:
    """``train`` and ``rollout`` drive the built-in engine; say so instead of ignoring the setting."""
    from agentrl.errors import ConfigError

    if cfg.engine.backend != "builtin":
        raise ConfigError([("engine.backend", f"{cfg.engine.backend!r} is not wired into agentrl train/rollout yet; "
                            "use engine=builtin (SGLang servers work through agentrl.engines.SGLangEngine in the agent layer)")])
    if cfg.engine.weight_sync == "nccl":
        raise ConfigError([("engine.weight_sync", "nccl is for remote GPU engines, not wired into agentrl train yet; use memory or disk")])


def cli_main(argv: list[str]) -> int:
    from transformers import AutoTokenizer

    from agentrl.agent.families import require_exact_template
    from agentrl.agent.outcomes import summarize_finishes
    from agentrl.agent.runner import LoopTable, RolloutRunner, build_context
    from agentrl.agent.setup import RolloutSetup
    from agentrl.data.dataset import RowDataset
    from agentrl.data.prepare import prepare_data
    from agentrl.data.rollout_store import RolloutStore
    from agentrl.engines.builtin import BuiltinEngine
    from agentrl.plugins import PluginRegistry
    from agentrl.rundir import make_run_dir
    from agentrl.tiny import resolve_model

    cfg = load_config("rollout", argv)
    require_builtin_engine(cfg)
    run = make_run_dir(cfg)
    run.write_config(cfg)  # replay finds the tokenizer and loops here
    files, _ = prepare_data(cfg, run.data)  # validated before any generation
    dataset = RowDataset(files, batch_size=1, shuffle=False, seed=cfg.data.seed, drop_last=False)
    rows = [dataset.row(i) for i in range(dataset.num_rows)]
    model_path = resolve_model(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    require_exact_template(tokenizer, cfg, model_path)  # token drift stops the rollout before the engine loads
    started = time.perf_counter()
    engine = BuiltinEngine(model_path, max_batch_size=cfg.engine.max_batch_size, seed=cfg.trainer.seed)
    try:
        setup = RolloutSetup.from_config(cfg)
        ctx = build_context(engine, tokenizer, setup)
        runner = RolloutRunner(ctx, LoopTable(setup.default_loop, PluginRegistry(setup.plugin_prefer)), max_concurrency=setup.max_concurrency)
        trajectories = asyncio.run(runner.run(rows, n=cfg.rollout.n, seed=cfg.trainer.seed, progress=cfg.logging.progress and "rollout"))
    finally:
        engine.close()
    path = RolloutStore(run.rollouts).write_step(0, trajectories, rows=rows)  # kept whatever happened
    finishes = summarize_finishes(trajectories)
    summary = {
        "trajectories": len(trajectories),
        "reward_mean": sum(t.reward for t in trajectories) / max(len(trajectories), 1),
        "finish_reasons": finishes.counts,
        "failed_fraction": round(finishes.failed_fraction, 4),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    run.write_summary(summary)
    print(json.dumps(summary, indent=2))
    for line in finishes.lines():
        print(line, file=sys.stderr)
    print(f"rollouts: {path}")
    if finishes.exceeds(cfg.rollout.max_failure_rate):
        print(f"agentrl rollout: {finishes.failed} of {finishes.total} trajectories failed, more than "
              f"rollout.max_failure_rate = {cfg.rollout.max_failure_rate:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(sys.argv[1:]))
