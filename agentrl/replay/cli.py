"""``agentrl replay``: show, report, re-score, re-train and re-run stored rollouts.

    agentrl replay show    DIR [filters] [--limit N] [--tokenizer PATH]
    agentrl replay report  DIR [--output FILE] [filters] [--samples N] [--tokenizer PATH]    (FILE: DIR's report.html)
    agentrl replay rescore DIR --reward NAME --output NEWDIR [--format-score F] [--tool-weight W ...] [filters]
    agentrl replay train   DIR [--split S] [--step A:B] [--max-ratio 2.0] [--epochs N] [--include-dropped] [--output OUT] [key=value ...]
    agentrl replay rerun   DIR [filters] [--limit N] [--config YAML] [--tokenizer PATH] [key=value ...]

``DIR`` is a rollout store, or a run directory holding one in ``rollouts/``. Filters:
``--split S``, ``--step A:B`` (A <= step < B; ``--step 3`` is step 3 alone; either end may be
left out), ``--data-source X``, ``--finish-reason F`` (both repeatable), ``--min-reward R``,
``--max-reward R``.

Text needs the model's tokenizer: ``--tokenizer PATH``, else the one of the run's
``config.yaml`` (next to the store, or in its parent); without either, token ids are shown.
``rerun`` and ``train`` take ``key=value`` overrides of the config (for ``rerun``, on top of
the run's ``config.yaml`` when there is one, else of the ``rollout`` preset). ``rerun`` exits
with 1 when any trajectory differs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from agentrl.agent.call_stats import describe as describe_parse_rate
from agentrl.errors import AgentrlError, ConfigError, DataError
from agentrl.rundir import RunDir
from agentrl.data.rollout_store import RolloutStore, StoredTrajectory, TrajectoryFilter
from agentrl.trajectory import NO_VERSION, Trajectory, TrajectoryFinish

__all__ = ["cli_main", "open_store", "parse_steps", "format_trajectory", "metrics_by_step"]

Decode = Callable[[list[int]], str]


# ----------------------------------------------------------------------------- shared helpers


def open_store(path: str | Path) -> RolloutStore:
    """The store at ``path``, or in ``path/rollouts`` when ``path`` is a run directory."""
    path = Path(path)
    if not path.is_dir():
        raise DataError("not a directory", file=str(path))
    if not any(path.glob("*.parquet")) and RunDir(path).rollouts.is_dir():
        path = RunDir(path).rollouts
    return RolloutStore(path)


def parse_steps(text: str | None) -> tuple[int | None, int | None] | None:
    """``"3"`` -> (3, 4); ``"2:5"`` -> (2, 5); ``":5"`` / ``"2:"`` leave an end open."""
    if text is None:
        return None
    try:
        if ":" not in text:
            step = int(text)
            return step, step + 1
        first, stop = text.split(":", 1)
        return (int(first) if first else None, int(stop) if stop else None)
    except ValueError:
        raise ConfigError([("--step", f"expected A:B, A: , :B or a step number, got {text!r}")]) from None


def _filter(args: argparse.Namespace) -> TrajectoryFilter:
    return TrajectoryFilter(
        split=args.split, steps=parse_steps(args.step), data_source=args.data_source or None,
        finish_reason=args.finish_reason or None, min_reward=args.min_reward, max_reward=args.max_reward,
    )


def _add_filters(p: argparse.ArgumentParser) -> None:
    p.add_argument("--split", help="train, val, ... (default: every split)")
    p.add_argument("--step", help="A:B (A <= step < B), A:, :B or one step")
    p.add_argument("--data-source", action="append", help="keep this data source (repeatable)")
    p.add_argument("--finish-reason", action="append", choices=[r.value for r in TrajectoryFinish], metavar="F",
                   help=f"keep this finish reason (repeatable): {', '.join(r.value for r in TrajectoryFinish)}")
    p.add_argument("--min-reward", type=float)
    p.add_argument("--max-reward", type=float)


def _run_config_path(store: RolloutStore) -> Path | None:
    for candidate in (RunDir(store.root).config, RunDir(store.root.parent).config):
        if candidate.is_file():
            return candidate
    return None


def _config_from(store: RolloutStore, config: str | None, overrides: Sequence[str], preset: str):
    """The run's config (``config.yaml`` beside the store, or ``config``) with overrides, else the
    preset; for commands that train nothing (rerun, the tokenizer of show), so training's checks
    are left out."""
    from agentrl.config import load_config
    from agentrl.config.loader import validate_config

    path = Path(config) if config else _run_config_path(store)
    if path is None:
        return load_config(preset, overrides, check_files=False, training=False)
    from omegaconf import OmegaConf

    bad = [o for o in overrides if "=" not in o or o.startswith(("+", "~"))]
    if bad:
        raise ConfigError([(o, f"with a run's config ({path}) overrides must be key=value") for o in bad])
    raw = OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_dotlist(list(overrides)))
    return validate_config(OmegaConf.to_container(raw, resolve=True), check_files=False, training=False)


def _tokenizer(store: RolloutStore, explicit: str | None, *, required: bool, cfg=None):
    from transformers import AutoTokenizer

    if explicit:
        from agentrl.tiny import model_dir_arg

        return AutoTokenizer.from_pretrained(model_dir_arg(explicit))
    if cfg is None and _run_config_path(store) is not None:
        cfg = _config_from(store, None, (), "rollout")
    if cfg is None and not required:
        return None
    from agentrl.tiny import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(cfg))


# ----------------------------------------------------------------------------- show


class _Style:
    def __init__(self, color: bool):
        self.color = color

    def __call__(self, text: str, code: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.color and text else text


def split_reasoning(text: str) -> tuple[str, str] | None:
    """(reasoning, answer) of an assistant turn's text that closes a ``<think>`` block, the tags kept
    with the reasoning; None when it has none. The opening tag may be missing: templates such as
    DeepSeek-R1's put ``<think>`` in the generation prompt, so the sampled text only closes it."""
    end = text.find("</think>")
    if end < 0:
        return None
    end += len("</think>")
    while end < len(text) and text[end] == "\n":
        end += 1
    return text[:end], text[end:]


def format_trajectory(s: StoredTrajectory, decode: Decode | None, *, color: bool = False) -> str:
    """A trajectory as terminal text, turn by turn. Sampled text is marked ``│``, observed
    (masked) text ``┆``, line breaks ``↵``; an assistant turn's ``<think>`` block is shown under
    ``reasoning:`` apart from its ``answer:``. With ``color``, observed text is also dimmed."""
    style = _Style(color)
    t = s.trajectory
    sampled = sum(t.response_mask)

    def text(ids: list[int]) -> str:
        return decode(ids) if decode is not None else " ".join(map(str, ids))

    dropped = f" · DROPPED ({s.dropped}): not trained" if s.dropped else ""  # stored beside the step's trained groups
    lines = [
        style(f"═ {s.split} step {s.step} · {t.row_id} #{t.sample_index} · reward {t.reward:g} · finish {t.finish_reason}"
              f"{dropped}", "1"),
        f"  group {t.group_id} · {t.data_source} · loop {t.agent_name} · policy version {t.policy_version}"
        f" · ground truth {t.ground_truth!r}",
        f"  tokens: prompt {len(t.prompt_ids)}, response {len(t.response_ids)} ({sampled} sampled, "
        f"{len(t.response_ids) - sampled} observed)",
    ]
    versions = Counter(v for part in [*t.earlier_segments, t] for v, m in zip(part.token_versions, part.response_mask)
                       if m and v != NO_VERSION)
    if versions:  # stores before schema version 5 kept none
        lines.append("  sampled at weight version: " + ", ".join(f"v{v} ×{k}" for v, k in sorted(versions.items())))
    if (parse_rate := describe_parse_rate(t.metrics)) is not None:  # tool calls parsed / malformed / unparsed turns
        lines.append("  " + parse_rate)

    def block(label: str, ids: list[int], mask: list[int]) -> None:
        lines.append(label)
        kinds = set(mask)
        marker = "│ " if kinds == {1} else "┆ "
        pieces = text(ids).split("\n")  # line breaks shown as ↵, so whitespace tokens stay visible
        for line in [p + "↵" for p in pieces[:-1]] + ([pieces[-1]] if pieces[-1] else []):
            lines.append("    " + marker + (style(line, "2") if kinds != {1} else line))

    position = 0
    for k, turn in enumerate(t.turns):
        if turn.start > position:
            block(style(f"  ── template [{position}, {turn.start}) observed (masked)", "2"), t.response_ids[position : turn.start],
                  t.response_mask[position : turn.start])
        n = turn.end - turn.start
        reward = f" · turn reward {turn.reward:g}" if turn.reward is not None else ""
        if turn.role == "assistant":
            label = style(f"  ── {turn.role} [{turn.start}, {turn.end}) {n} sampled tokens{reward}", "34")
        else:
            label = style(f"  ── {turn.role} [{turn.start}, {turn.end}) {n} observed tokens (masked){reward}", "2")
        ids = t.response_ids[turn.start : turn.end]
        reasoning = split_reasoning(text(ids)) if turn.role == "assistant" and decode is not None else None
        if reasoning is None:
            block(label, ids, t.response_mask[turn.start : turn.end])
        else:  # the tokens stay as sampled; only the display separates thinking from the answer
            lines.append(label)
            for name, part, code in (("reasoning", reasoning[0], "35"), ("answer", reasoning[1], "")):
                lines.append(f"    {name}:")
                pieces = part.split("\n")
                for line in [p + "↵" for p in pieces[:-1]] + ([pieces[-1]] if pieces[-1] else []):
                    lines.append("    │ " + (style(line, code) if code else line))
        for c in t.tool_calls:
            if c.turn == k:
                error = style(f" [{c.error}]", "31") if c.error else ""
                call_reward = f" · reward {c.reward:g}" if c.reward is not None else ""
                lines.append(f"    ⮑ call {c.name}({json.dumps(c.arguments)}){error}{call_reward} → {c.result!r}")
        position = turn.end
    if position < len(t.response_ids):
        block(style(f"  ── template [{position}, {len(t.response_ids)}) observed (masked)", "2"), t.response_ids[position:],
              t.response_mask[position:])
    last = t.messages[-1] if t.messages else None
    if last is not None and last.get("role") != "assistant" and t.turns and t.turns[-1].role == "assistant":
        # how the episode ended (an interaction's or environment's final reply): never in the token stream
        lines.append(style(f"  ── {last.get('role')}: the episode's last message, after its last turn (not in the tokens)", "2"))
        lines.append("    ┆ " + style(str(last.get("content") or "").replace("\n", "↵"), "2"))
    if t.finish_reason is TrajectoryFinish.PROGRAM_ERROR:  # the agent program gave up: a scored outcome
        lines.append(style(f"  program error ({t.reward_info.get('exception_type', '?')}): {t.reward_info.get('error', '')}", "31"))
    if t.reward_info:
        lines.append(f"  reward info: {json.dumps(t.reward_info, default=str)}")
    return "\n".join(lines)


def _show(args: argparse.Namespace) -> int:
    store = open_store(args.dir)
    tokenizer = _tokenizer(store, args.tokenizer, required=False)
    decode = tokenizer.decode if tokenizer is not None else None
    if decode is None:
        print("(no tokenizer: showing token ids; pass --tokenizer PATH for text)")
    color = sys.stdout.isatty() and "NO_COLOR" not in os.environ
    shown = 0
    program_errors: Counter[str] = Counter()
    dropped: Counter[str] = Counter()
    parse_counts: Counter[str] = Counter()  # the shown trajectories' parse rate, summed
    for stored in store.iter_stored(_filter(args), limit=args.limit):
        print(format_trajectory(stored, decode, color=color))
        print()
        shown += 1
        parse_counts.update({k: v for k, v in stored.trajectory.metrics.items() if k == "turns" or k.startswith("tool_calls/")})
        if stored.trajectory.finish_reason is TrajectoryFinish.PROGRAM_ERROR:
            program_errors[str(stored.trajectory.reward_info.get("exception_type", "?"))] += 1
        if stored.dropped:
            dropped[stored.dropped] += 1
    if (parse_rate := describe_parse_rate(parse_counts)) is not None:
        print("all shown: " + parse_rate)
    print(f"{shown} {'trajectory' if shown == 1 else 'trajectories'} shown"
          + (f", of which {sum(dropped.values())} of groups dropped untrained ("
             + ", ".join(f"{reason} {n}" for reason, n in dropped.most_common()) + ")" if dropped else ""))
    if program_errors:
        print("program errors by exception type: " + ", ".join(f"{name} {n}" for name, n in program_errors.most_common()))
    return 0


# ----------------------------------------------------------------------------- report


def metrics_by_step(store: RolloutStore, where: TrajectoryFilter | None = None) -> list[dict[str, Any]]:
    """Per-step metrics computed from the stored trajectories (validation keys prefixed
    ``val/``), one step in memory at a time."""
    from agentrl.trainer.step import trajectory_metrics

    where = where or TrajectoryFilter()
    keys = store.read_table(["split", "step"], where)
    pairs = sorted(set(zip(keys.column("split").to_pylist(), keys.column("step").to_pylist())), key=lambda p: (p[1], p[0]))
    rows: dict[int, dict[str, Any]] = {}
    for split, step in pairs:
        one = TrajectoryFilter(split=split, steps=(step, step + 1), data_source=where.data_source,
                               finish_reason=where.finish_reason, min_reward=where.min_reward, max_reward=where.max_reward,
                               dropped=False)  # the groups trained: the step's reward/mean
        trajectories = list(store.iter_trajectories(one))
        prefix = "" if split == "train" else f"{split}/"
        rows.setdefault(step, {"step": step}).update(trajectory_metrics(trajectories, prefix=prefix))
    return [rows[s] for s in sorted(rows)]


def join_run_metrics(rows: list[dict], records: Iterable[dict]) -> list[dict]:
    """The store's per-step figures with the trainer's records (metrics.jsonl) joined in, by step:
    the store's own figures stay; among the trainer's, a later record of a step wins, as in
    report.html (a run resumed before resume set the killed run's rows aside logged such a step
    twice, the killed run's first)."""
    logged: dict[int, dict] = {}
    for record in records:
        logged.setdefault(record["step"], {}).update(record)
    by_step = {r["step"]: dict(r) for r in rows}
    for step, record in logged.items():
        row = by_step.setdefault(step, {"step": step})
        row.update({k: v for k, v in record.items() if k not in row})
    return [by_step[s] for s in sorted(by_step)]


# The trainer's own figures in metrics.jsonl (losses, KL, timings, the engine's): a filtered
# report keeps only these from it, marked as the whole run's; every figure over trajectories
# (reward, success, tool use, finish reasons, ...) is drawn from the filtered ones alone.
WHOLE_RUN_PREFIXES = ("actor/", "critic/", "advantages/", "async/", "balance/", "dynamic_sampling/", "engine/", "health/", "kl",
                      "logprob_mismatch/", "model/", "optimizer/", "perf/", "replay/", "rollout_corr/", "sft/", "startup/", "timing/")


def filter_flags(args: argparse.Namespace) -> str | None:
    """The filters of a command as given on its command line (``--split train --min-reward 0.5``),
    or None when it has none."""
    parts = [f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"
             for flag, value in (("--split", args.split), ("--step", args.step), ("--min-reward", args.min_reward),
                                 ("--max-reward", args.max_reward)) if value is not None]
    parts += [f"{flag} {value}" for flag, values in (("--data-source", args.data_source), ("--finish-reason", args.finish_reason))
              for value in values or []]
    return " ".join(parts) or None


def _report(args: argparse.Namespace) -> int:
    from agentrl.report import render_report

    store = open_store(args.dir)
    where = _filter(args)
    filtered = filter_flags(args)
    rows = metrics_by_step(store, where)
    run = RunDir(store.root.parent)
    whole_run: set[str] = set()
    if run.metrics.is_file():  # a run directory: the trainer's own metrics (losses, KL, mismatch) join in
        records = run.read_metrics()
        if filtered:  # its figures over trajectories are the unfiltered ones: left out
            records = [{k: v for k, v in r.items() if k == "step" or k.startswith(WHOLE_RUN_PREFIXES)} for r in records]
            whole_run = {k for r in records for k in r if k != "step"}
        rows = join_run_metrics(rows, records)
    samples: list[Trajectory] = []
    if rows and args.samples > 0:
        last = max(store.read_table(["step"], where).column("step").to_pylist())
        pick = TrajectoryFilter(split=where.split, steps=(last, last + 1), data_source=where.data_source,
                                finish_reason=where.finish_reason, min_reward=where.min_reward, max_reward=where.max_reward)
        samples = list(store.iter_trajectories(pick, limit=args.samples))
    tokenizer = _tokenizer(store, args.tokenizer, required=False)
    page = render_report(rows, samples, args.title or f"agentrl rollouts · {store.root}",
                         decode=tokenizer.decode if tokenizer is not None else None, filtered=filtered, whole_run_keys=whole_run)
    # default: the run directory's report.html (a store of its own, e.g. rescore's output: its own folder's)
    out = Path(args.output) if args.output else (run.path if store.root == run.rollouts else store.root) / "report.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page)
    print(f"report: {out}")
    return 0


# ----------------------------------------------------------------------------- rescore


def _rescore(args: argparse.Namespace) -> int:
    from agentrl.config.schema import RewardComponents
    from agentrl.replay.rescore import rescore_store

    store = open_store(args.dir)
    components = RewardComponents(score=args.score_weight, tool_calc_reward=args.tool_weight, interaction_score=args.interaction_weight)
    summary = rescore_store(store, RolloutStore(args.output), args.reward, format_score=args.format_score, where=_filter(args),
                            components=components)
    print(json.dumps(summary.as_dict(), indent=2))
    print(f"rescored store: {args.output}")
    return 0


# ----------------------------------------------------------------------------- train


def _train(args: argparse.Namespace) -> int:
    from agentrl.config import load_config
    from agentrl.replay.train import train_from_store
    from agentrl.rundir import make_run_dir

    store = open_store(args.dir)
    cfg = load_config("train", args.overrides)
    out = Path(args.output) if args.output else make_run_dir(cfg).path
    summary = train_from_store(store, cfg, out, split=args.split, steps=parse_steps(args.step), max_ratio=args.max_ratio,
                               epochs=args.epochs, include_dropped=args.include_dropped)
    print(json.dumps(summary, indent=2))
    print(f"run directory: {out}")
    return 0


# ----------------------------------------------------------------------------- rerun


def _rerun(args: argparse.Namespace) -> int:
    from agentrl.agent.runner import LoopTable, build_context
    from agentrl.agent.setup import RolloutSetup
    from agentrl.replay.rerun import group_companions, rerun_trajectories

    store = open_store(args.dir)
    cfg = _config_from(store, args.config, args.overrides, "rollout")
    records = list(store.iter_stored(_filter(args), limit=args.limit))
    tokenizer = _tokenizer(store, args.tokenizer, required=True, cfg=cfg)
    tool_names = sorted({name for r in records if r.row is not None for name in r.row.extra_info.tools_kwargs} | set(cfg.agent.tool_config))
    # the engine is ReplayEngine, set per wave by rerun_trajectories()
    ctx = build_context(None, tokenizer, RolloutSetup.from_config(cfg), tool_names=tool_names or None)  # type: ignore[arg-type]
    differing: Counter[str] = Counter()

    def report(result) -> None:
        if result.matches:
            return
        s = result.stored
        n = len(result.differences)
        print(f"{s.split} step {s.step} · {s.session_id}: {n} difference{'' if n == 1 else 's'}")
        for d in result.differences:
            differing[d.kind] += 1
            print(f"  [{d.kind}] {d.detail}")

    loops = LoopTable(cfg.agent.default_loop)
    # a group judged together is re-run whole, however much of it the filters selected
    companions = group_companions(store, records, loops)
    results = asyncio.run(rerun_trajectories(records, ctx, loops, max_concurrency=cfg.rollout.max_concurrency,
                                             decode=tokenizer.decode, on_result=report, companions=companions))
    bad = sum(1 for r in results if not r.matches)
    print(json.dumps({"trajectories": len(results), "matching": len(results) - bad, "differing": bad,
                      "differences_by_kind": dict(differing)}, indent=2))
    return 1 if bad else 0


# ----------------------------------------------------------------------------- entry point


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentrl replay", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("show", help="trajectories turn by turn in the terminal")
    p.add_argument("dir")
    _add_filters(p)
    p.add_argument("--limit", type=int, default=10, help="at most this many trajectories (default 10)")
    p.add_argument("--tokenizer", help="a tokenizer directory, or tiny[:SIZE] (the built-in tiny model)")
    p.set_defaults(run=_show)

    p = sub.add_parser("report", help="a static HTML report")
    p.add_argument("dir")
    p.add_argument("--output", help="the HTML file (default: report.html in the run directory, replacing the one training wrote)")
    _add_filters(p)
    p.add_argument("--samples", type=int, default=6, help="sample trajectories from the last step (default 6)")
    p.add_argument("--title")
    p.add_argument("--tokenizer", help="a tokenizer directory, or tiny[:SIZE] (the built-in tiny model)")
    p.set_defaults(run=_report)

    p = sub.add_parser("rescore", help="recompute trajectory rewards into a new store")
    p.add_argument("dir")
    p.add_argument("--reward", required=True, help="a reward plugin (agentrl.rewards), e.g. gsm8k_flexible")
    p.add_argument("--output", required=True)
    p.add_argument("--format-score", type=float, default=0.0)
    # reward.components: the new reward = these weights on the new score and the stored judgements
    p.add_argument("--score-weight", type=float, default=1.0, help="weight of the reward function's score (default 1)")
    p.add_argument("--tool-weight", type=float, default=0.0, help="weight of the stored tool calc_rewards, summed (default 0)")
    p.add_argument("--interaction-weight", type=float, default=0.0, help="weight of the stored interaction score (default 0)")
    _add_filters(p)
    p.set_defaults(run=_rescore)

    p = sub.add_parser("train", help="train from stored trajectories (truncated importance ratios)")
    p.add_argument("dir")
    p.add_argument("--split", default="train")
    p.add_argument("--step")
    p.add_argument("--max-ratio", type=float, default=2.0, help="truncation of the importance ratio (default 2.0)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--include-dropped", action="store_true",
                   help="train the groups the online run stored untrained too (asynchronous runs' stale groups)")
    p.add_argument("--output", help="run directory (default: trainer.runs_root/trainer.run_name)")
    p.add_argument("overrides", nargs="*", help="config overrides key=value (the train preset)")
    p.set_defaults(run=_train)

    p = sub.add_parser("rerun", help="re-run trajectories through their loops; report differing observations")
    p.add_argument("dir")
    _add_filters(p)
    p.add_argument("--limit", type=int)
    p.add_argument("--config", help="a config YAML (default: the run's config.yaml, else the rollout preset)")
    p.add_argument("--tokenizer", help="a tokenizer directory, or tiny[:SIZE] (the built-in tiny model)")
    p.add_argument("overrides", nargs="*", help="config overrides key=value")
    p.set_defaults(run=_rerun)
    return parser


def cli_main(argv: list[str]) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may come before or after options; anything else is a mistake
    unknown = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(args, "overrides")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    try:
        return args.run(args)
    except AgentrlError as exc:
        print(f"agentrl replay {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(cli_main(sys.argv[1:]))
