"""A hang becomes an error: one rank sleeps while the other waits in a collective.

Real Ray actors, a real gloo group with a short ``collective_timeout_s``: the waiting rank's
all-reduce times out, the driver gives up on the sleeping rank within the timeout (plus the
stack dump's grace), and the error names the group, the call, the rank that did not answer and
the file holding its Python stack, which shows where it was."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from agentrl.trainer.cluster import worker_env
from agentrl.trainer.groups import CollectiveTimeout, WorkerGroup
from agentrl.trainer.workers import ReferenceWorker

pytestmark = pytest.mark.ray

TIMEOUT_S = 4.0


class StallingWorker(ReferenceWorker):
    """A reference worker with a test-only call: rank ``sleeper`` sleeps before its all-reduce."""

    def stall(self, sleeper: int, seconds: float) -> float:
        import torch.distributed as dist

        if self.rank == sleeper:
            time.sleep(seconds)
        total = torch.ones(1)
        dist.all_reduce(total)
        return float(total)


@pytest.mark.timeout(300)
def test_a_rank_that_never_joins_the_collective_is_an_error_with_its_stack(tiny_model_dir, tmp_path):
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import tests/
    try:
        group = WorkerGroup(
            StallingWorker, world_size=2, num_cpus=0.5, env=worker_env(1), name="reference",
            model_path=str(tiny_model_dir), device="cpu", seed=0, collective_timeout_s=TIMEOUT_S,
            stacks_dir=str(tmp_path / "stacks"),
        )
        assert group.call_all("stall", -1, 0.0) == [2.0, 2.0]
        group.during = "step 3 of 6"  # what the driver sets before each step (Trainer.during)  # no sleeper: the collective completes
        assert list((tmp_path / "stacks").glob("*")) == []  # calls that returned leave no stack file
        started = time.monotonic()
        with pytest.raises(CollectiveTimeout) as caught:
            group.call_all("stall", 1, 10 * TIMEOUT_S)
        waited = time.monotonic() - started
        assert waited < 2 * TIMEOUT_S + 5, f"the hang took {waited:.1f} s to become an error"
        message = str(caught.value)
        stacks = tmp_path / "stacks" / "reference-rank1-stacks.txt"
        assert message.startswith("step 3 of 6: reference group: `stall` hangs:")  # when, which group, which call
        assert f"reference group: `stall` hangs: rank(s) [1] of 2 did not answer within {TIMEOUT_S:g} s of rank(s) [0]" in message
        assert "rank 0 failed:" in message  # its all-reduce timed out (gloo's timeout)
        assert str(stacks) in message
        dump = stacks.read_text()
        assert dump.startswith("rank 1 (pid ")
        assert "in `stall`" in dump
        assert "line" in dump and "in stall" in dump  # faulthandler's frame: the sleeping line of stall
        # the group's collectives no longer line up: later calls fail at once instead of hanging
        started = time.monotonic()
        with pytest.raises(CollectiveTimeout, match="step 3 of 6: reference group: not calling `ready`, the group is broken"):
            group.call_all("ready")
        assert time.monotonic() - started < 1.0
        group.kill()
    finally:
        ray.shutdown()


def test_the_watchdog_dumps_a_slow_call_and_keeps_the_file_only_when_it_fails(tmp_path):
    """In-process ``Worker.call`` with a 0.2 s timeout: faulthandler writes the stack of a call
    still running after 0.2 s; the file goes when the call returns, stays when it raises."""
    from agentrl.trainer.rank import Worker

    class Slow(Worker):
        def __init__(self):  # no process group: only the watchdog is under test
            self.rank, self.collective_timeout_s, self.autocast_dtype = 3, 0.2, None

        def slow_return(self) -> int:
            time.sleep(0.6)
            return 7

        def slow_failure(self) -> None:
            time.sleep(0.6)
            raise RuntimeError("collective timed out")

    worker, path = Slow(), tmp_path / "deep" / "stacks.txt"
    assert worker.call("slow_return", str(path)) == 7
    assert not path.exists()
    with pytest.raises(RuntimeError, match="collective timed out"):
        worker.call("slow_failure", str(path))
    dump = path.read_text()
    assert dump.startswith("rank 3 (pid ") and "in `slow_failure`" in dump
    assert "in slow_failure" in dump  # the frame faulthandler saw while the call slept
