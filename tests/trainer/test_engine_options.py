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
