"""A job's data from its config: the training files and the validation rows, all validated
before any compute is spent (every problem reported at once, naming its file, row and field)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from agentrl.data.dataset import file_tags, parse_row, row_uid, validate_files
from agentrl.data.io import iter_raw_rows, write_rows
from agentrl.data.row import EnvironmentRef, Row
from agentrl.errors import DataError

if TYPE_CHECKING:
    from agentrl.config.schema import TrainConfig

__all__ = ["prepare_data"]


def prepare_data(
    cfg: "TrainConfig", data_dir: Path, *, environment_rows: Callable[[str], list[dict[str, Any]]] | None = None
) -> tuple[list[str], list[tuple[str, Row]]]:
    """(training files, validation rows as (uid, row)). Without ``data.train_files`` the
    configured environment's own dataset is written into ``data_dir`` when it has one
    (``environment_rows(split)``, split ``train`` and, for validation when no ``data.val_files``
    are given, ``eval``), else the built-in ``data.task`` is generated there (its test split for
    validation when no ``data.val_files`` are given)."""
    own = environment_rows("train") if environment_rows is not None and not cfg.data.train_files else []
    if cfg.data.train_files:
        files = list(cfg.data.train_files)
    elif own:
        files = [str(write_rows(own, data_dir / "train.parquet"))]
    else:
        from agentrl_data_prep.tasks import generate

        files = [str(write_rows(generate(cfg.data.task, cfg.data.task_train_size, cfg.data.seed, "train"), data_dir / "train.parquet"))]
    val_files = list(cfg.data.val_files)
    if not val_files and own:
        held_out = environment_rows("eval") if environment_rows is not None else []
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
    )
    if problems:
        lines = "\n".join(f"  {p}" for p in problems)
        raise DataError(f"invalid data ({len(problems)} problems):\n{lines}")
    val_rows = []
    for path, tag in zip(val_files, file_tags(val_files)):
        for index, raw in iter_raw_rows(path):
            row = parse_row(raw, file=path, index=index)
            val_rows.append((tag + row_uid(row, path, index), row))
    return files, val_rows
