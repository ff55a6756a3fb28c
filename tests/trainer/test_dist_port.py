"""A one-rank process group never races for its port: the port handed in may be taken by now."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap


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
