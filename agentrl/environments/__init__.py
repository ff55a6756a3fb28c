"""Environments users already have: verifiers environments, OpenEnv servers and TRL environment classes.

Each library has its own adapter module here (``verifiers``, ``openenv``, ``trl``), imported only
when a run names that library, so agentrl imports without any of them installed.
"""

from agentrl.environments.openenv_serve import defer_openenv_web_ui
from agentrl.environments.spec import LIBRARY_EXTRAS, LIBRARY_LOOPS, EnvironmentRef, cached, config_ref, resolve

defer_openenv_web_ui()  # an import hook: OpenEnv, when a run imports it, without its Gradio web interface

__all__ = ["EnvironmentRef", "LIBRARY_LOOPS", "LIBRARY_EXTRAS", "resolve", "cached", "config_ref"]
