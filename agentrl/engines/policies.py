"""Several policies served at once: one engine per policy, each request routed by the policy it names.

A role of a multi-agent episode marked ``trained`` (``agent.roles.<role>=trained``, docs/roles.md)
has weights of its own. ``PolicyEngines`` holds the main policy's engine (``""``) and one engine per
such role, each over its own copy of that policy's weights (full weights: the small-scale form
the roles' issue allows), with its own scheduler, prefix cache and **weight version**. A request
names its policy in ``GenerateRequest.policy``; the policy's engine samples it and reports its own
version. Weight updates name the policy they replace (``update_weights(..., policy=...)``), so
one policy's sync neither drains nor bumps another's.

The engines step independently (their models differ, so a step cannot batch them together);
with ``steps_on="event_loop"`` each runs as a task of the callers' event loop, between the others.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Mapping

from agentrl.engines.base import GenerateRequest, GenerateResult

if TYPE_CHECKING:
    import torch

__all__ = ["MAIN_POLICY", "PolicyEngines", "serves"]

MAIN_POLICY = ""  # the trained policy every shared role samples from


class PolicyEngines:
    """The ``Engine`` protocol over one engine per policy; the main policy's (``""``) answers the
    single-policy calls (``weight_version``, ``stats``, ``weights_changed``)."""

    def __init__(self, engines: Mapping[str, Any]):
        if MAIN_POLICY not in engines:
            raise ValueError("PolicyEngines needs the main policy's engine (key \"\")")
        self.engines = dict(engines)

    def engine(self, policy: str) -> Any:
        try:
            return self.engines[policy]
        except KeyError:
            served = ", ".join(repr(p) for p in self.engines)
            raise ValueError(f"no engine serves policy {policy!r} (served: {served})") from None

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        engine = self.engine(request.policy)
        return await engine.generate(dataclasses.replace(request, policy=MAIN_POLICY) if request.policy else request)

    async def abort(self, rid: str) -> None:
        for engine in self.engines.values():  # request ids are unique across the policies' engines
            await engine.abort(rid)

    async def abort_all(self) -> None:
        for engine in self.engines.values():
            await engine.abort_all()

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor] | None = None, *, path: str | None = None,
                             version: int | None = None, policy: str = MAIN_POLICY, **kwargs: Any) -> None:
        """Load new weights into ``policy``'s engine only; that policy's version moves on."""
        await self.engine(policy).update_weights(state_dict, path=path, version=version, **kwargs)

    async def weights_changed(self, *, version: int | None = None, policy: str = MAIN_POLICY) -> None:
        await self.engine(policy).weights_changed(version=version)

    async def flush_cache(self) -> None:
        for engine in self.engines.values():
            await engine.flush_cache()

    async def health(self) -> bool:
        return all([await engine.health() for engine in self.engines.values()])

    @property
    def weight_version(self) -> int:
        return self.engines[MAIN_POLICY].weight_version

    @property
    def weight_versions(self) -> dict[str, int]:
        """Each policy's version: what its next request runs under."""
        return {policy: engine.weight_version for policy, engine in self.engines.items()}

    def stats(self) -> Any:
        return self.engines[MAIN_POLICY].stats()

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()

    async def __aenter__(self) -> "PolicyEngines":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self.close()


def serves(engine: Any, policy: str) -> bool:
    """Whether ``engine`` samples requests naming ``policy`` (a single engine: the main policy only)."""
    return policy == MAIN_POLICY or (isinstance(engine, PolicyEngines) and policy in engine.engines)
