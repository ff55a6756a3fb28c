"""The public API: every name in ``agentrl.__all__`` resolves, and importing agentrl is cheap."""

from __future__ import annotations

import subprocess
import sys

import agentrl


def test_every_public_name_resolves():
    for name in agentrl.__all__:
        assert getattr(agentrl, name) is not None, name


def test_unknown_attribute_raises_attribute_error():
    try:
        agentrl.NoSuchThing  # noqa: B018
    except AttributeError as exc:
        assert "no attribute 'NoSuchThing'" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_every_error_in_the_errors_module_is_public():
    import agentrl.errors as errors

    assert set(errors.__all__) <= set(agentrl.__all__)
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.AgentrlError)


def test_import_agentrl_does_not_import_torch_or_ray():
    code = "import sys, agentrl, agentrl.cli; print('torch' in sys.modules, 'ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
