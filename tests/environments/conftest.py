"""The environment tests import OpenEnv as agentrl's processes do: without its Gradio web interface
until something asks for it (``agentrl.environments`` installs the import hook
``openenv_serve.defer_openenv_web_ui``), before a test module imports ``openenv_fixture``."""

import agentrl.environments  # noqa: F401
