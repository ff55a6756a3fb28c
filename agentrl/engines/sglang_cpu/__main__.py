"""``python -m agentrl.engines.sglang_cpu build|status|path``: see ``env.py``."""

import sys

from agentrl.engines.sglang_cpu.env import cli_main

sys.exit(cli_main(sys.argv[1:]))
