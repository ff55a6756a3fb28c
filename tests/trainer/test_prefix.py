"""The shared-prompt forward: the same logprobs and gradients as a full forward of every row."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from agentrl.trainer.batch import TrainBatch
from agentrl.trainer.prefix import distinct_prompts
from agentrl.trainer.workers import response_logprobs


def make_batch(prompts: list[list[int]], responses: list[list[int]], observed: dict[int, list[int]] | None = None) -> TrainBatch:
    """Left-padded prompts, right-padded responses (batch.py's layout); ``observed[row]`` lists
    response positions that are tool output (attended, not trained)."""
    B, P, R = len(prompts), max(map(len, prompts)), max(map(len, responses))
    ids = torch.zeros(B, P + R, dtype=torch.long)
    attention = torch.zeros(B, P + R, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        ids[b, P - len(p) : P] = torch.tensor(p)
        ids[b, P : P + len(r)] = torch.tensor(r)
        attention[b, P - len(p) : P + len(r)] = 1
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    mask = attention[:, P:].float()
    for b, cols in (observed or {}).items():
        mask[b, cols] = 0.0
    zeros = torch.zeros(B, R)
    return TrainBatch(ids, attention, positions, mask, zeros, zeros, torch.zeros(B, R, dtype=torch.long),
                      torch.zeros(B, 1), torch.ones(B, dtype=torch.long), torch.zeros(B, dtype=torch.long), torch.zeros(B))


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def logprobs_and_grads(model, batch: TrainBatch, share: bool):
    model.zero_grad(set_to_none=True)
    logprobs, entropy = response_logprobs(model, batch, with_entropy=True, share_prompts=share)
    weights = torch.linspace(-1.0, 1.0, batch.response_length)  # a loss that weighs every token differently
    ((logprobs + 0.1 * entropy) * weights * batch.response_mask).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach() * batch.response_mask, grads


GROUP_A = [11, 12, 13, 14, 15, 16, 17]
GROUP_B = [21, 22, 23, 24]


def test_shared_prompt_forward_gives_the_full_forwards_logprobs_and_gradients(model):
    # Two groups of three samples (prompts of different lengths, so B's are left-padded), responses
    # of different lengths (right padding) and tool output inside two of them.
    batch = make_batch(
        [GROUP_A] * 3 + [GROUP_B] * 3,
        [[30, 31, 32, 33, 34], [40, 41, 42], [50, 51, 52, 53, 54], [60, 61], [70, 71, 72, 73, 74], [80, 81, 82, 83]],
        observed={2: [2, 3], 4: [1]},
    )
    full, full_grads = logprobs_and_grads(model, batch, share=False)
    shared, shared_grads = logprobs_and_grads(model, batch, share=True)
    torch.testing.assert_close(shared, full, atol=1e-5, rtol=0)
    assert full_grads.keys() == shared_grads.keys() and len(full_grads) > 0
    for name in full_grads:
        torch.testing.assert_close(shared_grads[name], full_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_each_distinct_prompt_goes_through_the_model_once(model):
    batch = make_batch([GROUP_A] * 3 + [GROUP_B] * 3, [[30, 31, 32]] * 6)
    seen: list[tuple[int, ...]] = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    try:
        response_logprobs(model, batch, share_prompts=True)
        shared = list(seen)
        seen.clear()
        response_logprobs(model, batch, share_prompts=False)
    finally:
        hook.remove()
    P, R = batch.prompt_length, batch.response_length
    assert shared == [(2, P), (6, R - 1)]  # 2 prompts once, then the 6 responses against their K/V
    assert seen == [(6, P + R)]


def test_one_token_responses_need_only_the_prompt_pass(model):
    batch = make_batch([GROUP_A] * 4, [[30], [31], [32], [33]])
    full, _ = logprobs_and_grads(model, batch, share=False)
    shared, _ = logprobs_and_grads(model, batch, share=True)
    torch.testing.assert_close(shared, full, atol=1e-5, rtol=0)


def test_rows_share_a_prompt_only_when_tokens_and_padding_agree():
    batch = make_batch([[5, 6], [7, 5, 6], [5, 6], [0, 5, 6], [7, 5, 6]], [[9]] * 5)
    # Row 3's prompt starts with token 0, the pad id: the same ids as rows 0 and 2 after left
    # padding, but its attention mask differs, so it is a prompt of its own.
    first, inverse = distinct_prompts(batch)
    groups = [int(first[i]) for i in inverse]
    assert groups == [0, 1, 0, 3, 1]
    assert sorted(first.tolist()) == [0, 1, 3]
