"""verl's tool and interaction YAML files run through agentrl's runtime: the YAML's schema is
what the model is offered, verl's own classes map to agentrl plugins with verl's behaviour, a
class written against verl's interface runs through an adapter, and a bad file is refused
naming the file, the entry and the field."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import pytest

from agentrl.agent.interaction import InteractionResponse
from agentrl.agent.tool_parsers import ParsedCall
from agentrl.agent.tools_runtime import InteractionPool, ToolBox
from agentrl.config.verl_files import read_interaction_config, read_tool_config
from agentrl.errors import ConfigError
from agentrl.plugins import PluginRegistry
from agentrl_interactions.gsm8k import Gsm8kInteraction
from agentrl_tools.gsm8k_answer import Gsm8kAnswerTool

# verl's examples/sglang_multiturn/config/{tool,interaction}_config/gsm8k_*.yaml, as written there
VERL_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "verl"
VERL_GSM8K_TOOL_YAML = (VERL_FIXTURES / "gsm8k_tool_config.yaml").read_text()
VERL_GSM8K_INTERACTION_YAML = (VERL_FIXTURES / "gsm8k_interaction_config.yaml").read_text()


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def call(name, **arguments):
    return ParsedCall(name=name, arguments=arguments, raw="")


def test_verls_gsm8k_tool_yaml_offers_exactly_its_schema_and_runs_the_gsm8k_answer_tool(tmp_path):
    specs = read_tool_config(write(tmp_path, "tools.yaml", VERL_GSM8K_TOOL_YAML))
    box = ToolBox.from_plugins([], specs=specs)
    tool = box.ensure("calc_gsm8k_reward")
    assert isinstance(tool, Gsm8kAnswerTool)
    [offered] = box.schemas(["calc_gsm8k_reward"])
    assert offered["function"]["name"] == "calc_gsm8k_reward"
    assert offered["function"]["description"].startswith("A tool for calculating the reward of gsm8k. (1.0 if parsed")
    assert offered["function"]["parameters"]["required"] == ["answer"]


def test_gsm8k_answer_tool_has_verls_texts_step_rewards_and_final_reward():
    async def scenario():
        tool = Gsm8kAnswerTool()
        await tool.create("t", ground_truth="72")
        results = [await tool.execute("t", {"answer": a}) for a in ("70", "72", "#### 72", "71")]
        return results, await tool.calc_reward("t")

    results, final = asyncio.run(scenario())
    assert [r.text for r in results] == [
        "Current parsed answer='70' reward=0.0",
        "Current parsed answer='72' reward=1.0",
        "Current parsed answer='#### 72' reward=1.0",
        "Current parsed answer='71' reward=0.0",
    ]
    # 0.0 when the score improved on the best so far, verl's -0.05 otherwise
    assert [r.reward for r in results] == [-0.05, 0.0, -0.05, -0.05]
    assert final == 0.0  # the last submitted answer decides


def test_arguments_are_validated_against_the_yaml_schema_not_the_class(tmp_path):
    yaml = VERL_GSM8K_TOOL_YAML.replace('type: "string"', 'type: "integer"')
    box = ToolBox.from_plugins([], specs=read_tool_config(write(tmp_path, "tools.yaml", yaml)))
    box.ensure("calc_gsm8k_reward")

    async def run(arguments):
        session = box.session("t", {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}})
        async with session:
            return await session.execute(call("calc_gsm8k_reward", **arguments))

    bad = asyncio.run(run({"answer": "72"}))
    assert bad.error == "invalid_arguments"
    assert bad.text == "Error: invalid arguments for calc_gsm8k_reward: answer: '72' is not of type 'integer'"
    good = asyncio.run(run({"answer": 72}))
    assert (good.error, good.text) == (None, "Current parsed answer='72' reward=1.0")


def test_agentrl_tools_are_configured_the_same_way(tmp_path):
    path = write(tmp_path, "tools.yaml", """\
        tools:
          - class_name: calculator
            config: {type: native}
            tool_schema: {type: function, function: {name: calc, description: "arithmetic", parameters: {type: object, properties: {expression: {type: string}}, required: [expression]}}}
        """)
    box = ToolBox.from_plugins([], specs=read_tool_config(path))

    async def run():
        session = box.session("t", {"calc": {}})
        async with session:
            return await session.execute(call("calc", expression="6*7"))

    assert asyncio.run(run()).text == "42"


VERL_STYLE_MODULE = '''
class EchoTool:
    """Written against verl's tool interface: (config, tool_schema), ids returned by create."""
    def __init__(self, config, tool_schema):
        self.prefix = config["prefix"]
        self.name = tool_schema.function.name
        self.state = {}
    async def create(self, instance_id=None, **kwargs):
        self.state["own-" + instance_id] = kwargs.get("seed_text", "")
        return "own-" + instance_id, None
    async def execute(self, instance_id, parameters, **kwargs):
        self.state[instance_id] += parameters["text"]
        return self.prefix + self.state[instance_id], 0.5, {"length": len(self.state[instance_id]), "note": "x"}
    async def calc_reward(self, instance_id, **kwargs):
        return len(self.state[instance_id]) / 10
    async def release(self, instance_id, **kwargs):
        del self.state[instance_id]

class AskAgain:
    """verl's interaction interface."""
    def __init__(self, config):
        self.config = config
        self.turns = {}
    async def start_interaction(self, instance_id=None, **kwargs):
        self.turns[instance_id] = 0
        return instance_id
    async def generate_response(self, instance_id, messages, **kwargs):
        self.turns[instance_id] += 1
        done = self.turns[instance_id] >= 2
        return done, "again" if not done else "", 1.0 if done else 0.0, {"turn": self.turns[instance_id]}
    async def calculate_score(self, instance_id, **kwargs):
        return float(self.turns[instance_id])
    async def finalize_interaction(self, instance_id, **kwargs):
        del self.turns[instance_id]
'''


def test_a_users_class_with_verls_tool_interface_runs_through_the_adapter(tmp_path, monkeypatch):
    (tmp_path / "my_verl_tools.py").write_text(VERL_STYLE_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write(tmp_path, "tools.yaml", """\
        tools:
          - class_name: my_verl_tools.EchoTool
            config: {type: native, prefix: "got: "}
            tool_schema: {type: function, function: {name: echo, parameters: {type: object, properties: {text: {type: string}}, required: [text]}}}
        """)
    box = ToolBox.from_plugins([], specs=read_tool_config(path))
    inner = box.ensure("echo").inner

    async def run():
        session = box.session("t", {"echo": {"create_kwargs": {"seed_text": "ab"}}})
        async with session:
            outcomes = [await session.execute(call("echo", text="c")), await session.execute(call("echo", text="de"))]
            rewards = await session.collect_rewards()
            assert set(inner.state) == {"own-t"}  # the tool's own instance id is used
        return outcomes, rewards

    outcomes, rewards = asyncio.run(run())
    assert [(o.text, o.reward, o.metrics) for o in outcomes] == [("got: abc", 0.5, {"length": 3.0}), ("got: abcde", 0.5, {"length": 5.0})]
    assert rewards == {"echo": 0.5}
    assert inner.state == {}  # released


def test_verls_interaction_yaml_maps_gsm8k_with_verls_flexible_scoring_and_runs_a_verl_style_class(tmp_path, monkeypatch):
    specs = read_interaction_config(write(tmp_path, "interaction.yaml", VERL_GSM8K_INTERACTION_YAML))
    pool = InteractionPool(specs=specs)
    gsm8k = pool.get("gsm8k")
    assert isinstance(gsm8k, Gsm8kInteraction) and gsm8k.config == {"method": "flexible"}

    (tmp_path / "my_verl_tools.py").write_text(VERL_STYLE_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write(tmp_path, "ask.yaml", "interaction:\n  - {name: ask, class_name: my_verl_tools.AskAgain, config: {k: 1}}\n")
    pool = InteractionPool(specs=read_interaction_config(path))

    async def run():
        session = pool.session("t", {"name": "ask"})
        async with session:
            replies = [await session.respond([]), await session.respond([])]
            return replies, await session.score()

    replies, score = asyncio.run(run())
    assert [(r.done, r.text, r.reward, r.metrics) for r in replies] == [(False, "again", 0.0, {"turn": 1.0}), (True, "", 1.0, {"turn": 2.0})]
    assert score == 2.0
    assert pool.get("ask").inner.turns == {}  # finalized
    assert pool.get("ask").inner.config == {"k": 1, "name": "ask"}


@pytest.mark.parametrize(
    "yaml, problem",
    [
        ("tools:\n  - class_name: verl.tools.search_tool.SearchTool\n    tool_schema: {type: function, function: {name: search}}\n",
         "tools.0.class_name: verl's verl.tools.search_tool.SearchTool has no agentrl counterpart"),
        ("tools:\n  - class_name: calculator\n    tool_schema: {type: function, function: {description: x}}\n",
         "tools.0.tool_schema.function.name: missing"),
        ("tools:\n  - class_name: calculator\n    config: {type: mcp}\n", "tools.0.config.type: only native tools are supported"),
        ("tools:\n  - class_name: calculator\n    tool_schema: {type: function, function: {name: c, parameters: {type: 12}}}\n",
         "tools.0.tool_schema.function.parameters: not a JSON schema"),
        ("tools:\n  - config: {}\n", "tools.0.class_name: missing"),
        ("tool:\n  - class_name: calculator\n", "needs a top-level `tools:` list"),
        ("tools:\n  - class_name: no_such_module_xyz.Tool\n", "tools.0.class_name: cannot import 'no_such_module_xyz.Tool'"),
    ],
)
def test_a_bad_tool_yaml_is_refused_naming_the_file_the_entry_and_the_field(tmp_path, yaml, problem):
    path = write(tmp_path, "tools.yaml", yaml)
    with pytest.raises(ConfigError) as err:
        for spec in read_tool_config(path):
            ToolBox.from_plugins([spec.name], specs=[spec])
    [(key, message)] = err.value.problems
    assert key == "agent.tool_config_path"
    assert message.startswith(path) and problem in message, message


def test_two_yaml_tools_with_one_name_are_refused(tmp_path):
    one = "  - class_name: calculator\n    tool_schema: {type: function, function: {name: calc}}\n"
    path = write(tmp_path, "tools.yaml", "tools:\n" + one + one)
    with pytest.raises(ConfigError, match=r"tools\.1: tool name 'calc' is also defined at .*tools\.0"):
        read_tool_config(path)


def test_gsm8k_answer_is_an_entry_point_plugin_like_the_other_tools():
    assert PluginRegistry().load("tools", "gsm8k_answer") is Gsm8kAnswerTool


def test_a_verl_tool_variant_row_runs_with_verls_overrides_and_yaml_through_the_loops(tmp_path, tiny_tokenizer):
    """verl's gsm8k_multiturn_w_tool row and tool YAML, given by verl's override: the prompt
    offers exactly the YAML's schema, the call runs verl's tool, the rewards are verl's."""
    from agentrl.agent.runner import LoopTable, RolloutRunner, build_context
    from agentrl.agent.scripted import ScriptedEngine
    from agentrl.agent.setup import RolloutSetup
    from agentrl.config import load_config
    from agentrl.data.dataset import parse_row

    tools = write(tmp_path, "gsm8k_tool_config.yaml", VERL_GSM8K_TOOL_YAML)
    cfg = load_config("rollout", [f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}"], check_files=False)
    row = parse_row({
        "data_source": "openai/gsm8k", "agent_name": "tool_agent", "ability": "math",
        "prompt": [{"role": "system", "content": "Use the `calc_gsm8k_reward` tool. Put your final answer as `#### <answer>`."},
                   {"role": "user", "content": "Natalia sold 48 clips in April and half as many in May. How many in all?"}],
        "reward_model": {"style": "rule", "ground_truth": "72"},
        "extra_info": {"split": "train", "index": 0, "need_tools_kwargs": True,
                       "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}},
                       "interaction_kwargs": {"query": "...", "ground_truth": "72"}},
    }, file="train.parquet", index=0)
    call = '<tool_call>\n{"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}\n</tool_call>'
    engine = ScriptedEngine(tiny_tokenizer, {"r0": [call, "48 + 24 = 72\n#### 72"]})
    ctx = build_context(engine, tiny_tokenizer, RolloutSetup.from_config(cfg))
    [t] = asyncio.run(RolloutRunner(ctx, LoopTable(cfg.agent.default_loop)).run([("r0", row)]))
    assert t.finish_reason == "stop", t.reward_info
    yaml_schema = read_tool_config(tools)[0].schema
    assert ctx.toolbox.schemas(["calc_gsm8k_reward"]) == [yaml_schema]
    assert '"name": "calc_gsm8k_reward"' in tiny_tokenizer.decode(t.prompt_ids)  # offered in the prompt
    assert [m["content"] for m in t.messages if m["role"] == "tool"] == ["Current parsed answer='72' reward=1.0"]
    [record] = t.tool_calls
    assert (record.name, record.reward, record.error) == ("calc_gsm8k_reward", 0.0, None)
    assert t.reward == 1.0


def test_an_unnamed_rows_interaction_runs_only_when_an_interaction_yaml_is_configured(tmp_path):
    unnamed = {"query": "q", "ground_truth": "72"}
    assert InteractionPool().session("t", unnamed) is None  # verl: no interaction config, no interaction
    assert InteractionPool().session("t", {"name": "gsm8k", **unnamed}).interaction.config == {"method": "strict"}  # named: agentrl's plugin
    pool = InteractionPool(specs=read_interaction_config(write(tmp_path, "i.yaml", VERL_GSM8K_INTERACTION_YAML)))
    session = pool.session("t", unnamed)
    assert isinstance(session.interaction, Gsm8kInteraction) and session.kwargs == unnamed  # verl's default: gsm8k


def test_a_row_naming_no_tools_gets_the_configured_defaults_not_the_tools_other_rows_named():
    box = ToolBox.from_plugins([])  # nothing configured: verl offers no tools
    assert box.session("a", {"calculator": {}}).enabled == ["calculator"]
    assert box.session("b", {}).enabled == []  # not the calculator another row made the box load
    box = ToolBox.from_plugins(["calculator"])
    assert box.session("c", {}).enabled == ["calculator"]


def test_two_rows_with_one_row_id_keep_their_own_interaction_instances(tiny_tokenizer, make_ctx):
    """verl files index each split from 0: rows of two files can share ``data_source:index``."""
    from agent_helpers import make_row

    from agentrl.agent.interaction import Interaction
    from agentrl.agent.runner import LoopTable, RolloutRunner
    from agentrl.agent.scripted import ScriptedEngine

    class Recording(Interaction):
        started: list[str] = []

        async def start(self, instance_id, **kwargs):
            self.started.append(instance_id)

        async def generate_response(self, instance_id, messages):
            return InteractionResponse(done=True, text="")

    rows = [("same", make_row(answer=gt, interaction_kwargs={"name": "rec"})) for gt in ("72", "36")]
    ctx = make_ctx(ScriptedEngine(tiny_tokenizer, {"same": ["#### 72"]}))
    ctx.interactions._instances["rec"] = Recording()
    asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run(rows))
    assert len(Recording.started) == len(set(Recording.started)) == 2
