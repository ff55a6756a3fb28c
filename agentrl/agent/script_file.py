"""Script files for ``engine=scripted``: a loop smoke-tested from the command line, no model.

``agentrl rollout engine=scripted engine.script=answers.jsonl`` answers every generate call of a
trajectory from the script's line for its row. One JSON object per line::

    {"row": "arith:0", "answers": ["<tool_call>\\n{\\"name\\": \\"calculator\\", ...}\\n</tool_call>", "#### 4"]}
    {"row": "arith:1", "answers": ["#### 7"]}

``row`` is the row id the rollout store shows (``agentrl replay show``); each answer is text (the
chat template's end-of-turn token is appended, as a model stopping there returns it) or a list of
token ids (returned as is); the n samples of a row all walk the same list. Blank lines and lines
starting with ``#`` are skipped. A bad line is refused with the file and line number, and a
dataset row without a line is refused before any trajectory runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from agentrl.errors import ConfigError

__all__ = ["load_script", "require_script_rows"]

Answers = list["str | list[int]"]


def load_script(path: str | Path) -> dict[str, Answers]:
    """The script of ``path`` as {row id: answers}; ConfigError naming file and line when malformed."""
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise ConfigError([("engine.script", f"{file}: cannot read the script file ({exc.strerror or exc})")]) from None
    script: dict[str, Answers] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{file}:{number}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError([("engine.script", f"{where}: not JSON ({exc.msg} at column {exc.colno})")]) from None
        if not isinstance(entry, dict) or set(entry) != {"row", "answers"}:
            keys = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
            raise ConfigError([("engine.script", f"{where}: a line is an object with exactly the keys row and answers, got {keys}")])
        row, answers = entry["row"], entry["answers"]
        if not isinstance(row, str) or not row:
            raise ConfigError([("engine.script", f"{where}: row must be a non-empty string (a row id), got {row!r}")])
        if not isinstance(answers, list) or not answers:
            raise ConfigError([("engine.script", f"{where}: answers must be a non-empty list, got {answers!r}")])
        for i, answer in enumerate(answers):
            token_ids = isinstance(answer, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in answer)
            if not isinstance(answer, str) and not token_ids:
                raise ConfigError([("engine.script", f"{where}: answers[{i}] must be text or a list of token ids, got {answer!r}")])
        if row in script:
            raise ConfigError([("engine.script", f"{where}: row {row!r} is scripted twice")])
        script[row] = answers
    if not script:
        raise ConfigError([("engine.script", f"{file}: the script has no lines")])
    return script


def require_script_rows(script: dict[str, Answers], row_ids: Iterable[str], path: str | Path) -> None:
    """Refuse, before any trajectory runs, dataset rows the script does not answer."""
    missing = [row for row in row_ids if row not in script]
    if missing:
        shown = ", ".join(repr(r) for r in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ConfigError([("engine.script", f"{path}: no line for the dataset rows {shown}")])
