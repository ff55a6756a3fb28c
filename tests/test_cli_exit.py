"""The ``agentrl`` console script ends its process without the interpreter's last garbage
collection passes (``agentrl.cli.console_main``), and still exits with the command's code,
runs the atexit handlers and flushes what was written."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

PROBE = """
import atexit, gc, sys
from pathlib import Path
from agentrl.cli import console_main
marker = Path(sys.argv[1])
atexit.register(lambda: marker.write_text("atexit ran"))
sys.argv = ["agentrl", "no-such-command"]
code = console_main()
print("frozen", gc.get_freeze_count(), end="")  # no newline: the flush at exit must still send it
sys.exit(code)
"""


def test_the_console_script_is_console_main():
    (script,) = entry_points(group="console_scripts", name="agentrl")
    assert script.value == "agentrl.cli:console_main"


def test_console_main_keeps_the_exit_code_the_atexit_handlers_and_the_output(tmp_path):
    marker = tmp_path / "marker"
    done = subprocess.run([sys.executable, "-c", PROBE, str(marker)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr  # main's code for an unknown command
    assert "unknown command 'no-such-command'" in done.stderr
    frozen = int(done.stdout.removeprefix("frozen "))
    assert frozen > 1000  # every object alive at the end is left to the OS, not collected one by one
    assert marker.read_text() == "atexit ran"
