"""The agent layer's public names: each is the object its module defines, imported explicitly."""

from __future__ import annotations

import importlib
import subprocess
import sys

import agentrl.agent as agent


def test_every_public_name_resolves_to_its_modules_object():
    for name in agent.__all__:
        module = importlib.import_module(getattr(agent, name).__module__)
        assert module.__name__.startswith("agentrl.agent."), name
        assert getattr(agent, name) is getattr(module, name), name
        assert name in getattr(module, "__all__", [name]), f"{name} is not in {module.__name__}.__all__"


def test_unknown_name_is_an_attribute_error():
    try:
        agent.NoSuchLoop  # noqa: B018
    except AttributeError as exc:
        assert "agentrl.agent' has no attribute 'NoSuchLoop'" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_importing_the_agent_package_loads_neither_torch_nor_transformers():
    code = "import sys, agentrl.agent; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
