"""Ray for the trainer's worker groups: starting it for a job, the resources and bundles each
group takes (``WorkerGroup``'s arguments), and the threads and environment of a worker process.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.config.schema import TrainConfig

if TYPE_CHECKING:
    from agentrl.trainer.groups import WorkerGroup

__all__ = ["group_resources", "init_local_ray", "placed", "plan_groups", "ranks_take_gpus", "threads_per_worker", "worker_env"]


def ranks_take_gpus(device: str) -> bool:
    """Whether the trainer's ranks reserve GPUs: ``trainer.device=cuda``, or ``auto`` on a Ray
    cluster that has GPUs (asked of the cluster: the driver's own node may have none)."""
    import ray

    if device == "cpu":
        return False
    return device == "cuda" or ray.cluster_resources().get("GPU", 0) > 0


# CPU each rank of the reference and critic groups reserves: they compute between the actor's
# phases, never beside it, so they take a token share of the node's cores
_SIDE_CPUS = 0.01


def group_resources(*, gpus: bool, actor_cpus: float, actor_ranks: int, reference: bool,
                    critic_ranks: int | None) -> dict[str, dict[str, Any]]:
    """``WorkerGroup`` resource arguments for the actor, reference and critic groups (those that
    exist; ``critic_ranks`` None: no critic). The reference's rank r, and the critic's when it has
    as many ranks as the actor, run in the actor's bundle r (``colocate``: the caller passes
    ``colocate_with=<actor group>``): on GPUs each bundle is one device, which they share by
    fractions, as verl colocates its roles; a critic of another size reserves its own devices."""
    colocated = (["reference"] if reference else []) + (["critic"] if critic_ranks == actor_ranks else [])
    share = 1.0 / (1 + len(colocated)) if gpus else 0.0
    plan = {"actor": {"num_cpus": actor_cpus, "num_gpus": share,
                      "bundle": {"CPU": actor_cpus + _SIDE_CPUS * len(colocated), **({"GPU": 1.0} if gpus else {})}}}
    for name in colocated:
        plan[name] = {"num_cpus": _SIDE_CPUS, "num_gpus": share, "colocate": True}
    if critic_ranks is not None and "critic" not in colocated:
        plan["critic"] = {"num_cpus": _SIDE_CPUS, "num_gpus": 1.0 if gpus else 0.0, "colocate": False}
    return plan


def plan_groups(cfg: Any, actor_cpus: float) -> dict[str, dict[str, Any]]:
    """``group_resources`` for a training config's groups (its device, ranks, reference, critic)."""
    return group_resources(gpus=ranks_take_gpus(cfg.trainer.device), actor_cpus=actor_cpus, actor_ranks=cfg.actor.world_size,
                           reference=cfg.use_reference, critic_ranks=cfg.critic.world_size if cfg.critic.enable else None)


def placed(plan: dict[str, dict[str, Any]], name: str, actor: "WorkerGroup | None" = None) -> dict[str, Any]:
    """``WorkerGroup`` keyword arguments of group ``name`` of a ``group_resources`` plan (the
    colocated ones in ``actor``'s bundles); none for a group the plan leaves out (in-process)."""
    entry = dict(plan.get(name, {}))
    return {**entry, "colocate_with": actor} if entry.pop("colocate", False) else entry


def threads_per_worker(cfg: TrainConfig) -> int:
    """Torch threads of each training worker: ``trainer.threads_per_worker``; else
    ``OMP_NUM_THREADS`` where this process's environment sets it (whoever started the job bounded
    its threads: two jobs sharing a machine, a test suite on one worker per core); else the
    machine's cores shared by the actor's ranks (less the threads of a built-in engine in its own
    process, ``engine.threads``). Why the bound matters: two jobs whose threads
    together exceed the cores each ran several times slower than the two of them with one thread
    each, as each job's OpenMP threads spin while waiting (docs/benchmarks.md)."""
    if cfg.trainer.threads_per_worker:
        return cfg.trainer.threads_per_worker
    bound = os.environ.get("OMP_NUM_THREADS", "")
    if bound.isdigit() and int(bound) >= 1:
        return int(bound)
    cores = os.cpu_count() or 2
    if cfg.engine.backend == "builtin" and (cfg.engine.process if cfg.engine.process is not None else cfg.rollout.max_staleness > 0):
        from agentrl.engines.process import default_engine_threads  # the engine's own process takes its share

        cores = max(1, cores - (cfg.engine.threads or default_engine_threads()))
    return max(1, cores // cfg.actor.world_size)


def worker_env(threads: int) -> dict[str, str]:
    # RAY_AUTH_MODE must match the cluster's: workers take the driver's (see init_local_ray); the
    # OpenMP wait policy the driver chose (agentrl.cli.shared_machine_wait_policy) holds for them too
    keep = {k: v for k, v in os.environ.items() if k in ("PYTHONPATH", "AGENTRL_CACHE", "HF_HOME", "RAY_AUTH_MODE",
                                                               "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    # transformers' weight-loading and shard-writing bars off in workers (their output reaches the
    # driver's console through Ray), unless the driver's environment sets it
    quiet = os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    return {**keep, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_PROGRESS_BARS": quiet}


def init_local_ray(ship_code: str = "auto") -> bool:
    """Start Ray for this job unless it is already up; returns whether it was started here.

    Without ``RAY_ADDRESS`` this is a private cluster for this job, started with token
    authentication off (``RAY_AUTH_MODE=disabled``, unless the environment says otherwise):
    with Ray 2.60's default our own worker processes were refused and the job hung. The address
    is ``local`` (a new cluster) rather than Ray's default lookup, which would find the cluster
    file a killed Ray session left in ``$TMPDIR/ray`` and try to join that dead cluster.

    ``ship_code`` (``trainer.ship_code``): whether the job's runtime environment carries agentrl
    and the driver's plugins to every node (``shipping.py``); ``auto`` does when joining."""
    import ray

    from agentrl.trainer.shipping import job_runtime_env, should_ship

    if ray.is_initialized():
        return False
    joining = bool(os.environ.get("RAY_ADDRESS"))
    with tempfile.TemporaryDirectory(prefix="agentrl-ship-") as staging:  # uploaded by ray.init, then not needed
        runtime_env = job_runtime_env(Path(staging)) if should_ship(ship_code, joining) else None
        if joining:  # an existing cluster: its resources and auth are its own
            ray.init(log_to_driver=True, logging_level="ERROR", runtime_env=runtime_env)
            return True
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(address="local", num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=True,
                 logging_level="ERROR", runtime_env=runtime_env)
    return True
