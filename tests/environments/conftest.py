"""The environment tests import OpenEnv as agentrl's worker and server do: without its Gradio web
interface until something asks for it (``agentrl.environments.openenv_serve.import_openenv``),
before a test module imports ``openenv_fixture``."""

from agentrl.environments.openenv_serve import import_openenv

import_openenv()
