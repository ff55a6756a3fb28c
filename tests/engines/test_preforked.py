"""The engine process forked before the trainer's start-up (``engines/preforked.py``): the same
tokens as the in-process engine, handed out once and only where its OpenMP wait policy fits,
never forked by a process not marked fresh, reaped when nobody takes it, and forked by
``agentrl train`` only for a run that starts an engine process from the trainer's own."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from agentrl.config import load_config
from agentrl.engines import preforked
from agentrl.engines.base import GenerateRequest, SamplingParams
from agentrl.engines.builtin import BuiltinEngine
from agentrl.engines.process import EngineProcess
from agentrl.trainer.in_process import prefork_engine

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

PROMPT = [5, 17, 42, 99, 3, 64, 128, 7]


@pytest.fixture
def fresh(monkeypatch):
    """This test process as a fresh command: prefork allowed (the suite runs one OpenMP thread, so
    no thread team exists to be forked); any child left is discarded after the test."""
    monkeypatch.setattr(preforked, "_allowed", True)
    monkeypatch.setattr(preforked, "_waiting", None)
    yield
    preforked.discard()


async def test_the_forked_child_becomes_the_engine_process_and_samples_the_in_process_engines_tokens(fresh, model_dir):
    assert preforked.prefork()
    waiting = preforked._waiting
    assert waiting is not None and waiting.poll() is None  # forked, waiting for its model
    requests = [GenerateRequest(PROMPT, SamplingParams(max_new_tokens=12, temperature=0.0)),
                GenerateRequest(PROMPT[:5], SamplingParams(max_new_tokens=9, temperature=1.0, seed=7))]
    local = BuiltinEngine(model_dir, max_batch_size=2, seed=123)
    try:
        expected = [await local.generate(r) for r in requests]
    finally:
        local.close()
    engine = EngineProcess(model_dir, threads=1, max_batch_size=2, seed=123, start_timeout_s=60)
    try:
        assert engine.pid == waiting.pid and preforked._waiting is None  # taken, once
        got = [await engine.generate(r) for r in requests]
        assert [g.output_ids for g in got] == [e.output_ids for e in expected]
        for mine, theirs in zip(got, expected):
            assert mine.logprobs == pytest.approx(theirs.logprobs, abs=1e-5)
        assert engine.threads == 1
    finally:
        engine.close()
    assert waiting.returncode == 0  # ended by close and reaped
    assert preforked.take(threads=1, wait_policy="PASSIVE") is None


def test_a_team_of_threads_gets_the_child_only_with_the_wait_policy_torch_loaded_with(fresh):
    assert preforked.prefork()
    child = preforked._waiting
    loaded = os.environ.get("OMP_WAIT_POLICY", "")
    other = "ACTIVE" if loaded == "PASSIVE" else "PASSIVE"
    assert preforked.take(threads=2, wait_policy=other) is None  # libgomp read its policy once
    assert preforked.take(threads=2, wait_policy=loaded) is child
    assert preforked.take(threads=1, wait_policy=loaded) is None  # handed out once
    preforked._waiting = child
    preforked.discard()  # nobody's: its socket closes, it exits, it is reaped
    assert child.returncode == 0 and preforked._waiting is None


def test_one_thread_takes_the_child_whatever_the_wait_policy(fresh):
    assert preforked.prefork()
    child = preforked._waiting
    assert preforked.take(threads=1, wait_policy="SOMETHING ELSE") is child
    preforked._waiting = child


def test_a_process_not_marked_fresh_never_forks(monkeypatch):
    monkeypatch.setattr(preforked, "_allowed", False)
    monkeypatch.setattr(preforked, "_waiting", None)
    assert not preforked.prefork()
    assert preforked._waiting is None


@pytest.mark.parametrize(("overrides", "forks"), [
    (["rollout.max_staleness=4"], True),  # asynchronous: the engine in its own process by default
    (["rollout.max_staleness=0"], False),  # the synchronous trainer's engine is in its own process
    (["rollout.max_staleness=0", "engine.process=true"], True),
    (["rollout.max_staleness=4", "engine.process=false"], False),
    (["rollout.max_staleness=4", "trainer.workers=ray"], False),  # the engine process starts in a worker
])
def test_agentrl_train_forks_the_engine_only_for_a_run_that_starts_one_from_its_own_process(monkeypatch, overrides, forks):
    calls = []
    monkeypatch.setattr(preforked, "prefork", lambda: calls.append(1) or True)
    assert prefork_engine(load_config("train", overrides)) is forks
    assert calls == ([1] if forks else [])


def test_a_ctrl_c_reaching_the_waiting_child_leaves_the_ending_to_the_parent(fresh):
    assert preforked.prefork()
    child = preforked._waiting
    os.kill(child.pid, signal.SIGINT)  # the terminal signals the whole process group
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.3)  # still waiting for its model
    preforked.discard()
    assert child.returncode == 0
