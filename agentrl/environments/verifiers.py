"""verifiers environments (the 0.3 API that Environments Hub packages are written against).

A verifiers environment is a module whose ``load_environment(**args)`` returns a
``vf.Environment`` (``SingleTurnEnv``, ``MultiTurnEnv``, ``ToolEnv``, ``StatefulToolEnv``, ...):
a dataset of rows, its own rollout code that drives the model through an OpenAI client, and a
``Rubric`` of weighted reward functions. agentrl runs that code unchanged
(``agent_loops/verifiers_env.py``): its client talks to agentrl's OpenAI-compatible endpoint,
one session per trajectory, so the trajectory is the engine's tokens as sampled.

This module finds and builds the environment (``load``, one per process and ref), turns its
dataset into agentrl rows (``rows``, ``write_rows``: ``python -m agentrl.environments.verifiers``)
and a row back into the ``RolloutInput`` verifiers expects (``rollout_input``). verifiers is
imported here only when a run names it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import threading
from pathlib import Path
from typing import Any, Iterator, Sequence

from agentrl.data.row import EnvironmentRef, Row
from agentrl.environments.spec import cached, resolve
from agentrl.errors import DataError, PluginError

__all__ = ["SUPPORTED", "INPUT_KEY", "load", "rows", "dataset_rows", "write_rows", "rollout_input", "data_source",
           "final_messages"]

SUPPORTED = "0.3.1"  # the verifiers version this adapter is tested against (agentrl[verifiers] pins it)
INPUT_KEY = "verifiers_input"  # extra_info key: the environment's own row (JSON text), handed back to its rollout
_signal_lock = threading.Lock()


def _verifiers() -> Any:
    try:
        import verifiers as vf
    except ImportError as exc:
        raise PluginError(f"verifiers is not installed ({exc}): pip install 'agentrl[verifiers]' "
                          f"(verifiers=={SUPPORTED})") from exc
    return vf


@contextlib.contextmanager
def _without_signal_handlers() -> Iterator[None]:
    """verifiers' ``Environment.__init__`` installs SIGINT and SIGTERM handlers (its teardown,
    then ``exit``), which would replace the trainer's own, and fails off the main thread (the
    asynchronous rollout's). The environment is built with ``signal.signal`` skipped; its
    teardown still runs at exit (verifiers registers it with ``atexit`` too)."""
    with _signal_lock:
        original = signal.signal
        signal.signal = lambda signum, handler: signal.getsignal(signum)  # type: ignore[assignment]
        try:
            yield
        finally:
            signal.signal = original


def _build(ref: EnvironmentRef) -> Any:
    vf = _verifiers()
    target = resolve(ref)
    if isinstance(target, vf.Environment):
        if ref.args:
            raise PluginError(f"verifiers environment {ref.name!r} names an Environment object: it takes no args "
                              f"(got {sorted(ref.args)}); name its module or its load_environment instead")
        return target
    make = target if callable(target) else getattr(target, "load_environment", None)
    if not callable(make):
        raise PluginError(f"verifiers environment {ref.name!r}: {getattr(target, '__name__', target)!r} has no "
                          "load_environment(**args) (name the module that defines it, or module:function)")
    try:
        with _without_signal_handlers():
            env = make(**ref.args)
    except Exception as exc:
        raise PluginError(f"verifiers environment {ref.name!r}: load_environment(**{ref.args!r}) raised "
                          f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(env, vf.Environment):
        raise PluginError(f"verifiers environment {ref.name!r}: load_environment returned {type(env).__name__}, "
                          "not a verifiers Environment")
    return env


def load(ref: EnvironmentRef) -> Any:
    """The ``vf.Environment`` that ``ref`` names, built once per process for each (name, args)."""
    if ref.library != "verifiers":
        raise PluginError(f"the verifiers adapter was given a {ref.library} environment ({ref.name!r})")
    return cached(ref, _build)


def data_source(ref: EnvironmentRef) -> str:
    """The data source of an environment's rows (metrics are split by it): ``verifiers/<name>``."""
    return f"verifiers/{ref.name}"


def _message(raw: Any, where: str) -> dict[str, Any]:
    if hasattr(raw, "model_dump"):
        raw = raw.model_dump()
    if not isinstance(raw, dict) or not isinstance(raw.get("role"), str):
        raise DataError(f"{where}: a message with a role is required, got {raw!r}"[:300])
    content = raw.get("content")
    if isinstance(content, list):  # text parts only: agentrl's rows hold text
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise DataError(f"{where}.content: only text parts can become an agentrl row (found "
                            f"{sorted({str(p.get('type')) if isinstance(p, dict) else type(p).__name__ for p in content})})")
        content = "".join(str(p.get("text", "")) for p in content)
    message: dict[str, Any] = {"role": raw["role"], "content": "" if content is None else str(content)}
    if raw.get("tool_calls"):
        message["tool_calls"] = raw["tool_calls"]
    for key in ("tool_call_id", "name"):
        if raw.get(key):
            message[key] = raw[key]
    return message


def rows(ref: EnvironmentRef, *, split: str = "train", limit: int | None = None) -> list[dict[str, Any]]:
    """The environment's dataset (``split="train"``) or eval dataset (``"eval"``; none: ``[]``)
    as agentrl rows: the prompt messages, ``answer`` as the ground truth, the environment ref in
    ``extra_info.environment`` and the whole verifiers row in ``extra_info.verifiers_input``
    (its rollout gets it back unchanged)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', not {split!r}")
    env = load(ref)
    dataset = env.build_dataset() if split == "train" else env.build_eval_dataset()
    if dataset is None:
        return []
    records = dataset.to_list() if limit is None else dataset.select(range(min(limit, len(dataset)))).to_list()
    out = []
    for i, record in enumerate(records):
        where = f"verifiers environment {ref.name!r} {split} row {i}"
        prompt = record.get("prompt")
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if not isinstance(prompt, list) or not prompt:
            raise DataError(f"{where}: prompt must be a non-empty list of messages")
        answer = record.get("answer")
        out.append({
            "data_source": data_source(ref),
            "prompt": [_message(m, f"{where} prompt[{j}]") for j, m in enumerate(prompt)],
            "reward_model": {"style": "rule", "ground_truth": None if answer is None else str(answer)},
            "extra_info": {"index": i, "split": split, "environment": ref.model_dump(),
                           INPUT_KEY: json.dumps(record, ensure_ascii=False, default=str)},
        })
    return out


def dataset_rows(ref: EnvironmentRef, split: str) -> list[dict[str, Any]]:
    """``rows`` of a split (``train``: the dataset, ``eval``: the eval dataset): what
    ``agentrl train`` trains and validates on when the config names the environment and no
    data files (``agentrl.data.prepare.prepare_data``)."""
    return rows(ref, split=split)


def write_rows(ref: EnvironmentRef, path: str | Path, *, split: str = "train", limit: int | None = None) -> Path:
    """``rows`` written to a parquet file (``agentrl.write_rows``): data files for a run that
    mixes this environment with others, or with agentrl's own rows."""
    from agentrl.data.io import write_rows as write

    found = rows(ref, split=split, limit=limit)
    if not found:
        raise DataError(f"verifiers environment {ref.name!r} has no {split} dataset")
    return write(found, path)


def rollout_input(row: Row, *, example_id: int) -> dict[str, Any]:
    """The verifiers ``RolloutInput`` of a row: the environment's own row when the row came from
    ``rows`` (``extra_info.verifiers_input``), else one made from an agentrl row (its prompt, its
    ground truth as ``answer``, ``extra_info.verifiers_info`` as ``info``)."""
    extra = row.extra_info.model_dump()
    stored = extra.get(INPUT_KEY)
    if stored is not None:
        record = json.loads(stored) if isinstance(stored, str) else dict(stored)
        record.setdefault("example_id", example_id)
        return record
    return {"prompt": row.messages(), "answer": row.ground_truth or "", "info": extra.get("verifiers_info") or {},
            "example_id": example_id}


def final_messages(state: Any) -> list[dict[str, Any]]:
    """The environment's final reply, as agentrl messages: what its ``env_response`` set as
    ``state["final_env_response"]`` when it ended the episode ("correct"), which verifiers' own
    completion ends with and no model call ever read; [] when it set none."""
    found = state.get("final_env_response") if state is not None else None
    if not found:
        return []
    return [_message(m, f"final_env_response[{i}]") for i, m in enumerate(found if isinstance(found, list) else [found])]


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m agentrl.environments.verifiers NAME OUT.parquet [--args JSON] [--split eval]``."""
    parser = argparse.ArgumentParser(prog="python -m agentrl.environments.verifiers",
                                     description="Write a verifiers environment's dataset as agentrl rows (parquet).")
    parser.add_argument("name", help="the environment: an entry point in agentrl.environments, pkg.mod, pkg.mod:attr "
                                      "or verifiers' own id (vf-calc-tool: the module vf_calc_tool)")
    parser.add_argument("out", help="the parquet file to write")
    parser.add_argument("--args", default="{}", help="load_environment's keyword arguments, as a JSON object")
    parser.add_argument("--split", choices=("train", "eval"), default="train")
    parser.add_argument("--limit", type=int, default=None, help="the first N rows only")
    ns = parser.parse_args(argv)
    ref = EnvironmentRef(library="verifiers", name=ns.name, args=json.loads(ns.args))
    path = write_rows(ref, ns.out, split=ns.split, limit=ns.limit)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
