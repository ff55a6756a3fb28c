"""The trainer builds its built-in engine with the options the config gives (engine.decode_graphs)."""

import types

import torch

import agentrl.engines.builtin as builtin
from agentrl.agent.setup import RolloutSetup
from agentrl.config import load_config
from agentrl.trainer.workers import ActorWorker


def test_the_actor_builds_its_engine_with_the_configs_decode_graphs(monkeypatch):
    seen = {}

    class Recorder:
        def __init__(self, model, **options):
            seen.update(options)

    monkeypatch.setattr(builtin, "BuiltinEngine", Recorder)
    for value in (True, False, None):
        cfg = load_config("train", [f"engine.decode_graphs={'null' if value is None else str(value).lower()}"])
        setup = RolloutSetup.from_config(cfg)
        worker = types.SimpleNamespace(model=torch.nn.Linear(2, 2), lora=None, param_dtype=torch.float32,
                                       device=torch.device("cpu"), model_path="/m")
        ActorWorker._builtin_engine(worker, setup)
        assert seen["decode_graphs"] is value


def test_no_worker_class_has_a_coroutine_method():
    # Ray runs every method of an actor class with one `async def` method on an event loop, where
    # the workers' own asyncio.run (rollouts, weight syncs) fails: a CI run's Ray trainings all died so
    import inspect

    from agentrl.trainer.workers import CriticWorker, ReferenceWorker

    for cls in (ActorWorker, ReferenceWorker, CriticWorker):
        coroutines = [name for name, member in inspect.getmembers(cls) if inspect.iscoroutinefunction(member)]
        assert coroutines == [], f"{cls.__name__}: {coroutines}"


def test_asynchronous_training_puts_the_engine_in_a_process_of_its_own_with_its_threads(monkeypatch):
    import agentrl.engines.process as process

    built = []

    class Recorder:
        def __init__(self, model, **options):
            built.append((type(self).__name__, options))

    class EngineProcess(Recorder):
        pass

    class BuiltinEngine(Recorder):
        pass

    monkeypatch.setattr(process, "EngineProcess", EngineProcess)
    monkeypatch.setattr(builtin, "BuiltinEngine", BuiltinEngine)
    worker = types.SimpleNamespace(model=torch.nn.Linear(2, 2), lora=None, param_dtype=torch.float32,
                                   device=torch.device("cpu"), model_path="/m")
    for overrides in (["rollout.max_staleness=1", "rollout.partial=true", "engine.threads=3", "engine.sync_timeout_s=7"],
                      ["rollout.max_staleness=1", "engine.process=false"], [], ["engine.process=true"]):
        setup = RolloutSetup.from_config(load_config("train", overrides))
        ActorWorker._builtin_engine(worker, setup)
    (kind, options), (off, _), (sync, _), (forced, forced_options) = built
    assert kind == "EngineProcess" and (options["threads"], options["sync_timeout_s"], options["partial"]) == (3, 7.0, True)
    assert (off, sync, forced) == ("BuiltinEngine", "BuiltinEngine", "EngineProcess") and forced_options["partial"] is False


def test_the_trainers_default_threads_leave_the_engine_process_its_share(monkeypatch):
    from agentrl.trainer.cluster import threads_per_worker

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert threads_per_worker(load_config("train", [])) == 16  # synchronous: the engine steps on the trainer's threads
    assert threads_per_worker(load_config("train", ["rollout.max_staleness=1"])) == 8  # half each
    assert threads_per_worker(load_config("train", ["rollout.max_staleness=1", "engine.threads=4"])) == 12
    cfg = load_config("train", ["rollout.max_staleness=1", "engine.threads=2"])
    assert RolloutSetup.from_config(cfg).engine_threads == 2
    assert RolloutSetup.from_config(load_config("train", ["rollout.max_staleness=1"])).engine_threads == 8
