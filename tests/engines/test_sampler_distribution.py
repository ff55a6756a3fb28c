"""The built-in engine's samples are draws from softmax(logits / T), restricted by top-k / top-p.

Agreement of the *reported* logprobs with a full forward (test_builtin.py) does not show that the
tokens are *drawn* from that distribution. Here thousands of tokens are sampled through the
engine's public API on every path it has (the first token, sampled from the prefill; decode
steps; a later turn after an observation, which reuses the retained prefix; the followers of a
group that copy their leader's prompt inside the step; requests batched with others and alone;
default and oneDNN linears) and tested against the distribution a separate full forward of the
same weights gives:

* at a fixed context (the first token after a prompt), the counts of each token against their
  expected counts: a multinomial chi-square test (cells of small expectation pooled);
* at every other token, whose context is its own sampled history, the randomised probability
  integral transform: with the kept tokens ordered by probability, a draw ``x`` maps to
  ``u = P(before x) + V * P(x)`` (``V`` uniform, from the test's own generator). ``u`` is exactly
  uniform on [0, 1) when every token is drawn from its distribution, and the ``u`` of successive
  tokens are independent (the Rosenblatt transform), so one chi-square test of the histogram of
  ``u`` checks every conditional distribution of a path at once; a sampler that is too sharp
  piles ``u`` near 0, too flat near 1; a token outside the top-k / top-p set fails outright;
* samples of one group: the ``u`` of two samples of one group at the same token, binned on a
  grid, must be independent (a chi-square test of the grid against uniform cells).

Every draw is seeded, so each p-value is a fixed number and the test cannot flake. With about 70 p-values
in the file at ALPHA each, a correct engine fails one by chance with probability under 1% (a draw
that then fails on every run until the seeds change); the deliberately biased samplers below
land orders of magnitude under ALPHA.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
import torch

from agentrl.engines._packed import OneDNNLinear
from agentrl.engines.base import GenerateRequest, SamplingParams
from agentrl.engines.builtin import BuiltinEngine
from enginetest import VOCAB, load_reference

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

ALPHA = 1e-4  # per p-value
PROMPTS = ([30, 31, 32, 33, 34, 35, 36, 37, 38, 39], [5, 17, 42, 99, 3, 64, 128, 7])  # the fixed contexts
GROUP = 8  # samples per prompt, submitted together (a GRPO group)
GROUPS_PER_BATCH = 4
OBSERVATION = [77, 78, 79]  # the tool's answer between two turns
TURN1_TOKENS = 4
TURN2_TOKENS = 3
UNIFORM_BINS = 10
PAIR_BINS = 4


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_k: int = -1
    top_p: float = 1.0

    def params(self, max_new_tokens: int, seed: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, seed=seed)


# T = 1 and 0.6, unfiltered and with each filter biting (top-k 20 keeps 58% of the mass at T = 1
# after the first prompt, top-p 0.8 at T = 0.6 about 15 tokens of 256)
SAMPLINGS = {
    "T1": Sampling(1.0),
    "T0.6": Sampling(0.6),
    "T1-topk20": Sampling(1.0, top_k=20),
    "T0.6-topp0.8": Sampling(0.6, top_p=0.8),
}


@dataclass
class Draws:
    """Sampled sequences, each token labelled with the path that sampled it."""

    sequences: list[tuple[list[int], list[int], str, str]] = field(default_factory=list)  # (input, output, path of token 0, of the rest)
    groups: list[list[int]] = field(default_factory=list)  # indices into sequences: the turn-1 samples of one group


async def _submit_together(engine: BuiltinEngine, requests: list[GenerateRequest]) -> list:
    """All requests queued before the worker takes any (as test_builtin.submitted_together)."""
    with engine._cv:
        tasks = [asyncio.create_task(engine.generate(r)) for r in requests]
        while len(engine._inbox) < len(requests):
            await asyncio.sleep(0)
    return await asyncio.gather(*tasks)


async def _sample_groups(engine: BuiltinEngine, sampling: Sampling, batches: int, *, shared_seed: bool = False) -> Draws:
    """Groups of GROUP samples of one prompt, GROUPS_PER_BATCH groups submitted together: turn 1,
    then every sample's next turn after the observation, submitted together again."""
    draws = Draws()
    seed = 0
    for batch in range(batches):
        requests = []
        for g in range(GROUPS_PER_BATCH):
            prompt = PROMPTS[(batch * GROUPS_PER_BATCH + g) % len(PROMPTS)]
            for i in range(GROUP):
                seed += 1
                group_seed = 10_000 * (batch * GROUPS_PER_BATCH + g)
                requests.append(GenerateRequest(prompt, sampling.params(TURN1_TOKENS, group_seed if shared_seed else seed)))
        results = await _submit_together(engine, requests)
        first = len(draws.sequences)
        for k, (request, result) in enumerate(zip(requests, results)):
            leader = k % GROUP == 0
            draws.sequences.append((request.input_ids, result.output_ids, "first/leader" if leader else "first/follower",
                                    "decode/leader" if leader else "decode/follower"))
        draws.groups += [list(range(first + g * GROUP, first + (g + 1) * GROUP)) for g in range(GROUPS_PER_BATCH)]
        later = []
        for request, result in zip(requests, results):
            seed += 1
            later.append(GenerateRequest(request.input_ids + result.output_ids + OBSERVATION, sampling.params(TURN2_TOKENS, seed)))
        for request, result in zip(later, await _submit_together(engine, later)):
            assert result.cached_tokens > 0  # the retained prefix was reused
            draws.sequences.append((request.input_ids, result.output_ids, "later-turn/first", "later-turn/decode"))
    return draws


async def _sample_alone(engine: BuiltinEngine, sampling: Sampling, requests: int) -> Draws:
    """One request at a time: nothing else in its steps."""
    draws = Draws()
    for k in range(requests):
        prompt = PROMPTS[k % len(PROMPTS)]
        result = await engine.generate(GenerateRequest(prompt, sampling.params(TURN1_TOKENS, 500_000 + k)))
        draws.sequences.append((prompt, result.output_ids, "first/alone", "decode/alone"))
    return draws


def _kept_distribution(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """softmax(logits / T) restricted by top-k and top-p (a token is kept while the mass of the
    more probable tokens before it is <= top_p, SGLang's rule) and renormalised. [rows, vocab]"""
    probs = torch.softmax(logits.double() / sampling.temperature, dim=-1)
    ordered, order = probs.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(probs.shape[-1])[None, :]
    keep = (ordered.cumsum(-1) - ordered <= sampling.top_p + 1e-12) & ((sampling.top_k < 0) | (rank < sampling.top_k))
    kept = torch.zeros_like(probs).scatter(1, order, ordered * keep)
    return kept / kept.sum(-1, keepdim=True)


@torch.no_grad()
def _reference_distributions(reference, draws: Draws, sampling: Sampling) -> list[torch.Tensor]:
    """Per sequence, the kept distribution at each of its sampled tokens: [outputs, vocab]. One
    forward over all sequences, right-padded (causal: padding after a token cannot change it)."""
    full = [inp + out for inp, out, _, _ in draws.sequences]
    width = max(map(len, full))
    batch = torch.tensor([seq + [0] * (width - len(seq)) for seq in full])
    logits = reference(batch).logits.float()
    out = []
    for row, (inp, outp, _, _) in enumerate(draws.sequences):
        out.append(_kept_distribution(logits[row, len(inp) - 1 : len(inp) - 1 + len(outp)], sampling))
    return out


def _pit(dists: torch.Tensor, tokens: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Randomised probability integral transform of each token under its distribution, the
    tokens ordered by probability, most probable first. dists [m, vocab], tokens [m], v [m]."""
    p = dists.gather(1, tokens[:, None])  # [m, 1]
    removed = (p[:, 0] == 0).nonzero()
    assert removed.numel() == 0, f"token {int(tokens[removed[0, 0]])} was sampled though top-k / top-p removes it"
    before = (dists * (dists > p)).sum(-1)  # [m]
    return before + v * p[:, 0]


def _chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """p-value of Pearson's chi-square statistic, df = cells - 1."""
    observed, expected = observed.double(), expected.double()
    statistic = ((observed - expected) ** 2 / expected).sum()
    df = observed.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), statistic / 2))


def _uniformity_p(values: list[float], bins: int = UNIFORM_BINS) -> float:
    counts = torch.histc(torch.tensor(values, dtype=torch.float64), bins=bins, min=0.0, max=1.0)
    return _chi_square_p(counts, torch.full((bins,), len(values) / bins, dtype=torch.float64))


def _multinomial_p(tokens: list[int], dist: torch.Tensor) -> float:
    """Counts of each token at one context against len(tokens) * dist; cells expected to hold
    fewer than 5 draws are pooled into one (with the tokens the filters removed, expected 0)."""
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
    expected = dist * len(tokens)
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    if expected[-1] == 0:
        assert observed[-1] == 0, "a token the filters remove was sampled"
        observed, expected = observed[:-1], expected[:-1]
    assert observed.numel() >= 3, f"too few draws ({len(tokens)}) for a test at this context"
    return _chi_square_p(observed, expected)


@dataclass
class Verdict:
    pit_p: dict[str, float]  # path -> p-value of the uniformity of u
    first_token_p: dict[str, float]  # "prompt k" -> multinomial p-value of the batched first tokens at that context
    pairs_p: float  # independence of two samples of one group
    draws: int


def _judge(reference, draws: Draws, sampling: Sampling) -> Verdict:
    dists = _reference_distributions(reference, draws, sampling)
    lengths = [len(out) for _, out, _, _ in draws.sequences]
    tokens = torch.tensor([t for _, out, _, _ in draws.sequences for t in out])
    v = torch.rand(len(tokens), generator=torch.Generator().manual_seed(1234), dtype=torch.float64)
    pits = _pit(torch.cat(dists), tokens, v).split(lengths)
    by_path: dict[str, list[float]] = {}
    first: dict[str, list[int]] = {}
    first_dists: dict[str, torch.Tensor] = {}
    for (inp, out, first_path, rest_path), dist, values in zip(draws.sequences, dists, pits):
        by_path.setdefault(first_path, []).append(float(values[0]))
        by_path.setdefault(rest_path, []).extend(values[1:].tolist())
        if first_path in ("first/leader", "first/follower"):  # a fixed context: the first token after a prompt
            key = f"prompt {PROMPTS.index(inp)}"
            first.setdefault(key, []).append(out[0])
            first_dists[key] = dist[0]
    cells = torch.zeros(PAIR_BINS, PAIR_BINS, dtype=torch.float64)
    for group in draws.groups:
        for a, b in zip(group[0::2], group[1::2]):
            for ua, ub in zip(pits[a].tolist(), pits[b].tolist()):
                cells[min(int(ua * PAIR_BINS), PAIR_BINS - 1), min(int(ub * PAIR_BINS), PAIR_BINS - 1)] += 1
    pairs_p = _chi_square_p(cells.flatten(), torch.full((PAIR_BINS**2,), float(cells.sum()) / PAIR_BINS**2, dtype=torch.float64)) if draws.groups else 1.0
    return Verdict(
        {k: _uniformity_p(v) for k, v in by_path.items()},
        {k: _multinomial_p(tokens, first_dists[k]) for k, tokens in first.items()},
        pairs_p,
        len(tokens),
    )


@pytest.fixture(scope="module")
def reference(model_dir):
    return load_reference(model_dir)


def _engine(model_dir, linears: str) -> BuiltinEngine:
    engine = BuiltinEngine(model_dir, max_batch_size=GROUP * GROUPS_PER_BATCH, seed=0)
    if linears == "onednn":
        engine._scheduler.forward.linear = OneDNNLinear(min_weight_elements=0)
    return engine


async def _collect(engine: BuiltinEngine, sampling: Sampling, *, batches: int = 32, alone: int = 160, shared_seed: bool = False) -> Draws:
    grouped = await _sample_groups(engine, sampling, batches, shared_seed=shared_seed)
    single = await _sample_alone(engine, sampling, alone)
    return Draws(grouped.sequences + single.sequences, grouped.groups)


@pytest.mark.parametrize(
    ("name", "linears"), [(name, "default") for name in SAMPLINGS] + [("T1", "onednn"), ("T0.6-topp0.8", "onednn")]
)
async def test_every_path_samples_the_kept_softmax_and_samples_of_a_group_are_independent(model_dir, reference, linears, name):
    sampling = SAMPLINGS[name]
    engine = _engine(model_dir, linears)
    try:
        draws = await _collect(engine, sampling)
    finally:
        engine.close()
    verdict = _judge(reference, draws, sampling)
    assert verdict.draws >= 7000
    assert set(verdict.pit_p) == {"first/leader", "first/follower", "decode/leader", "decode/follower", "later-turn/first",
                                  "later-turn/decode", "first/alone", "decode/alone"}
    assert len(verdict.first_token_p) == len(PROMPTS)
    failed = {k: p for k, p in {**verdict.pit_p, **verdict.first_token_p, "pairs in a group": verdict.pairs_p}.items() if p < ALPHA}
    assert not failed, f"{name}, {linears} linears: the samples do not follow the kept softmax on {failed}"


class _SharpenedForward:
    """The engine's forward with every logit scaled by ``factor``: a sampler at T / factor."""

    def __init__(self, forward, factor: float):
        self.forward, self.factor = forward, factor

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs) * self.factor

    def __getattr__(self, name):
        return getattr(self.forward, name)


async def test_a_sampler_at_half_the_temperature_fails_on_every_path(model_dir, reference):
    sampling = SAMPLINGS["T1"]
    engine = _engine(model_dir, "default")
    engine._scheduler.forward = _SharpenedForward(engine._scheduler.forward, 2.0)
    try:
        draws = await _collect(engine, sampling)
    finally:
        engine.close()
    verdict = _judge(reference, draws, sampling)
    assert max(verdict.pit_p.values()) < ALPHA, verdict.pit_p
    assert max(verdict.first_token_p.values()) < ALPHA, verdict.first_token_p


async def test_a_sampler_ten_percent_too_sharp_fails_where_thousands_of_tokens_were_drawn(model_dir, reference):
    sampling = SAMPLINGS["T1"]
    engine = _engine(model_dir, "default")
    engine._scheduler.forward = _SharpenedForward(engine._scheduler.forward, 1.1)
    try:
        draws = await _collect(engine, sampling, alone=0)
    finally:
        engine.close()
    verdict = _judge(reference, draws, sampling)
    assert verdict.pit_p["decode/follower"] < ALPHA, verdict.pit_p


async def test_a_sampler_that_ignores_top_p_fails(model_dir, reference):
    engine = _engine(model_dir, "default")
    try:
        draws = await _collect(engine, SAMPLINGS["T0.6"], batches=4, alone=0)
    finally:
        engine.close()
    with pytest.raises(AssertionError, match="top-k / top-p removes it"):
        _judge(reference, draws, SAMPLINGS["T0.6-topp0.8"])


async def test_samples_of_a_group_that_share_their_random_stream_fail_the_independence_test(model_dir, reference):
    sampling = SAMPLINGS["T1"]
    engine = _engine(model_dir, "default")
    try:
        draws = await _collect(engine, sampling, batches=8, alone=0, shared_seed=True)
    finally:
        engine.close()
    verdict = _judge(reference, draws, sampling)
    assert verdict.pairs_p < 1e-12
