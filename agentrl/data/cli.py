"""``agentrl data``: prepare and validate datasets.

    agentrl data gsm8k --input FILE --output OUT.parquet --variant V [--strict] [--limit N]   (= python -m data_prep.gsm8k)
    agentrl data tasks --task arith --n 1000 --output-dir DIR                                 (= python -m data_prep.tasks)
    agentrl data validate FILE... [--default-agent NAME] [--reward NAME]                      (every bad row, then exit 1)

``validate`` reads parquet and JSON rows (.jsonl, .json); it also names every row whose agent_name, tools, interaction or
agent program (extra_info.agent_program) is not installed or fails to import, and every row without the ground truth its
reward (``--reward``, the config's reward.default: gsm8k unless you set it) compares the answer with.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["cli_main", "known_agent_names"]


def known_agent_names() -> set[str]:
    """The installed agent loops (entry points) and the aliases that point at one of them."""
    from agentrl.plugins import PluginRegistry

    return PluginRegistry().accepted_names("agent_loops")


def _validate(argv: list[str]) -> int:
    from agentrl.config.schema import AgentConfig, RewardConfig
    from agentrl.data.dataset import counted, validate_files
    from agentrl.data.ground_truth import GroundTruthRule
    from agentrl.data.io import count_rows

    parser = argparse.ArgumentParser(prog="agentrl data validate", description="Check every row of row files.")
    parser.add_argument("files", nargs="+", help="row files: parquet, or JSON rows (.jsonl: one object a line; .json: that or an array)")
    parser.add_argument("--default-agent", default=None, help="the loop that runs rows without agent_name (checked too)")
    parser.add_argument("--reward", default=RewardConfig().default,
                        help=f"the reward that scores the rows: your config's reward.default (default: {RewardConfig().default}); "
                             "rows it cannot score without a ground truth must have one")
    args = parser.parse_args(argv)
    from agentrl.plugins import PluginRegistry

    registry = PluginRegistry()
    rule = GroundTruthRule(RewardConfig(default=args.reward), args.default_agent or AgentConfig().default_loop,
                           declared=registry.names("data_source_rewards"))
    problems = validate_files(
        args.files, known_agent_names=registry.accepted_names("agent_loops"), default_agent=args.default_agent,
        known_tools=registry.names("tools"), known_interactions=registry.names("interactions"),
        import_problem=registry.import_problem, known_agents=registry.names("agents"), ground_truth=rule,
    )
    for problem in problems:
        print(problem)
    if problems:
        return 1
    files = list(dict.fromkeys(args.files))
    total = sum(count_rows(path) for path in files)
    print(f"{counted(total, 'row')} in {counted(len(files), 'file')}: all valid")
    return 0


def cli_main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    if not argv or argv[0] not in ("gsm8k", "tasks", "validate"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "gsm8k":
        from agentrl_data_prep.gsm8k import main

        return main(rest, prog="agentrl data gsm8k")
    if command == "tasks":
        from agentrl_data_prep.tasks import main

        return main(rest)
    return _validate(rest)
