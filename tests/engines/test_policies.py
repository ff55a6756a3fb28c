"""Several policies in one engine (engines/policies.py): each request is sampled by the weights of
the policy it names, and each policy has its own weight version (docs/roles.md, trained roles)."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.engines.base import GenerateRequest, SamplingParams
from agentrl.engines.builtin import BuiltinEngine
from agentrl.engines.policies import PolicyEngines
from agentrl.engines.weights import read_checkpoint
from enginetest import load_reference, reference_greedy

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

PROMPT = [5, 17, 42, 99, 3, 64, 128, 7]


def greedy(prompt: list[int], policy: str = "", rid: str | None = None) -> GenerateRequest:
    return GenerateRequest(list(prompt), SamplingParams(max_new_tokens=12, temperature=0.0), rid=rid, policy=policy)


@pytest.fixture
def engines(model_dir, other_model_dir):
    """The main policy on model A, the verifier's own policy on model B."""
    engines = PolicyEngines({"": BuiltinEngine(model_dir, max_batch_size=4, steps_on="event_loop"),
                             "verifier": BuiltinEngine(other_model_dir, max_batch_size=4, steps_on="event_loop")})
    yield engines
    engines.close()


async def test_each_request_is_sampled_by_the_weights_of_its_policy(engines, model_dir, other_model_dir):
    expected_a = reference_greedy(load_reference(model_dir), PROMPT, 12)
    expected_b = reference_greedy(load_reference(other_model_dir), PROMPT, 12)
    assert expected_a != expected_b  # the two policies answer differently: the routing is seen
    # both policies' requests in flight together, on one event loop
    main, verifier = await asyncio.gather(engines.generate(greedy(PROMPT)), engines.generate(greedy(PROMPT, "verifier")))
    assert main.output_ids == expected_a
    assert verifier.output_ids == expected_b
    assert (main.weight_version, verifier.weight_version) == (0, 0)


async def test_a_weight_update_moves_only_its_policys_version(engines, model_dir, other_model_dir):
    expected_a = reference_greedy(load_reference(model_dir), PROMPT, 12)
    await engines.update_weights(read_checkpoint(model_dir), version=5, policy="verifier")  # the verifier takes A's weights
    assert engines.weight_versions == {"": 0, "verifier": 5}
    assert engines.weight_version == 0
    main, verifier = await asyncio.gather(engines.generate(greedy(PROMPT)), engines.generate(greedy(PROMPT, "verifier")))
    assert verifier.output_ids == expected_a and verifier.weight_version == 5
    assert main.output_ids == expected_a and main.weight_version == 0
    await engines.update_weights(path=str(other_model_dir), version=1)  # the main policy's own update
    assert engines.weight_versions == {"": 1, "verifier": 5}


async def test_a_policy_nobody_serves_is_refused_naming_it(engines, model_dir):
    with pytest.raises(ValueError, match=r"no engine serves policy 'judge' \(served: '', 'verifier'\)"):
        await engines.generate(greedy(PROMPT, "judge"))
    with pytest.raises(ValueError, match="no engine serves policy 'judge'"):
        await engines.update_weights(path=str(model_dir), policy="judge")
    single = BuiltinEngine(model_dir, max_batch_size=2)
    try:  # one engine serves the main policy only: a named policy is not silently sampled by it
        with pytest.raises(ValueError, match="request names policy 'verifier'; this engine serves the main policy only"):
            await single.generate(greedy(PROMPT, "verifier"))
    finally:
        single.close()
