"""The environment seam: a row's (or the config's) environment ref, the loop it picks, the name
it resolves to, and bad refs refused at load naming file, row and field."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap

import pytest

from agentrl.agent.loop import AgentLoop
from agentrl.agent.runner import RolloutRunner, build_context
from agentrl.agent.setup import RolloutSetup
from agentrl.config import validate_config
from agentrl.config.schema import EnvironmentConfig, TrainConfig
from agentrl.data.dataset import validate_files
from agentrl.data.io import iter_raw_rows, write_rows
from agentrl.data.row import Row
from agentrl.environments import spec
from agentrl.errors import ConfigError, PluginError
from agentrl.plugins import PLUGIN_TABLE_ENV, PluginRegistry, discover, refresh
from agentrl.trajectory import Trajectory, TrajectoryFinish

LOOPS = {"single_turn", "tool_agent", "verifiers_env", "openenv_env", "trl_env"}


def row(environment=None, agent_name=None) -> dict:
    extra = {"index": 0}
    if environment is not None:
        extra["environment"] = environment
    return {"data_source": "t", "prompt": [{"role": "user", "content": "hi"}], "extra_info": extra, "agent_name": agent_name}


@pytest.fixture
def env_module(tmp_path, monkeypatch):
    """A module a user installed: ``my_envs`` with a class and a function."""
    (tmp_path / "my_envs.py").write_text(textwrap.dedent("""
        class Counter:
            def reset(self, **kwargs):
                return "start"

        def load_environment(**args):
            return ("env", args)
    """))
    (tmp_path / "needs_missing.py").write_text("import surely_not_installed_pkg\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec.clear_cache()
    yield
    spec.clear_cache()
    for name in ("my_envs", "needs_missing"):
        sys.modules.pop(name, None)


def test_a_rows_environment_survives_parquet_and_args_stay_its_own(tmp_path):
    path = write_rows([row({"library": "trl", "name": "my_envs:Counter", "args": {"size": 3}}),
                       {**row({"library": "verifiers", "name": "my_envs", "args": {"level": "hard"}}),
                        "reward_model": {"style": "rule", "ground_truth": "7"}}, row()], tmp_path / "d.parquet")
    # rows of two libraries mix in one file: a row written without reward_model reads as having the default
    rows = [Row.model_validate(raw) for _, raw in iter_raw_rows(path)]
    assert rows[1].ground_truth == "7" and rows[0].ground_truth is None
    assert rows[0].extra_info.environment == spec.EnvironmentRef(library="trl", name="my_envs:Counter", args={"size": 3})
    assert rows[1].extra_info.environment.args == {"level": "hard"}  # no 'size': None merged in from row 0
    assert rows[2].extra_info.environment is None


def test_the_loop_is_agent_name_else_the_rows_library_else_the_configs_else_none():
    config_ref = spec.EnvironmentRef(library="openenv", name="x")
    assert Row.model_validate(row({"library": "trl", "name": "m"})).loop_name(config_ref) == "trl_env"
    assert Row.model_validate(row({"library": "verifiers", "name": "m"}, agent_name="react")).loop_name(config_ref) == "react"
    assert Row.model_validate(row()).loop_name(config_ref) == "openenv_env"
    assert Row.model_validate(row()).loop_name(None) is None
    assert spec.LIBRARY_LOOPS == {"verifiers": "verifiers_env", "openenv": "openenv_env", "trl": "trl_env"}


class _Recorder(AgentLoop):
    def __init__(self, name):
        self.name = name

    async def run(self, row, ctx, *, row_id, group_id, sample_index=0, seed=None):
        return Trajectory(row_id=row_id, group_id=group_id, sample_index=sample_index, data_source=row.data_source,
                          agent_name=self.name, prompt_ids=[1], response_ids=[], response_mask=[], logprobs=[], turns=[],
                          messages=[], finish_reason=TrajectoryFinish.STOP, reward=0.0, reward_info={})


class _Loops:
    default = "single_turn"

    def get(self, name):
        return _Recorder(name or self.default)


def test_the_runner_runs_each_row_in_its_librarys_loop_and_config_ref_fills_the_rest(tiny_tokenizer):
    ctx = build_context(None, tiny_tokenizer, RolloutSetup.from_config(TrainConfig()), tool_names=[])
    ctx.environment = EnvironmentConfig(library="verifiers", name="cfg_env")
    rows = [("a", Row.model_validate(row({"library": "trl", "name": "m"}))), ("b", Row.model_validate(row())),
            ("c", Row.model_validate(row({"library": "openenv", "name": "m"}, agent_name="tool_agent")))]
    out = asyncio.run(RolloutRunner(ctx, _Loops()).run(rows))
    assert [t.agent_name for t in out] == ["trl_env", "verifiers_env", "tool_agent"]
    ctx.environment = EnvironmentConfig()
    out = asyncio.run(RolloutRunner(ctx, _Loops()).run(rows))
    assert [t.agent_name for t in out] == ["trl_env", "single_turn", "tool_agent"]


def test_bad_refs_fail_at_load_naming_file_row_and_field(tmp_path, env_module):
    path = str(write_rows([
        row({"library": "trl", "name": "my_envs:Counter"}),
        row({"library": "gym", "name": "my_envs"}),
        row({"library": "trl", "name": "my_envs", "extra": 1}),
        row({"library": "trl", "name": "no_such_env_module"}),
        row({"library": "verifiers", "name": "needs_missing"}),
        row({"library": "trl", "name": "my_envs:Nope"}),
        row({"library": "openenv", "name": "my_envs"}),
    ], tmp_path / "bad.parquet"))
    registry = PluginRegistry()
    problems = validate_files([path], known_agent_names=LOOPS - {"openenv_env"}, import_problem=registry.import_problem)
    found = {(p.row, p.field): str(p) for p in problems}
    assert sorted(found) == [(1, "extra_info.environment.library"), (2, "extra_info.environment.extra"),
                             (3, "extra_info.environment.name"), (4, "extra_info.environment.name"),
                             (5, "extra_info.environment.name"), (6, "extra_info.environment.library")]
    assert all(text.startswith(f"file {path}, row ") for text in found.values())
    assert "no module named 'no_such_env_module'" in found[(3, "extra_info.environment.name")]
    missing = found[(4, "extra_info.environment.name")]
    # verifiers itself is installed (the test extra): the hint points at the user's module, not at the extra
    assert "the package 'surely_not_installed_pkg' is not installed" in missing and "verifiers is installed" in missing
    assert "agentrl[verifiers]" not in missing
    typo = found[(5, "extra_info.environment.name")]  # the module imports: no hint to install anything
    assert "has no attribute 'Nope'" in typo and "(the module 'my_envs' imports: is 'Nope' the name it defines?)" in typo
    assert "unknown openenv loop 'openenv_env'" in found[(6, "extra_info.environment.library")]


def test_resolve_finds_module_attr_and_module_once_and_names_the_missing_package(env_module):
    cls = spec.resolve(spec.EnvironmentRef(library="trl", name="my_envs:Counter"))
    assert cls.__name__ == "Counter" and cls().reset() == "start"
    assert spec.resolve(spec.EnvironmentRef(library="trl", name="my_envs:Counter")) is cls
    module = spec.resolve(spec.EnvironmentRef(library="verifiers", name="my_envs"))
    assert module.load_environment(a=1) == ("env", {"a": 1})
    with pytest.raises(PluginError, match=r"package 'surely_not_installed_pkg' is not installed.*openenv is installed: is the package that defines 'needs_missing'"):
        spec.resolve(spec.EnvironmentRef(library="openenv", name="needs_missing"))
    with pytest.raises(PluginError, match="names nothing"):
        spec.resolve(spec.EnvironmentRef(library="trl"))


def test_cached_builds_one_object_per_library_name_and_args(env_module):
    built = []

    def build(ref):
        built.append(ref.args)
        return object()

    a = spec.EnvironmentRef(library="trl", name="my_envs:Counter", args={"n": 1})
    assert spec.cached(a, build) is spec.cached(spec.EnvironmentRef(library="trl", name="my_envs:Counter", args={"n": 1}), build)
    spec.cached(spec.EnvironmentRef(library="trl", name="my_envs:Counter", args={"n": 2}), build)
    assert built == [{"n": 1}, {"n": 2}]


def test_an_entry_point_in_the_environments_group_resolves_and_is_listed(env_module, monkeypatch):
    table = [s.as_dict() for s in discover()] + [
        {"group": "agentrl.environments", "name": "counter", "target": "my_envs:Counter", "distribution": "my-envs"}]
    monkeypatch.setenv(PLUGIN_TABLE_ENV, json.dumps(table))
    refresh()
    try:
        assert spec.resolve(spec.EnvironmentRef(library="trl", name="counter")).__name__ == "Counter"
        listed = subprocess.run([sys.executable, "-m", "agentrl.cli", "plugins", "list", "--group", "environments"],
                                capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0 and "agentrl.environments" in listed.stdout and "my_envs:Counter" in listed.stdout
    finally:
        monkeypatch.delenv(PLUGIN_TABLE_ENV)
        refresh()


def test_the_config_ref_is_checked_before_any_work(env_module):
    with pytest.raises(ConfigError) as err:
        validate_config({"environment": {"name": "my_envs"}}, check_files=False)
    assert "environment.name 'my_envs' needs environment.library" in str(err.value)
    with pytest.raises(ConfigError) as err:
        validate_config({"environment": {"library": "verifiers", "name": "needs_missing"}}, check_files=False)
    name_problem = dict(err.value.problems)["environment.name"]
    assert "surely_not_installed_pkg" in name_problem and "is the package that defines 'needs_missing' installed" in name_problem
    with pytest.raises(ConfigError) as err:
        validate_config({"environment": {"library": "trl", "name": "my_envs:Counter"}, "agent": {"default_loop": "nope"}},
                        check_files=False)
    assert "environment.name" not in dict(err.value.problems)


def test_a_configured_environment_without_a_dataset_or_data_files_is_refused_not_skipped(env_module, tmp_path):
    # the built-in task's rows name agent_name tool_agent: the run trained them and never the environment
    from agentrl.data.prepare import prepare_data
    from agentrl.errors import DataError

    cfg = validate_config({"environment": {"library": "trl", "name": "my_envs:Counter"}}, check_files=False)
    with pytest.raises(DataError, match=r"environment.library=trl: the trl environment 'my_envs:Counter' has no dataset "
                                        r"of its own and data.train_files is empty, .*\(data.task=arith\).* give data.train_files"):
        prepare_data(cfg, tmp_path / "data")
    assert not (tmp_path / "data").exists()  # refused before any rows were written
    served = validate_config({"environment": {"library": "openenv", "openenv": {"url": "http://127.0.0.1:9"}}}, check_files=False)
    with pytest.raises(DataError, match=r"the openenv environment at environment.openenv.url has no dataset"):
        prepare_data(served, tmp_path / "data")
    files = [str(write_rows([row()], tmp_path / "rows.parquet"))]
    cfg = validate_config({"environment": {"library": "trl", "name": "my_envs:Counter"}, "data": {"train_files": files}},
                          check_files=False)
    assert prepare_data(cfg, tmp_path / "data")[0] == files


def test_a_missing_library_is_named_with_the_extra_that_installs_it(env_module, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec  # as on a machine without verifiers
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "verifiers" else real(name, *a))
    spec.clear_cache()
    with pytest.raises(PluginError) as err:
        spec.resolve(spec.EnvironmentRef(library="verifiers", name="needs_missing"))
    assert "pip install 'agentrl[verifiers]'" in str(err.value)


def test_a_rows_ref_without_a_name_takes_the_configs_name_when_their_libraries_agree(tmp_path, env_module):
    config_ref = spec.EnvironmentRef(library="trl", name="my_envs:Counter", args={"size": 3})
    nameless = Row.model_validate(row({"library": "trl", "args": {"size": 5}}))
    # the config's environment with the row's own args (the row's args replace the config's)
    assert nameless.environment_ref(config_ref) == spec.EnvironmentRef(library="trl", name="my_envs:Counter", args={"size": 5})
    assert nameless.loop_name(config_ref) == "trl_env"
    other = spec.EnvironmentRef(library="verifiers", name="my_envs")
    assert nameless.environment_ref(other) == spec.EnvironmentRef(library="trl", args={"size": 5})  # not another library's
    assert nameless.environment_ref(None).name is None
    named = Row.model_validate(row({"library": "trl", "name": "my_envs:Other"}))
    assert named.environment_ref(config_ref).name == "my_envs:Other"  # a row that names one keeps it
    # at load, a nameless row of a library whose name cannot come from the config is refused naming the field
    path = str(write_rows([row({"library": "trl", "args": {"size": 5}}), row({"library": "verifiers"}),
                           row({"library": "openenv"})], tmp_path / "nameless.parquet"))
    found = {(p.row, p.field): str(p) for p in validate_files([path], known_agent_names=LOOPS, default_environment=config_ref,
                                                               config_known=True)}
    assert sorted(found) == [(1, "extra_info.environment.name")]  # row 0 takes the config's; openenv may have a URL
    assert ("the row's verifiers environment names nothing and the config's is trl: set extra_info.environment.name, "
            "or environment.library=verifiers with environment.name") in found[(1, "extra_info.environment.name")]
    found = {(p.row, p.field) for p in validate_files([path], known_agent_names=LOOPS, config_known=True)}
    assert found == {(0, "extra_info.environment.name"), (1, "extra_info.environment.name")}
    assert validate_files([path], known_agent_names=LOOPS) == []  # agentrl data validate: the config may name them


def test_verifiers_own_ids_name_the_module_as_verifiers_reads_them(env_module, tmp_path):
    """``vf-calc-tool`` and ``owner/vf-calc-tool`` (what ``vf-eval`` and ``vf.load_environment``
    take) are the module ``vf_calc_tool``: the config check, the data check and ``resolve`` accept
    them; a missing one is refused naming the module the id names. Other libraries keep names as given."""
    (tmp_path / "vf_calc_tool.py").write_text("def load_environment(**args):\n    return ('calc', args)\n")
    try:
        for name in ("vf-calc-tool", "someone/vf-calc-tool", "vf_calc_tool"):
            module = spec.resolve(spec.EnvironmentRef(library="verifiers", name=name))
            assert module.__name__ == "vf_calc_tool"
        validate_config({"environment": {"library": "verifiers", "name": "vf-calc-tool"}}, check_files=False)
        path = str(write_rows([row({"library": "verifiers", "name": "vf-calc-tool"}),
                               row({"library": "trl", "name": "vf-calc-tool"})], tmp_path / "ids.parquet"))
        found = {(p.row, p.field) for p in validate_files([path], known_agent_names=LOOPS,
                                                          import_problem=PluginRegistry().import_problem)}
        assert found == {(1, "extra_info.environment.name")}  # a trl name is what it says
        with pytest.raises(ConfigError) as err:
            validate_config({"environment": {"library": "verifiers", "name": "vf-no-such-env"}}, check_files=False)
        problem = dict(err.value.problems)["environment.name"]
        assert "verifiers reads the id 'vf-no-such-env' as the module 'vf_no_such_env':" in problem
        assert "no module named 'vf_no_such_env'" in problem
        with pytest.raises(PluginError, match=r"verifiers environment 'vf-no-such-env' cannot be loaded: verifiers reads the "
                                              r"id as the module 'vf_no_such_env': .*no module named 'vf_no_such_env'"):
            spec.resolve(spec.EnvironmentRef(library="verifiers", name="vf-no-such-env"))
    finally:
        sys.modules.pop("vf_calc_tool", None)
