"""A process group's port may be taken by another process between the rendezvous picking it and
rank 0 binding it: one rank binds port 0 itself; several ranks start again on a new port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from agentrl.trainer.cluster import worker_env
from agentrl.trainer.groups import WorkerGroup
from agentrl.trainer.rank import Worker


def test_one_rank_joins_even_when_the_given_port_was_taken_meanwhile():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = textwrap.dedent(f"""
            import torch, torch.distributed as dist
            from agentrl.trainer.dist import init_distributed
            init_distributed(rank=0, world_size=1, master_addr="127.0.0.1", master_port={port}, device=torch.device("cpu"),
                             timeout_s=30)
            t = torch.ones(1)
            dist.all_reduce(t)
            print("joined", int(t.item()))
        """)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "joined 1"


class PortTakenOnce(Worker):
    """Rank 0 of the first start finds its port taken (it takes it itself, as another process
    would, before joining the group): the real EADDRINUSE of torch's TCPStore."""

    def __init__(self, *, marker: str, **dist_kwargs):
        self.holder = None
        if dist_kwargs["rank"] == 0 and not os.path.exists(marker):
            with open(marker, "w") as f:
                f.write(str(dist_kwargs["master_port"]))
            self.holder = socket.socket()
            self.holder.bind((dist_kwargs["master_addr"], dist_kwargs["master_port"]))
            self.holder.listen()
        super().__init__(**dist_kwargs)

    def world(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size()


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_two_ranks_start_again_on_a_new_port_when_theirs_was_taken(tmp_path):
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import tests/
    marker = tmp_path / "first-port"
    try:
        group = WorkerGroup(PortTakenOnce, world_size=2, num_cpus=0.5, env=worker_env(1), name="actor", device="cpu", seed=0,
                            collective_timeout_s=60.0, marker=str(marker))
        assert marker.is_file()  # the first start met the taken port
        assert group.call_all("world") == [2, 2]  # the second joined
        group.kill()
    finally:
        ray.shutdown()
