"""``agentrl data``: prepare and validate datasets.

    agentrl data gsm8k --input FILE --output OUT.parquet --variant V [--strict]   (= python -m data_prep.gsm8k)
    agentrl data tasks --task arith --n 1000 --output-dir DIR                     (= python -m data_prep.tasks)
    agentrl data validate FILE...                                                 (every bad row, then exit 1)
"""

from __future__ import annotations

import sys


def cli_main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("gsm8k", "tasks", "validate"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "gsm8k":
        from agentrl_data_prep.gsm8k import main

        return main(rest)
    if command == "tasks":
        from agentrl_data_prep.tasks import main

        return main(rest)
    from agentrl.agent.runner import check_agent_names
    from agentrl.data.dataset import validate_files
    from agentrl.data.io import count_rows

    if not rest:
        print("usage: agentrl data validate FILE...", file=sys.stderr)
        return 2
    problems = validate_files(rest, check_agent_names=check_agent_names)
    for problem in problems:
        print(problem)
    if problems:
        return 1
    total = sum(count_rows(path) for path in rest)
    print(f"{total} rows in {len(rest)} file(s): all valid")
    return 0
