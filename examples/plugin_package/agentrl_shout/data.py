"""Rows of the ``shout/words`` data source: ``python -m agentrl_shout.data OUT.parquet [--rows N] [--loop NAME]``."""

from __future__ import annotations

import argparse

from agentrl import write_rows

WORDS = ["hello", "agent", "tokens", "reward", "policy", "engine", "tool", "turn"]


def rows(n: int, loop: str = "tool_agent") -> list[dict]:
    out = []
    for i in range(n):
        word = WORDS[i % len(WORDS)]
        row = {
            "data_source": "shout/words",
            "prompt": [{"role": "user", "content": f"Say the word {word} in capital letters."}],
            "reward_model": {"style": "rule", "ground_truth": word.upper()},
            "extra_info": {"index": i, "tools_kwargs": {"shout": {}}},
            "agent_name": loop,
        }
        if loop == "tool_agent":
            row["extra_info"]["interaction_kwargs"] = {"name": "loudness"}
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("output")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--loop", default="tool_agent", help="agent_name of every row (tool_agent or shout_twice)")
    args = parser.parse_args(argv)
    write_rows(rows(args.rows, args.loop), args.output)
    print(args.output)


if __name__ == "__main__":
    main()
