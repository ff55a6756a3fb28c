"""Compose the Hydra configs, then validate them with the pydantic schema.

``load_config("train", ["algorithm=ppo", "data.train_batch_size=32"])`` returns a validated
``TrainConfig`` or raises ``ConfigError`` listing every problem at once: unknown keys (with a
suggestion), wrong types, missing files, inconsistent numbers and unknown plugin names.

The YAML files hold the choices of each preset; the defaults live in the schema. An override
of a key that no YAML file mentions is still accepted (it is added, then validated), so every
schema knob can be set from the command line without a ``+`` prefix. verl's dotted names
(``actor_rollout_ref.actor.clip_ratio=...``) go through the one table in ``agentrl.config.verl``.
"""

from __future__ import annotations

import copy
import difflib
import logging
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Iterable

from pydantic import BaseModel, ValidationError

from agentrl.config.schema import TrainConfig
from agentrl.config.trained_roles import trained_roles_problems
from agentrl.config.verl import translate
from agentrl.config.verl_files import read_interaction_config, read_tool_config
from agentrl.errors import ConfigError, PluginError

__all__ = ["config_dir", "compose", "validate_config", "load_config"]

log = logging.getLogger(__name__)


def config_dir() -> Path:
    """The directory of the installed YAML configs (the package ``agentrl_configs``)."""
    return Path(str(resources.files("agentrl_configs")))


def _split_override(text: str) -> tuple[str, str, str]:
    """('+', key, value) style pieces of a Hydra override; prefix is '', '+', '++' or '~'."""
    prefix = ""
    for p in ("++", "+", "~"):
        if text.startswith(p):
            prefix, text = p, text[len(p) :]
            break
    key, sep, value = text.partition("=")
    return prefix, key.strip(), value if sep else ""


def _group_option_problem(prefix: str, group: str, option: str) -> str | None:
    """Why ``group=option`` names no preset of the group (its YAML files), with the options and
    the closest one; None when it names one (or removes the group: ``~group``, ``group=null``)."""
    if prefix == "~" or option == "null":
        return None
    options = sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))
    if option in options:
        return None
    close = difflib.get_close_matches(option, options, n=1)
    hint = f"; did you mean {group}={close[0]}?" if close else ""
    return f"unknown option {option!r} (known: {', '.join(options)}){hint}"


def compose(config_name: str, overrides: Iterable[str] = ()) -> dict[str, Any]:
    """Compose ``configs/<config_name>.yaml`` with Hydra and return a plain dict."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    overrides = list(overrides)
    folders = {p.name for p in config_dir().iterdir() if p.is_dir()}
    groups = {name for name in folders if not name.startswith("_")}  # the ones a user chooses (not _data_defaults)
    group_overrides, value_overrides, problems = [], [], []
    for text in overrides:
        prefix, key, value = _split_override(text)
        if "=" not in text and prefix != "~":
            problems.append((text, "an override must look like key=value"))
            continue
        if "." not in key and key in groups:
            if (problem := _group_option_problem(prefix, key, value)) is not None:
                problems.append((key, problem))
            group_overrides.append(text)
            continue
        verl = translate(key, value)  # verl's names: mapped, accepted without effect, or refused
        if verl.error is not None:
            problems.append((key, verl.error))
        elif verl.warning is not None:
            log.warning("agentrl: %s", verl.warning)
        else:
            assert verl.key is not None  # only a warning or an error drops the key
            value_overrides.append((prefix, verl.key, verl.value))
    if problems:
        raise ConfigError(problems)

    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        try:
            base = hydra_compose(config_name=config_name, overrides=group_overrides)
        except Exception as exc:  # hydra's own errors, which a group override can still meet
            raise ConfigError([("<overrides>", str(exc).splitlines()[0])]) from exc
        final = []
        for prefix, key, value in value_overrides:
            # keys no YAML mentions are added (then validated by the schema, which names them)
            if prefix == "" and OmegaConf.select(base, key, default="__absent__") == "__absent__":
                prefix = "++"
            final.append(f"{prefix}{key}={value}" if prefix != "~" else f"~{key}")
        try:
            cfg = _with_value_overrides(base, final, folders)
            if cfg is None:  # what only Hydra's composition applies: every file composed again, with them
                cfg = hydra_compose(config_name=config_name, overrides=group_overrides + final)
        except Exception as exc:  # hydra's own errors (bad override syntax, missing group option)
            raise ConfigError([("<overrides>", str(exc).splitlines()[0])]) from exc
    GlobalHydra.instance().clear()
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


def _with_value_overrides(base: Any, overrides: list[str], groups: set[str]) -> Any | None:
    """``base`` (composed with the group overrides) with the value ``overrides`` applied as Hydra's
    compose applies them once its defaults list is built: its parser, its check of sweeps and its
    override code, without loading and merging every file a second time. None (compose again)
    where Hydra's internals are not the ones this follows, or where an override is one its
    composition treats otherwise: a ``hydra.`` key, or the name of a config group (``groups``, the
    hidden ones too)."""
    try:
        from hydra._internal.config_loader_impl import ConfigLoaderImpl
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from hydra.types import RunMode
    except ImportError:
        return None
    if not all(hasattr(ConfigLoaderImpl, name) for name in ("validate_sweep_overrides_legal", "_apply_overrides_to_config")):
        return None
    parsed = OverridesParser.create().parse_overrides(overrides=overrides)
    if any(o.is_hydra_override() or o.key_or_group in groups for o in parsed):
        return None
    ConfigLoaderImpl.validate_sweep_overrides_legal(overrides=parsed, run_mode=RunMode.RUN, from_shell=False)
    ConfigLoaderImpl._apply_overrides_to_config(parsed, base)
    return base


def _known_keys(model: type[BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    """Field names of the section a pydantic error location points into."""
    current: Any = model
    for part in loc[:-1]:
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return []
        annotation = field.annotation
        current = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
        if current is None:
            return []
    return list(getattr(current, "model_fields", {}))


def _pydantic_problems(exc: ValidationError, model: type[BaseModel]) -> list[tuple[str, str]]:
    problems = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        key = ".".join(str(p) for p in loc)
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(str(loc[-1]), _known_keys(model, loc), n=1)
            hint = f"; did you mean {'.'.join(str(p) for p in loc[:-1] + (close[0],))}?" if close else ""
            problems.append((key, f"unknown key{hint}"))
        else:
            problems.append((key, f"{err['msg']} (got {err.get('input')!r})"))
    return problems


Check = Callable[[TrainConfig], list[tuple[str, str]]]


def _check_batch_sizes(cfg: TrainConfig) -> list[tuple[str, str]]:
    problems = []
    n, prompts = cfg.rollout.n, cfg.data.train_batch_size
    roles = [("actor", cfg.actor)] + ([("critic", cfg.critic)] if cfg.critic.enable else [])
    for role, section in roles:
        mini = section.ppo_mini_batch_size
        if (prompts * n) % (mini * n) != 0:
            problems.append(
                (
                    f"{role}.ppo_mini_batch_size",
                    f"{role}.ppo_mini_batch_size × rollout.n = {mini * n} trajectories does not divide "
                    f"data.train_batch_size × rollout.n = {prompts * n}",
                )
            )
        if mini > prompts:
            problems.append(
                (f"{role}.ppo_mini_batch_size", f"is {mini}, larger than data.train_batch_size = {prompts}")
            )
        per_rank = mini * n / section.world_size
        micro = section.ppo_micro_batch_size_per_gpu
        if per_rank != int(per_rank) or int(per_rank) % micro != 0:
            problems.append(
                (
                    f"{role}.ppo_micro_batch_size_per_gpu",
                    f"{micro} does not divide the per-rank mini-batch "
                    f"({role}.ppo_mini_batch_size × rollout.n / {role}.world_size = {per_rank:g} trajectories)",
                )
            )
    if cfg.sft.batch_size % cfg.sft.micro_batch_size != 0:
        problems.append(("sft.micro_batch_size", f"{cfg.sft.micro_batch_size} does not divide sft.batch_size = {cfg.sft.batch_size}"))
    return problems


def _check_lengths(cfg: TrainConfig) -> list[tuple[str, str]]:
    if cfg.rollout.max_new_tokens > cfg.data.max_response_length:
        return [
            (
                "rollout.max_new_tokens",
                f"{cfg.rollout.max_new_tokens} per turn exceeds data.max_response_length = {cfg.data.max_response_length}",
            )
        ]
    return []


def _check_critic(cfg: TrainConfig) -> list[tuple[str, str]]:
    if cfg.algorithm.adv_estimator == "gae" and not cfg.critic.enable:
        return [("critic.enable", "is false, but algorithm.adv_estimator=gae needs the critic's values (leave it unset: on exactly for gae)")]
    return []


def _check_overlong_buffer(cfg: TrainConfig) -> list[tuple[str, str]]:
    buffer = cfg.algorithm.overlong_buffer
    if buffer.enable and buffer.len >= cfg.data.max_response_length:
        return [("algorithm.overlong_buffer.len", f"{buffer.len} must be below data.max_response_length = {cfg.data.max_response_length}")]
    return []


def _check_workers(cfg: TrainConfig) -> list[tuple[str, str]]:
    if cfg.trainer.workers != "local":
        return []
    several = cfg.groups_of_several_ranks()
    if several:
        return [("trainer.workers", f"local runs one rank per group in the driver's process, but {' and '.join(several)}")]
    if cfg.engine.placement == "ray":
        return [("trainer.workers", "local runs without Ray, but engine.placement=ray places the servers with it")]
    return []


def _check_files(cfg: TrainConfig, *, training: bool = True) -> list[tuple[str, str]]:
    problems = []
    for key, paths in (
        ("data.train_files", cfg.data.train_files),
        ("data.val_files", cfg.data.val_files),
        ("sft.train_files", cfg.sft.train_files if training else []),
    ):
        for i, path in enumerate(paths):
            if not Path(path).is_file():
                problems.append((f"{key}.{i}", f"file not found: {path}"))
    if cfg.model.path is not None and not (Path(cfg.model.path) / "config.json").is_file():
        problems.append(("model.path", f"not a transformers checkpoint directory (no config.json): {cfg.model.path}"))
    if cfg.model.chat_template is not None and not Path(cfg.model.chat_template).is_file():
        problems.append(("model.chat_template", f"file not found: {cfg.model.chat_template}"))
    for key, read in (("agent.tool_config_path", read_tool_config), ("agent.interaction_config_path", read_interaction_config)):
        path = getattr(cfg.agent, key.split(".")[1])
        if path is not None:
            try:
                read(path, key)
            except ConfigError as exc:  # verl's YAML: every problem, named with its entry and field
                problems += exc.problems
    if training and cfg.trainer.resume not in (None, "auto") and not Path(cfg.trainer.resume).is_dir():
        problems.append(("trainer.resume", f"run directory not found: {cfg.trainer.resume}"))
    if not cfg.data.train_files and cfg.data.task is None:
        problems.append(("data.train_files", "empty, and data.task is null: give training files or a built-in task"))
    return problems


def _check_plugins(cfg: TrainConfig) -> list[tuple[str, str]]:
    from agentrl.plugins import PluginRegistry

    registry = PluginRegistry(cfg.plugins.prefer)
    wanted = [
        ("agent.default_loop", "agent_loops", cfg.agent.default_loop),
        ("agent.tool_parser", "tool_parsers", cfg.agent.tool_parser),
        ("reward.default", "rewards", cfg.reward.default),
    ]
    wanted += [(f"reward.by_data_source.{k}", "rewards", v) for k, v in cfg.reward.by_data_source.items()]
    wanted += [(f"agent.tool_parser_by_loop.{k}", "agent_loops", k) for k in cfg.agent.tool_parser_by_loop]
    wanted += [(f"agent.tool_parser_by_loop.{k}", "tool_parsers", v) for k, v in cfg.agent.tool_parser_by_loop.items()]
    wanted += [(f"agent.tool_config.{k}", "tools", k) for k in cfg.agent.tool_config]
    wanted += [(f"agent.interaction_config.{k}", "interactions", k) for k in cfg.agent.interaction_config]
    problems = []
    for key, group, name in wanted:
        if (group, name) == ("tool_parsers", "auto"):  # chosen from the chat template when the tokenizer is loaded
            continue
        try:
            # imported, not just looked up: a plugin that fails to import stops the run here, before
            # any data or model is loaded, not at its first use (a reward after the SFT phase)
            registry.load(group, name)
        except PluginError as exc:
            problems.append((key, str(exc)))
    return problems


def _check_environment(cfg: TrainConfig) -> list[tuple[str, str]]:
    """The config's environment (the one of rows that name none) is found and its library's
    loop installed, before any data or model is loaded; rows' own refs are checked with the data."""
    from agentrl.config.environment_names import environment_problem
    from agentrl.config.schema import ENVIRONMENT_LOOPS, environment_import_hint
    from agentrl.plugins import PluginRegistry

    env = cfg.environment
    registry = PluginRegistry(cfg.plugins.prefer)
    problems = []
    for i, target in enumerate(env.trl.reward_funcs):  # TRL reward functions: imported here, not at the first score
        if (problem := registry.import_problem("environments", target)) is not None:
            problems.append((f"environment.trl.reward_funcs.{i}", problem))
    if env.library is None:
        return problems
    loop = ENVIRONMENT_LOOPS[env.library]
    if loop not in registry.names("agent_loops"):
        problems.append(("environment.library", f"the {env.library} loop {loop!r} is not installed (known loops: "
                                                f"{', '.join(registry.names('agent_loops'))})"))
    if env.name is not None and (problem := environment_problem(registry.import_problem, env.library, env.name)) is not None:
        problems.append(("environment.name", f"{problem} ({environment_import_hint(env.library, env.name)})"))
    return problems


def _check_async(cfg: TrainConfig) -> list[tuple[str, str]]:
    """Asynchronous training (``rollout.max_staleness`` > 0) runs on the built-in engine or SGLang
    servers, without dynamic sampling (its refills are drawn within one step)."""
    if cfg.rollout.max_staleness == 0:
        if cfg.rollout.partial:
            return [("rollout.partial", "partial rollouts interrupt requests at a weight sync during the rollout, which only "
                                        "happens in asynchronous training: set rollout.max_staleness > 0 or rollout.partial=false")]
        return []
    problems = []
    if cfg.engine.backend not in ("builtin", "sglang"):
        problems.append(("rollout.max_staleness", f"asynchronous training runs on engine=builtin or engine=sglang, not "
                                                  f"engine={cfg.engine.backend}; set rollout.max_staleness=0"))
    if cfg.algorithm.filter_groups.enable:
        problems.append(("algorithm.filter_groups.enable", "dynamic sampling is not supported with rollout.max_staleness > 0"))
    return problems


def _check_rollout_correction(cfg: TrainConfig) -> list[tuple[str, str]]:
    rc = cfg.actor.rollout_correction
    if rc.method == "decoupled" and rc.level != "token":
        return [("actor.rollout_correction.level", f"method=decoupled (decoupled PPO) weighs each token: set level=token, not {rc.level}")]
    return []


CHECKS: tuple[Check, ...] = (
    _check_batch_sizes, _check_lengths, _check_critic, _check_overlong_buffer, _check_workers, _check_files, _check_plugins,
    _check_environment, _check_async, _check_rollout_correction, trained_roles_problems,
)
# what only a command that trains uses: its batch relations, the critic, the reward shaping of
# the trainer and its workers (a rollout with data.train_batch_size=8 is not refused for the
# actor's mini-batch of 16)
TRAINING_CHECKS = frozenset({_check_batch_sizes, _check_critic, _check_overlong_buffer, _check_workers, _check_async,
                             _check_rollout_correction, trained_roles_problems})


def _problems(cfg: TrainConfig, *, check_files: bool, training: bool) -> list[tuple[str, str]]:
    problems = []
    for check in CHECKS:
        if check is _check_files:
            problems += _check_files(cfg, training=training) if check_files else []
        elif training or check not in TRAINING_CHECKS:
            problems += check(cfg)
    return problems


def validate_config(raw: dict[str, Any], *, check_files: bool = True, training: bool = True) -> TrainConfig:
    """Validate a composed config; raise ``ConfigError`` with every problem found.

    ``training=False`` (``agentrl rollout``, ``replay rescore`` ..., commands that train nothing):
    the checks of what only training uses are left out (``TRAINING_CHECKS``, the SFT files and
    ``trainer.resume``); every field is still validated by the schema."""
    try:
        cfg = TrainConfig.model_validate(raw)
    except ValidationError as exc:
        problems = _pydantic_problems(exc, TrainConfig)
        # Run the cross-field checks on the defaults of the broken sections, so that problems
        # in the valid sections are reported in the same pass.
        partial = _partial(raw, exc)
        if partial is not None:
            problems += _problems(partial, check_files=check_files, training=training)
        raise ConfigError(_dedupe(problems)) from None
    problems = _problems(cfg, check_files=check_files, training=training)
    if problems:
        raise ConfigError(_dedupe(problems))
    return cfg


def _partial(raw: dict[str, Any], exc: ValidationError) -> TrainConfig | None:
    """The config with every invalid value removed (so its default applies), or None."""
    stripped = copy.deepcopy(raw)
    for _ in range(3):  # removing a value can only reveal errors in its parents
        for err in exc.errors():
            *parents, leaf = err["loc"]
            node: Any = stripped
            for part in parents:
                node = node.get(part) if isinstance(node, dict) else None
            if isinstance(node, dict):
                node.pop(leaf, None)
        try:
            return TrainConfig.model_validate(stripped)
        except ValidationError as again:
            exc = again
    return None


def _dedupe(problems: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return list(dict.fromkeys(problems))


def load_config(
    config_name: str = "train", overrides: Iterable[str] = (), *, check_files: bool = True, training: bool = True
) -> TrainConfig:
    """Compose and validate in one call: what every CLI entry point does first (``training``: see
    ``validate_config``)."""
    return validate_config(compose(config_name, overrides), check_files=check_files, training=training)
