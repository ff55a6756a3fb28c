"""Before the first step every node must write the run directory: a two-node
``ray.cluster_utils.Cluster`` where the directory is writable, then one where it is not (a path
under a plain file), and the error names both nodes by id and the reason."""

from __future__ import annotations

import pytest

from agentrl.errors import CheckpointError
from agentrl.trainer.nodes import check_nodes_can_write

pytestmark = pytest.mark.ray


@pytest.mark.timeout(300)
def test_every_node_writes_the_run_directory_or_is_named(tmp_path):
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    second = cluster.add_node(num_cpus=1)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        run = tmp_path / "run"
        check_nodes_can_write([run, run / "checkpoints"])  # both nodes can: no error
        assert (run / "checkpoints").is_dir() and list(run.rglob(".agentrl-write-probe-*")) == []
        blocker = tmp_path / "a-file"
        blocker.write_text("")
        with pytest.raises(CheckpointError) as caught:
            check_nodes_can_write([run, blocker / "checkpoints"])
        message = str(caught.value)
        assert message.startswith("2 of 2 Ray node(s) cannot write the run directory")
        assert f"node {second.node_id[:12]} (" in message  # each node by its id and address
        assert f"node {cluster.head_node.node_id[:12]} (" in message
        assert f"cannot write {blocker / 'checkpoints'}:" in message
    finally:
        ray.shutdown()
        cluster.shutdown()
