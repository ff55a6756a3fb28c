"""The suite's own temporary directory, counted at the end: a leftover fails the run.

At start-up (in the controller, before xdist starts its workers, which inherit the environment)
the session makes a fresh directory under the machine's temporary directory and points
``TMPDIR`` at it, so every test, every process it starts (``agentrl train``, servers) and Ray
(which keeps its sessions under ``$TMPDIR/ray``) write their temporary files there, apart from
other programs on the machine (torch's compile cache stays in the machine's temporary directory,
where torch keeps it by default: it is meant to outlive the run). At the end the session counts what is left in it, apart from
pytest's own ``tmp_path`` tree (``pytest-of-<user>``, kept and pruned by pytest as usual) and
``ray`` (Ray's session directories: Ray never removes them, and every cluster the tests started
has been shut down by then), then removes the whole directory. Any other entry is a leftover:
the run fails, naming each one.

Imported by ``tests/conftest.py``; a module of its own so that ``tests/test_tmp_hygiene.py`` can
run the rule in a fresh pytest.
"""

from __future__ import annotations

import getpass
import os
import shutil
import tempfile
from pathlib import Path

import pytest

KEY = pytest.StashKey[Path]()
EXPECTED = ("pytest-of-", "ray")  # pytest's tmp_path tree and Ray's session directories


def _is_controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput")  # an xdist worker has workerinput


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    if not _is_controller(config):
        return
    # torch's compile cache stays where torch keeps it by default (a cache shared between runs)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"))
    # short: Ray and SGLang put unix sockets under it, whose paths may not exceed 107 bytes
    private = Path(tempfile.mkdtemp(prefix="arl-"))
    config.stash[KEY] = private
    os.environ["TMPDIR"] = str(private)
    tempfile.tempdir = None  # gettempdir() caches its answer: read TMPDIR again


def leftovers(private: Path) -> list[str]:
    return sorted(p.name for p in private.iterdir() if not p.name.startswith(EXPECTED))


@pytest.hookimpl(hookwrapper=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int):
    yield
    private = session.config.stash.get(KEY, None)
    if private is None or not private.is_dir():
        return
    found = leftovers(private)
    if found:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = (f"LEFTOVERS: the test session left {len(found)} entr{'y' if len(found) == 1 else 'ies'} in its "
                   f"temporary directory {private}: {', '.join(found)}")
        if reporter is not None:
            reporter.write_sep("=", message, red=True, bold=True)
        if session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    private = config.stash.get(KEY, None)
    if private is not None:
        shutil.rmtree(private, ignore_errors=True)
