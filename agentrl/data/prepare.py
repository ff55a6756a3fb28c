"""A job's data from its config: the training files and the validation rows, all validated
before any compute is spent (every problem reported at once, naming its file, row and field)."""

from __future__ import annotations

import functools
import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from agentrl.data.dataset import counted, file_tags, parse_row, row_uid, validate_files
from agentrl.data.ground_truth import GroundTruthRule
from agentrl.data.io import iter_raw_rows, write_rows
from agentrl.data.row import EnvironmentRef, Row
from agentrl.errors import DataError

if TYPE_CHECKING:
    from agentrl.config.schema import TrainConfig

__all__ = ["prepare_data", "environment_dataset", "EnvironmentRows"]

EnvironmentRows = Callable[[str], list[dict[str, Any]]]  # split ("train" or "eval") -> the environment's rows


def environment_dataset(cfg: "TrainConfig") -> EnvironmentRows | None:
    """The configured environment's own rows by split (``train``, ``eval``), when its library's
    adapter (``agentrl.environments.<library>``) offers ``dataset_rows``: verifiers environments
    carry datasets; OpenEnv servers and TRL classes do not."""
    ref = EnvironmentRef.from_config(cfg.environment)
    if ref is None or ref.name is None:
        return None
    rows_of = getattr(importlib.import_module(f"agentrl.environments.{ref.library}"), "dataset_rows", None)
    return None if rows_of is None else functools.partial(rows_of, ref)


def prepare_data(
    cfg: "TrainConfig", data_dir: Path, *, environment_rows: EnvironmentRows | None = None, evaluate: bool = False,
) -> tuple[list[str], list[tuple[str, Row]]]:
    """(training files, validation rows as (uid, row)). Without ``data.train_files`` the
    configured environment's own dataset is written into ``data_dir`` when it has one
    (``environment_rows(split)``, split ``train`` and, for validation when no ``data.val_files``
    are given, ``eval``), else the built-in ``data.task`` is generated there (its test split for
    validation when no ``data.val_files`` are given).

    ``evaluate`` (``agentrl rollout``: a checkpoint evaluated on the environment): the files are
    the environment's eval dataset when it has one, else its dataset (``eval.parquet`` or
    ``train.parquet`` in ``data_dir``: the file's name says which), and it gives no validation
    rows of its own."""
    own: list[dict[str, Any]] = []
    own_split = "train"
    if environment_rows is not None and not cfg.data.train_files:
        for own_split in ("eval", "train") if evaluate else ("train",):
            own = environment_rows(own_split)
            if own:
                break
    if cfg.data.train_files:
        files = list(cfg.data.train_files)
    elif own:
        files = [str(write_rows(own, data_dir / f"{own_split}.parquet"))]
    else:
        if (ref := EnvironmentRef.from_config(cfg.environment)) is not None:
            # the built-in task's rows name agent_name tool_agent: none of them would run in it
            raise DataError(
                f"environment.library={ref.library}: the {ref.library} environment "
                f"{repr(ref.name) if ref.name else 'at environment.openenv.url'} has no "
                f"dataset of its own and data.train_files is empty, so the rows would be the built-in task "
                f"(data.task={cfg.data.task}), which run agentrl's tool_agent loop, never the environment: give "
                "data.train_files (its rows without extra_info.environment run in the configured environment; "
                "docs/environments/index.md)")
        from agentrl_data_prep.tasks import generate

        files = [str(write_rows(generate(cfg.data.task, cfg.data.task_train_size, cfg.data.seed, "train"), data_dir / "train.parquet"))]
    val_files = list(cfg.data.val_files)
    if not val_files and own:
        held_out = environment_rows("eval") if environment_rows is not None and not evaluate else []
        val_files = [str(write_rows(held_out, data_dir / "val.parquet"))] if held_out else []
    elif not val_files and cfg.data.task is not None and not cfg.data.train_files:
        from agentrl_data_prep.tasks import validation_rows

        rows = validation_rows(cfg.data.task, cfg.data.task_val_size, cfg.data.seed)
        val_files = [str(write_rows(rows, data_dir / "val.parquet"))]
    from agentrl.config.verl_files import read_interaction_config, read_tool_config
    from agentrl.plugins import PluginRegistry

    registry = PluginRegistry(cfg.plugins.prefer)
    # a row may name a plugin that is installed or one that a verl YAML file defines
    yaml_tools = [s.name for s in read_tool_config(cfg.agent.tool_config_path)] if cfg.agent.tool_config_path else []
    yaml_interactions = (
        [s.name for s in read_interaction_config(cfg.agent.interaction_config_path)] if cfg.agent.interaction_config_path else []
    )
    problems = validate_files(
        files + val_files, known_agent_names=registry.accepted_names("agent_loops"), default_agent=cfg.agent.default_loop,
        known_tools=set(registry.names("tools")) | set(yaml_tools),
        known_interactions=set(registry.names("interactions")) | set(yaml_interactions),
        import_problem=registry.import_problem,  # a plugin that fails to import stops the run here, not at its first row
        known_agents=registry.names("agents"),
        default_environment=EnvironmentRef.from_config(cfg.environment),  # rows without their own run in it
        config_known=True,
        # a row its reward can only score 0 (no ground truth to compare with) is refused too
        ground_truth=GroundTruthRule(cfg.reward, cfg.agent.default_loop, declared=registry.names("data_source_rewards")),
    )
    if problems:
        lines = "\n".join(f"  {p}" for p in problems)
        raise DataError(f"invalid data ({counted(len(problems), 'problem')}):\n{lines}")
    val_rows = []
    for path, tag in zip(val_files, file_tags(val_files)):
        for index, raw in iter_raw_rows(path):
            row = parse_row(raw, file=path, index=index)
            val_rows.append((tag + row_uid(row, path, index), row))
    return files, val_rows
