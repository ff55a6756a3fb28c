"""On a Ray cluster with GPUs every trainer rank reserves one: Ray then gives the rank that
device alone (``CUDA_VISIBLE_DEVICES``), where a rank that asks for none is given every device of
its node and picks the first, so two ranks of a node would share GPU 0 (NCCL refuses). The
reference's and critic's rank r share the actor's rank r's GPU (fractions of its bundle).

The cluster here declares two GPUs that the machine does not have (Ray counts resources; it does
not look for devices), and stand-in workers report what Ray assigned them."""

from __future__ import annotations

import os
import time

import pytest

from agentrl.trainer.cluster import group_resources, ranks_take_gpus
from agentrl.trainer.groups import WorkerGroup

pytestmark = pytest.mark.ray


class DeviceProbe:
    """Stands in for a worker class: takes the group's arguments, reports its devices."""

    def __init__(self, **_: object):
        pass

    def ready(self) -> int:
        return 0

    def devices(self) -> tuple[list[str], str | None]:
        import ray

        return [str(i) for i in ray.get_gpu_ids()], os.environ.get("CUDA_VISIBLE_DEVICES")


def test_the_plan_puts_reference_and_critic_in_the_actors_bundles():
    plan = group_resources(gpus=True, actor_cpus=0.5, actor_ranks=2, reference=True, critic_ranks=2)
    assert plan["actor"] == {"num_cpus": 0.5, "num_gpus": pytest.approx(1 / 3), "bundle": {"CPU": 0.52, "GPU": 1.0}}
    assert plan["reference"] == plan["critic"] == {"num_cpus": 0.01, "num_gpus": pytest.approx(1 / 3), "colocate": True}
    # a critic of another size cannot share the actor's bundles: its own devices
    plan = group_resources(gpus=True, actor_cpus=0.5, actor_ranks=2, reference=False, critic_ranks=1)
    assert plan["actor"]["num_gpus"] == 1.0 and plan["actor"]["bundle"] == {"CPU": 0.5, "GPU": 1.0}
    assert plan["critic"] == {"num_cpus": 0.01, "num_gpus": 1.0, "colocate": False}
    # on CPUs nothing asks for a GPU
    plan = group_resources(gpus=False, actor_cpus=1.0, actor_ranks=1, reference=True, critic_ranks=None)
    assert plan == {"actor": {"num_cpus": 1.0, "num_gpus": 0.0, "bundle": {"CPU": 1.01}},
                    "reference": {"num_cpus": 0.01, "num_gpus": 0.0, "colocate": True}}


@pytest.mark.timeout(180)
def test_each_rank_gets_its_own_gpu_and_colocated_ranks_share_it():
    import sys

    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test file
    ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)
    try:
        assert ranks_take_gpus("auto") and ranks_take_gpus("cuda") and not ranks_take_gpus("cpu")
        plan = group_resources(gpus=True, actor_cpus=0.5, actor_ranks=2, reference=True, critic_ranks=2)
        actor = WorkerGroup(DeviceProbe, world_size=2, env={}, name="actor", **plan["actor"])
        side = {name: WorkerGroup(DeviceProbe, world_size=2, env={}, name=name, colocate_with=actor,
                                  num_cpus=plan[name]["num_cpus"], num_gpus=plan[name]["num_gpus"])
                for name in ("reference", "critic")}
        mine = actor.call_all("devices")
        assert sorted(ids[0] for ids, _ in mine) == ["0", "1"]  # one device per rank, not both on GPU 0
        assert [visible for _, visible in mine] == [ids[0] for ids, _ in mine]  # and only that device is visible
        for group in side.values():
            assert group.call_all("devices") == mine  # rank r beside the actor's rank r, on its GPU
        for group in (*side.values(), actor):
            group.kill()
        deadline = time.monotonic() + 20  # the actor's bundles go with it (Ray frees them asynchronously)
        while ray.available_resources().get("GPU") != 2.0:
            assert time.monotonic() < deadline, ray.available_resources()
            time.sleep(0.1)
    finally:
        ray.shutdown()
