"""Per-row sampling rules, checked against hand-computed distributions."""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.engines.sampling import sample_next_tokens

# softmax of these logits is [0.5, 0.3, 0.2]
LOGITS = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))


def sample(logits, temperature=1.0, top_p=1.0, top_k=None, u=0.0):
    n, vocab = logits.shape
    return sample_next_tokens(
        logits,
        torch.full((n,), temperature),
        torch.full((n,), top_p),
        torch.full((n,), top_k if top_k is not None else vocab, dtype=torch.int64),
        torch.full((n,), u),
    )


@pytest.mark.parametrize(("u", "token"), [(0.0, 0), (0.49, 0), (0.51, 1), (0.79, 1), (0.81, 2), (0.999, 2)])
def test_unfiltered_draw_inverts_the_cdf_in_vocabulary_order(u, token):
    tokens, logprobs = sample(LOGITS, u=u)
    assert tokens.tolist() == [token]
    assert logprobs.item() == pytest.approx(math.log([0.5, 0.3, 0.2][token]), abs=1e-6)


@pytest.mark.parametrize(("u", "token"), [(0.6, 0), (0.7, 1)])
def test_top_p_keeps_tokens_while_the_mass_before_them_is_within_top_p(u, token):
    # mass before: token 0 -> 0, token 1 -> 0.5, token 2 -> 0.8 > 0.6: kept {0, 1}, renormalised [0.625, 0.375]
    tokens, logprobs = sample(LOGITS, top_p=0.6, u=u)
    assert tokens.tolist() == [token]
    # the reported logprob is the unfiltered one (SGLang's convention)
    assert logprobs.item() == pytest.approx(math.log([0.5, 0.3][token]), abs=1e-6)


def test_top_k_one_always_picks_the_argmax():
    for u in (0.0, 0.5, 0.99):
        assert sample(LOGITS, temperature=2.0, top_k=1, u=u)[0].tolist() == [0]


def test_greedy_reports_the_untempered_log_softmax():
    tokens, logprobs = sample(LOGITS * 3, temperature=0.0, u=0.99)
    assert tokens.tolist() == [0]
    assert logprobs.item() == pytest.approx(torch.log_softmax(LOGITS[0] * 3, -1)[0].item(), abs=1e-6)


def test_temperature_scales_the_reported_logprob():
    tokens, logprobs = sample(LOGITS, temperature=0.5, u=0.0)
    # p ∝ [0.5², 0.3², 0.2²] = [0.25, 0.09, 0.04] / 0.38
    assert tokens.tolist() == [0]
    assert logprobs.item() == pytest.approx(math.log(0.25 / 0.38), abs=1e-6)


def test_a_rows_draw_does_not_depend_on_the_other_rows():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    temperatures = torch.tensor([1.0, 0.7, 0.0, 1.2, 1.0, 0.9])
    top_ps = torch.tensor([1.0, 0.8, 1.0, 1.0, 0.5, 1.0])
    top_ks = torch.tensor([50, 50, 50, 5, 50, 50])
    uniforms = torch.rand(6)
    together = sample_next_tokens(logits, temperatures, top_ps, top_ks, uniforms)
    for row in range(6):
        alone = sample_next_tokens(logits[row : row + 1], temperatures[row : row + 1], top_ps[row : row + 1], top_ks[row : row + 1], uniforms[row : row + 1])
        assert alone[0].item() == together[0][row].item()
        assert alone[1].item() == pytest.approx(together[1][row].item(), abs=1e-6)
