"""``agentrl rollout [overrides]``: run the agent loops over a dataset and store the trajectories.

Uses the ``rollout`` config (``configs/rollout.yaml``): rows from ``data.train_files``, else the
configured environment's own rows (``environment.library=verifiers environment.name=X``: its
eval dataset when it has one, else its dataset; the console says which), else the built-in
``data.task``; the model from ``model.path`` (or the tiny model), the engine of
``engine.backend`` (the built-in engine in this process, or SGLang servers: ``engine=sglang``
starts ``engine.num_servers`` of them for this command and stops them at its end, or uses
``engine.servers=[url,...]``; ``engine=scripted engine.script=FILE`` answers from a script, no model), ``rollout.n`` samples per row. Trajectories are written as parquet in the rollout store format
(token ids, masks, logprobs, turn spans, messages, tool calls, rewards, turn rewards, metrics,
policy version) under ``<runs_root>/<run_name>/rollouts``, with a progress bar; the last
printed line is ``rollouts: <path>``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from agentrl.config import load_config

__all__ = ["cli_main"]


def cli_main(argv: list[str]) -> int:
    from transformers import AutoTokenizer

    from agentrl.agent.families import require_exact_template
    from agentrl.agent.outcomes import summarize_finishes
    from agentrl.agent.runner import LoopTable, RolloutRunner, build_context
    from agentrl.agent.setup import RolloutSetup
    from agentrl.data.dataset import RowDataset
    from agentrl.data.prepare import environment_dataset, prepare_data
    from agentrl.data.rollout_store import RolloutStore
    from agentrl.engines.builtin import BuiltinEngine
    from agentrl.engines.managed import ManagedServers, check_engine_config
    from agentrl.engines.sglang import SGLangEngine
    from agentrl.plugins import PluginRegistry
    from agentrl.rundir import make_run_dir
    from agentrl.tiny import resolve_model

    cfg = load_config("rollout", argv, training=False)  # trains nothing: training's batch relations are not checked
    check_engine_config(cfg, training=False)
    run = make_run_dir(cfg)
    run.write_config(cfg)  # replay finds the tokenizer and loops here
    # the rows train would take, the environment's eval dataset first; validated before any generation
    own = environment_dataset(cfg) if not cfg.data.train_files else None
    files, _ = prepare_data(cfg, run.data, environment_rows=own, evaluate=True)
    dataset = RowDataset(files, batch_size=1, shuffle=False, seed=cfg.data.seed, drop_last=False)
    rows = [dataset.row(i) for i in range(dataset.num_rows)]
    if own is not None and rows and rows[0][1].extra_info.environment is not None:  # not the data.task fallback
        which = "eval dataset" if Path(files[0]).stem == "eval" else "dataset (it has no eval dataset)"
        print(f"rows: {len(rows)} from the {which} of the {cfg.environment.library} environment {cfg.environment.name!r}",
              file=sys.stderr)
    script = None
    if cfg.engine.backend == "scripted":
        from agentrl.agent.script_file import load_script, require_script_rows

        assert cfg.engine.script is not None  # check_engine_config refused a scripted engine without one
        script = load_script(cfg.engine.script)
        require_script_rows(script, (row_id for row_id, _ in rows), cfg.engine.script)
    model_path = resolve_model(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    require_exact_template(tokenizer, cfg, model_path)  # token drift stops the rollout before the engine loads
    started = time.perf_counter()
    servers = None
    if cfg.engine.backend == "sglang" and not cfg.engine.servers:
        servers = ManagedServers.from_config(cfg, model_path, log_dir=run.path / "servers").start()
    try:
        setup = RolloutSetup.from_config(cfg, server_urls=tuple(servers.urls) if servers is not None else (),
                                         api_key=servers.api_key if servers is not None else None)

        builtin = BuiltinEngine(model_path, max_batch_size=setup.engine_max_batch_size, seed=setup.seed,
                                decode_graphs=setup.engine_decode_graphs) if setup.engine_backend == "builtin" else None

        async def generate():
            # SGLangEngine's HTTP clients belong to the event loop they are created on: this one
            if script is not None:
                from agentrl.agent.scripted import ScriptedEngine

                engine: Any = ScriptedEngine(tokenizer, script, record_requests=False)
            else:
                engine = builtin or SGLangEngine(setup.server_urls, timeout_s=setup.request_timeout_s, max_retries=setup.max_retries,
                                             api_key=setup.api_key)  # None: $AGENTRL_API_KEY
            try:
                ctx = build_context(engine, tokenizer, setup)
                runner = RolloutRunner(ctx, LoopTable(setup.default_loop, PluginRegistry(setup.plugin_prefer)),
                                       max_concurrency=setup.max_concurrency)
                return await runner.run(rows, n=cfg.rollout.n, seed=cfg.trainer.seed, progress=cfg.logging.progress and "rollout")
            finally:
                if builtin is None and script is None:
                    await engine.aclose()

        try:
            trajectories = asyncio.run(generate())
        finally:
            if builtin is not None:
                builtin.close()
    finally:
        if servers is not None:
            servers.stop()
    path = RolloutStore(run.rollouts).write_step(0, trajectories, rows=rows)  # kept whatever happened
    finishes = summarize_finishes(trajectories)
    summary = {
        "trajectories": len(trajectories),
        "reward_mean": sum(t.reward for t in trajectories) / max(len(trajectories), 1),
        "finish_reasons": finishes.counts,
        "failed_fraction": round(finishes.failed_fraction, 4),  # infrastructure failures (outcomes.FAILED)
        "program_error_fraction": round(finishes.counts.get("program_error", 0) / max(finishes.total, 1), 4),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    run.write_summary(summary)
    print(json.dumps(summary, indent=2))
    for line in finishes.lines():
        print(line, file=sys.stderr)
    print(f"rollouts: {path}")
    if (failed := finishes.verdict(cfg.rollout.max_failure_rate)) is not None:
        print(f"agentrl rollout: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(sys.argv[1:]))
