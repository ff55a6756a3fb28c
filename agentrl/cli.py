"""The ``agentrl`` command: thin entry points over the library.

Each subcommand lives in the module that owns its logic and is imported only when called, so
``agentrl plugins list`` does not pay for torch or Ray.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys
import time
from collections.abc import MutableMapping

from agentrl.errors import AgentrlError, NotAvailable

__all__ = ["main", "console_main", "COMMANDS"]

# subcommand -> (module:function taking argv and returning an exit code, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("agentrl.trainer.run:cli_main", "train an agent with RL (no arguments: the quickstart)"),
    "sft": ("agentrl.trainer.sft:cli_main", "supervised fine-tuning on multi-turn chat data"),
    "rollout": ("agentrl.agent.rollout_cli:cli_main", "run agent loops over a dataset and store trajectories"),
    "replay": ("agentrl.replay.cli:cli_main", "show, report, re-score and re-train stored rollouts"),
    "serve": ("agentrl.engines.serve:cli_main", "serve a model over SGLang's native HTTP protocol"),
    "bench": ("agentrl.cli:bench_main", "benchmarks: engine, agent-loop, trainer, forward, lora, export, async, history (JSON output)"),
    "tools": ("agentrl.agent.tools_cli:cli_main", "call a tool once: tools call NAME --arguments JSON"),
    "plugins": ("agentrl.cli:plugins_main", "list installed plugins: plugins list [--json] [--check]"),
    "data": ("agentrl.data.cli:cli_main", "prepare and validate datasets (gsm8k, tasks, validate)"),
    "check-template": ("agentrl.agent.families:cli_main", "check a tokenizer's chat template: token drift, tool calls, stops"),
    "checkpoint": ("agentrl.trainer.checkpoint_io:cli_main", "convert an older (pickle) checkpoint: checkpoint convert DIR"),
}

BENCHMARKS: dict[str, str] = {
    "engine": "agentrl_benchmarks.engine:main",
    "agent-loop": "agentrl_benchmarks.agent_loop:main",
    "trainer": "agentrl_benchmarks.trainer:main",
    "forward": "agentrl_benchmarks.forward:main",
    "lora": "agentrl_benchmarks.lora:main",
    "scaling": "agentrl_benchmarks.scaling:main",
    "export": "agentrl_benchmarks.export:main",
    "async": "agentrl_benchmarks.async_training:main",
    "history": "agentrl_benchmarks.history:main",
}


# commands whose arguments are config overrides: their --help and --cfg job come from the schema
CONFIG_COMMANDS = ("train", "sft", "rollout")


def _resolve(target: str):
    module, _, func = target.partition(":")
    try:
        return getattr(importlib.import_module(module), func)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module.startswith(exc.name):  # the command's own module, not a dependency
            raise NotAvailable(f"this command is not available in agentrl {_version()} ({module} is missing)") from None
        raise


def _version() -> str:
    from agentrl import __version__

    return __version__


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return "usage: agentrl <command> [args...]\n\ncommands:\n" + "\n".join(lines)


def plugins_main(argv: list[str]) -> int:
    import argparse

    from agentrl.plugins import PluginRegistry, discover

    parser = argparse.ArgumentParser(prog="agentrl plugins")
    sub = parser.add_subparsers(dest="action", required=True)
    ls = sub.add_parser("list", help="list plugins declared by installed distributions")
    ls.add_argument("--json", action="store_true", help="print a JSON list of {group, name, target, distribution}")
    ls.add_argument("--group", help="only this group (e.g. tools or agentrl.tools)")
    ls.add_argument("--check", action="store_true", help="import each plugin and report failures")
    args = parser.parse_args(argv)

    specs = discover(args.group)
    errors: dict[tuple[str, str, str | None], str] = {}
    if args.check:
        for spec, error in PluginRegistry().check(args.group):
            if error is not None:
                errors[(spec.group, spec.name, spec.distribution)] = error
    if args.json:
        rows = []
        for spec in specs:
            row = spec.as_dict()
            if args.check:
                row["error"] = errors.get((spec.group, spec.name, spec.distribution))
            rows.append(row)
        print(json.dumps(rows, indent=2))
    else:
        header = ["GROUP", "NAME", "TARGET", "DISTRIBUTION"] + (["CHECK"] if args.check else [])
        table = [header] + [
            [spec.group, spec.name, spec.target, spec.distribution or "?"]
            + (["BROKEN" if (spec.group, spec.name, spec.distribution) in errors else "ok"] if args.check else [])
            for spec in specs
        ]
        widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]  # the last column is not padded
        for row in table:
            print("  ".join([cell.ljust(width) for cell, width in zip(row, widths)] + [row[-1]]))
        for error in errors.values():
            print(error, file=sys.stderr)
    return 1 if errors else 0


def bench_main(argv: list[str]) -> int:
    usage = f"usage: agentrl bench {{{'|'.join(BENCHMARKS)}}} [--json] [...]  (agentrl bench NAME --help for its options)"
    if argv[:1] in (["-h"], ["--help"]):
        print(usage)
        return 0
    if not argv or argv[0] not in BENCHMARKS:
        print(usage, file=sys.stderr)
        return 2
    return int(_resolve(BENCHMARKS[argv[0]])(argv[1:]) or 0)


QUIET_BARS = "HF_HUB_DISABLE_PROGRESS_BARS"
# commands whose process runs torch's OpenMP threads for long: training and rollouts
SPINNING_COMMANDS = ("train", "sft", "rollout", "replay")
# commands whose start-up runs with the garbage collector paused (agentrl.trainer.startup.pause_collector),
# each resuming it when its models are loaded
COLLECTOR_PAUSED_COMMANDS = ("train",)


def busy_cores(window_s: float = 0.1) -> float | None:
    """How many cores the machine's other work keeps busy now: the non-idle share of every CPU's
    time over ``window_s`` (``/proc/stat``), this process sleeping meanwhile. ``None`` where there
    is no ``/proc/stat`` (not Linux)."""

    def times() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
        return sum(fields), fields[3] + fields[4]

    try:
        total0, idle0 = times()
        time.sleep(window_s)
        total1, idle1 = times()
    except (OSError, ValueError, IndexError):
        return None
    total = total1 - total0
    return (total - (idle1 - idle0)) / total * (os.cpu_count() or 1) if total > 0 else None


def shared_machine_wait_policy(environ: MutableMapping[str, str] | None = None, load: float | None = None) -> str | None:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` when the machine is busy as the command starts (other work
    keeps half a core or more busy: ``busy_cores``, or the 1-minute load average where that cannot
    be read; ``load`` given: that figure) and the environment chooses no policy of its own
    (``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``). Why: libgomp's default has a waiting thread spin,
    and on cores shared with another job the spinning threads take the cores the working ones
    need: beside a busy loop a training step is many times slower at the default than passive.
    Idle the spin pays (decode forwards are faster at the default), so an idle machine keeps it
    (the figures: docs/benchmarks.md). Busy *now*, not the load average: that average still counts
    a job which ended a minute ago, and so made a command started just after it passive on a
    machine gone idle. libgomp reads the policy when torch loads: called before any import of
    torch. Returns the policy set, if any."""
    environ = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return None
    if load is None:
        load = busy_cores()
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:  # neither (not a Unix): keep the default
            return None
    if load < 0.5:
        return None
    environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return "PASSIVE"


IMPORTING = ("importing its libraries (torch, transformers; the first run after an install also compiles their "
             "bytecode: a minute or more on a slow or shared machine)")
RESUME_HINT = " (the same command with trainer.resume=auto goes on from the last checkpoint it saved, if it saved one)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "--version":
        from agentrl import __version__

        print(__version__)
        return 0
    if command not in COMMANDS:
        print(f"agentrl: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    # one progress display, agentrl's own: transformers' and the hub's bars (weight loading, shard
    # writing) stay off here and in the workers (worker_env), unless the environment says otherwise
    os.environ.setdefault(QUIET_BARS, "1")
    if command in SPINNING_COMMANDS:
        shared_machine_wait_policy()
    if command in COLLECTOR_PAUSED_COMMANDS:
        from agentrl.trainer.startup import pause_collector

        pause_collector()
    try:
        if command in CONFIG_COMMANDS and ({"-h", "--help", "--cfg"} & set(rest)):
            from agentrl.config.help import config_command_main

            return config_command_main(command, rest, COMMANDS[command][1])
        if command in CONFIG_COMMANDS:  # a sign of life before the imports, the longest wait of a fresh install's first run
            print(f"agentrl {command}: {IMPORTING}", file=sys.stderr, flush=True)
        return int(_resolve(COMMANDS[command][0])(rest) or 0)
    except AgentrlError as exc:
        # Errors agentrl raises on purpose are messages for the user, not tracebacks.
        print(f"agentrl {command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"agentrl {command}: interrupted{RESUME_HINT if command == 'train' else ''}", file=sys.stderr)
        return 130
    finally:
        if command in COLLECTOR_PAUSED_COMMANDS:  # ended before its start-up did (an error): the caller's collector as it was
            from agentrl.trainer.startup import resume_collector

            resume_collector()


def skip_the_last_collection() -> None:
    """Let this process exit without the interpreter's garbage-collection passes over everything
    still alive. After torch and transformers are imported those passes are most of a process's
    exit (measured in docs/benchmarks.md, the trainer's end to end); frozen objects are left to the
    OS, while atexit handlers, finalizers of non-cyclic objects and stream flushes still run.
    Only for a process that is about to end: a long-lived one would never collect what it froze."""
    gc.freeze()


def console_main() -> int:
    """The ``agentrl`` console script: ``main``, then a process that ends at once."""
    from agentrl.engines import preforked

    preforked.allow()  # a fresh process: agentrl train may fork its engine's before computing anything
    code = main()
    skip_the_last_collection()
    return code


if __name__ == "__main__":
    sys.exit(console_main())
