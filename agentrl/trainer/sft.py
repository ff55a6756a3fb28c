"""``agentrl sft``: multi-turn supervised fine-tuning, loss on assistant tokens only.

Conversations are rendered with the model's chat template (with the tools block of the tools
the agent will use, so SFT and RL see the same prompt: ``tool_schemas``); the template's assistant mask
(``{% generation %}``) selects the trained tokens: assistant content, tool calls and the
end-of-turn token; never the system prompt, user turns or tool results. Training runs on the
same FSDP2 actor workers as RL. The quickstart uses the same code for its warm start.

Data: ``sft.train_files`` (parquet with a ``messages`` column, e.g. ``data_prep.gsm8k
--variant sft``), else ``sft.num_demos`` generated demonstrations of ``data.task``.

``agentrl sft`` writes ``metrics.jsonl``, ``checkpoints/final`` (model, optimizer, scheduler),
the policy as a transformers checkpoint in ``policy/``, and with ``trainer.save_freq=N`` one
every N steps in ``policies/step_N`` (each loadable with ``model.path=``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from agentrl.config import TrainConfig, load_config
from agentrl.errors import DataError
from agentrl.rundir import RunDir, make_run_dir
from agentrl.tiny import resolve_model
from agentrl.trainer.batch import TrainBatch, collate_sequences
from agentrl.trainer.logging import MetricsLogger
from agentrl.trainer.step import Group, shards

__all__ = ["tokenize_conversations", "shared_prefix_length", "sft_batches", "run_sft_on_actor", "cli_main"]


def called_tools(conversations: Sequence[list[dict[str, Any]]]) -> dict[str, int]:
    """{tool name: index of the first conversation calling it}, in order of first call: the
    names of the assistant messages' ``tool_calls`` (OpenAI format)."""
    called: dict[str, int] = {}
    for index, messages in enumerate(conversations):
        for message in messages:
            for call in message.get("tool_calls") or () if isinstance(message, dict) else ():
                function = call.get("function") if isinstance(call, dict) else None
                name = function.get("name") if isinstance(function, dict) else None
                if isinstance(name, str):
                    called.setdefault(name, index)
    return called


def tool_schemas(cfg: TrainConfig, conversations: Sequence[list[dict[str, Any]]]) -> list[dict[str, Any]] | None:
    """The tools block SFT renders every demonstration with: RL's tools for rows that name none
    (``agent.tool_config_path``'s and ``agent.tool_config``'s) when some are configured, else the
    tools the demonstrations call themselves (generated ones: also the tools their task's rows
    name); None when there are none. A demonstration calling a
    tool that the configured tools leave out, or that no tool config or plugin defines, is a
    DataError naming its file, row and the tool."""
    from agentrl.config.verl_files import read_tool_config
    from agentrl.plugins import PluginRegistry

    specs = {s.name: s for s in (read_tool_config(cfg.agent.tool_config_path) if cfg.agent.tool_config_path else [])}
    configured = list(dict.fromkeys([*specs, *cfg.agent.tool_config]))
    called = called_tools(conversations)
    own = list(called)
    if not cfg.sft.train_files and cfg.data.task is not None:
        # generated demonstrations: their task's rows name its tools, which RL offers every one of
        # them, whether or not a demonstration calls one
        from agentrl_data_prep.tasks import generate

        own = list(dict.fromkeys([*generate(cfg.data.task, 1, seed=cfg.data.seed)[0]["extra_info"]["tools_kwargs"], *own]))
    registry = PluginRegistry(cfg.plugins.prefer)
    for name, index in called.items():
        if configured and name not in configured:
            raise DataError(f"the demonstration calls tool {name!r}, which the configured tools ({', '.join(configured)}) "
                            "leave out of the tools block: add it to agent.tool_config (or agent.tool_config_path)",
                            **_where(cfg, index))
        if name not in specs and name not in registry.accepted_names("tools"):
            raise DataError(f"the demonstration calls tool {name!r}, which no installed tool plugin provides and "
                            "agent.tool_config_path does not define: its schema is needed for the tools block",
                            **_where(cfg, index))
    schemas = []
    for name in configured or own:
        spec = specs.get(name)
        if spec is None:
            schemas.append(registry.load("tools", name).schema())
        elif spec.schema is not None:
            schemas.append(spec.schema)
        else:  # the YAML names no schema: the tool class's own
            from agentrl.agent.verl_yaml import build_tool

            schemas.append(build_tool(spec, registry).schema())
    return schemas or None


def _where(cfg: TrainConfig, index: int) -> dict[str, Any]:
    """The file and row of conversation ``index`` (``sft.train_files`` in order), or the
    generated demonstration's number."""
    from agentrl.data.io import count_rows

    for path in cfg.sft.train_files:
        rows = count_rows(path)
        if index < rows:
            return {"file": path, "row": index, "field": "messages"}
        index -= rows
    return {"row": index, "field": "messages"}


def tokenize_conversations(
    tokenizer: Any, conversations: Sequence[list[dict[str, Any]]], *, tools: list[dict[str, Any]] | None, max_length: int
) -> list[tuple[list[int], list[int]]]:
    """(ids, assistant mask) per conversation; longer ones are an error, not silently cut."""
    out = []
    for index, messages in enumerate(conversations):
        rendered = tokenizer.apply_chat_template(messages, tools=tools, return_assistant_tokens_mask=True, return_dict=True)
        ids, mask = list(rendered["input_ids"]), list(rendered["assistant_masks"])
        if len(ids) > max_length:
            raise DataError(f"conversation has {len(ids)} tokens, more than sft.max_length = {max_length}", row=index, field="messages")
        if not any(mask):
            raise DataError("conversation has no assistant tokens to train on", row=index, field="messages")
        out.append((ids, mask))
    return out


def shared_prefix_length(examples: Sequence[tuple[list[int], list[int]]]) -> int:
    """Tokens that every example starts with and none trains on (the system prompt and tools
    block that all generated demonstrations share), at least 1 and short of every example's end.

    SFT batches use it as the rows' common 'prompt', which the trainer's shared-prompt forward
    (``prefix.py``) computes once per batch instead of once per row: exact, and on the quickstart's
    demonstrations most of each row's tokens."""
    if not examples:
        return 1
    first_ids = examples[0][0]
    k = len(first_ids)
    for ids, mask in examples:
        k = min(k, len(ids) - 1, mask.index(1) if 1 in mask else len(mask))
        i = 0
        while i < k and ids[i] == first_ids[i]:
            i += 1
        k = i
    return max(1, k)


def sft_batches(examples: Sequence[tuple[list[int], list[int]]], *, batch_size: int, pad_token_id: int, epochs: int, seed: int) -> list[TrainBatch]:
    """Seeded shuffled batches over ``epochs``; the tokens every example shares (at least the
    first) are each row's 'prompt', the rest its 'response' under the assistant mask."""
    k = shared_prefix_length(examples)
    batches = []
    for epoch in range(epochs):
        order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        for start in range(0, len(order) - batch_size + 1, batch_size):
            chosen = [examples[i] for i in order[start : start + batch_size]]
            batches.append(
                collate_sequences(
                    [ids[:k] for ids, _ in chosen], [ids[k:] for ids, _ in chosen], [mask[k:] for _, mask in chosen],
                    pad_token_id=pad_token_id,
                )
            )
    return batches


def _conversations(cfg: TrainConfig) -> tuple[list[list[dict[str, Any]]], list[list[dict[str, Any]]]]:
    """(training conversations, held-out ones for ``sft.stop_at_success``; empty when it is off).

    Generated demonstrations hold out the task's test split, written in the required answer
    format whatever ``sft.informal_rate`` (the check asks for task success, not imitation); from
    ``sft.train_files`` the last ``sft.eval_demos`` conversations are held out (never trained on)."""
    want_heldout = cfg.sft.stop_at_success is not None
    if cfg.sft.train_files:
        from agentrl.data.io import iter_raw_rows

        conversations = []
        for path in cfg.sft.train_files:
            for index, raw in iter_raw_rows(path):
                messages = raw.get("messages")
                if not isinstance(messages, list):
                    raise DataError("missing 'messages' column (a list of chat messages)", file=path, row=index, field="messages")
                conversations.append(messages)
        if not want_heldout:
            return conversations, []
        if len(conversations) <= cfg.sft.eval_demos:
            raise DataError(f"{len(conversations)} conversations leave none to train on after holding out "
                            f"sft.eval_demos = {cfg.sft.eval_demos} for sft.stop_at_success", field="sft.eval_demos")
        return conversations[: -cfg.sft.eval_demos], conversations[-cfg.sft.eval_demos :]
    if cfg.data.task is None:
        raise DataError("SFT needs sft.train_files or a built-in data.task to generate demonstrations")
    from agentrl_data_prep.tasks import sft_conversations

    seed = cfg.data.seed + 17
    heldout = sft_conversations(cfg.data.task, cfg.sft.eval_demos, seed=seed, split="test") if want_heldout else []
    train = sft_conversations(cfg.data.task, cfg.sft.num_demos, seed=seed, informal_rate=cfg.sft.informal_rate,
                                tool_rate=cfg.sft.tool_rate)
    return train, heldout


def run_sft_on_actor(
    actor: Group, cfg: TrainConfig, model_path: str, tokenizer: Any, pad_id: int, log: MetricsLogger, run_dir: Path, *,
    export_every: int = 0, label: str = "agentrl sft: SFT",
) -> dict[str, float]:
    """SFT epochs on an actor worker group; returns the last metrics. With ``export_every`` the
    policy is exported as a transformers checkpoint every that many steps, to
    ``policies/step_N`` in the run directory (loadable with ``model.path=``). ``label`` begins
    the console line that says how many steps are coming."""
    from tqdm.auto import tqdm

    train, heldout = _conversations(cfg)
    tools = tool_schemas(cfg, [*train, *heldout])
    examples = tokenize_conversations(tokenizer, train, tools=tools, max_length=cfg.sft.max_length)
    batches = sft_batches(examples, batch_size=cfg.sft.batch_size, pad_token_id=pad_id, epochs=cfg.sft.epochs, seed=cfg.trainer.seed)
    if not batches:
        raise DataError(f"{len(examples)} demonstrations cannot fill one SFT batch of {cfg.sft.batch_size}")
    W = cfg.actor.world_size
    check_shards = None  # the held-out demonstrations, sharded once for every check
    if heldout:
        check = sft_batches(tokenize_conversations(tokenizer, heldout, tools=tools, max_length=cfg.sft.max_length),
                            batch_size=len(heldout), pad_token_id=pad_id, epochs=1, seed=0)[0]
        check_shards = shards(check, W)
    actor.call_all("reset_optimizer", cfg.sft.optim, len(batches))
    stop_at = cfg.sft.stop_at_success
    early = f"; ends early at held-out greedy success {stop_at:g}" if heldout and stop_at is not None else ""
    log.console(f"{label}: {len(batches)} steps ({len(examples)} demonstrations, batch {cfg.sft.batch_size}, "
                f"{cfg.sft.epochs} epoch{'s' if cfg.sft.epochs != 1 else ''}{early})")
    metrics: dict[str, float] = {}
    bar = tqdm(batches, desc="SFT", unit="step", disable=not cfg.logging.progress)
    for i, batch in enumerate(bar):
        tokens = float(batch.response_mask.sum())
        results = actor.call_sharded("sft_step", shards(batch, W), tokens, cfg.sft.micro_batch_size)
        metrics = {
            "sft/loss": sum(r["sft/loss_sum"] for r in results) / tokens,
            "sft/grad_norm": results[0]["sft/grad_norm"],
            "sft/lr": results[0]["sft/lr"],
            "sft/step": float(i + 1),
        }
        stop = False
        if check_shards is not None and (i + 1) % cfg.sft.eval_every == 0:
            matches = torch.cat(actor.call_sharded("greedy_matches", check_shards, cfg.sft.micro_batch_size))[: len(heldout)]
            metrics["sft/heldout_greedy_success"] = float(matches.mean())
            bar.set_postfix(loss=f"{metrics['sft/loss']:.3f}", heldout=f"{metrics['sft/heldout_greedy_success']:.2f}")
            stop = metrics["sft/heldout_greedy_success"] >= cfg.sft.stop_at_success
        log.log(-(len(batches) - i), metrics)  # SFT steps are logged before RL step 0
        if export_every and (i + 1) % export_every == 0 and i + 1 < len(batches):
            actor.call_all("export_hf", str(RunDir(run_dir).policy_at(i + 1)))
        if stop:
            print(f"SFT: stopped at step {i + 1} of {len(batches)}: held-out greedy success "
                  f"{metrics['sft/heldout_greedy_success']:.2f} >= sft.stop_at_success = {cfg.sft.stop_at_success}", flush=True)
            break
    return metrics


def cli_main(argv: list[str]) -> int:
    from transformers import AutoTokenizer

    from agentrl.trainer.in_process import InProcessGroup, runs_in_process
    from agentrl.trainer.cluster import init_local_ray, threads_per_worker, worker_env
    from agentrl.trainer.groups import WorkerGroup
    from agentrl.trainer.workers import ActorWorker

    cfg = load_config("sft", argv)
    started = time.perf_counter()
    run = make_run_dir(cfg)
    run.write_config(cfg)
    log = MetricsLogger(run.path, cfg.logging)
    model_path = str(resolve_model(cfg))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # one rank: the actor in this process, as agentrl train does (trainer.workers); else Ray actors
    in_process = runs_in_process(cfg)
    started_ray = False if in_process else init_local_ray(cfg.trainer.ship_code)
    Group, resources = (InProcessGroup, {}) if in_process else (WorkerGroup, {"num_cpus": 0.5})
    actor = None
    try:
        actor = Group(
            ActorWorker, world_size=cfg.actor.world_size, env=worker_env(threads_per_worker(cfg)), **resources,
            name="actor", model_path=model_path, config=cfg.actor, total_steps=1, rollout_setup=None,
            share_prompts=cfg.model.share_prompt_forward, device=cfg.trainer.device, seed=cfg.trainer.seed,
        )
        metrics = run_sft_on_actor(actor, cfg, model_path, tokenizer, pad_id, log, run.path, export_every=cfg.trainer.save_freq)
        actor.call_all("save", str(run.checkpoint("final")))
        actor.call_all("export_hf", str(run.policy))
    finally:
        log.close()
        if actor is not None:
            actor.kill()
        if started_ray:
            import ray

            ray.shutdown()
    summary = {"final_loss": metrics.get("sft/loss"), "steps": int(metrics.get("sft/step", 0)), "wall_s": round(time.perf_counter() - started, 1)}
    run.write_summary(summary)
    print(json.dumps(summary, indent=2))
    print(f"run directory: {run.path}")
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(sys.argv[1:]))
