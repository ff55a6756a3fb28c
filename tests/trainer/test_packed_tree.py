"""The packed forward computes a micro-batch as prefix trees (``packed.py``): rows that begin
alike share those tokens, whether prompt or response, and each row's logprobs, entropy, values
and gradients equal one forward of that row alone."""

from __future__ import annotations

import random

import pytest
import torch
from test_prefix import make_batch
from transformers import AutoModelForCausalLM

from agentrl.trainer import packed
from agentrl.trainer.batch import TrainBatch
from agentrl.trainer.prefix import response_logprobs, response_values

SYSTEM = [11, 12, 13, 14, 15]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def caterpillar(turns: int, *, system: int = 5, user: int = 3, think: int = 4, answer: int = 3):
    """Rows as a Qwen3-style rewritten history makes them: row k's prompt is the system prompt,
    the earlier user turns and answers (their think blocks dropped) and user turn k; its response
    is turn k's think block and answer. Token ids are distinct per span, so rows share exactly the
    history prefix."""
    ids = iter(range(100, 100_000))
    take = lambda n: [next(ids) for _ in range(n)]  # noqa: E731
    history = take(system)
    prompts, responses = [], []
    for _ in range(turns):
        prompt = history + take(user)
        answer_ids = take(answer)
        prompts.append(prompt)
        responses.append(take(think) + answer_ids)
        history = prompt + answer_ids
    return prompts, responses


# Hand-built trees; the comment says what each shares.
TREES = {
    # a shared system prompt, then prompts of their own (two samples of the second)
    "shared-prompt-prefix": ([SYSTEM + [20, 21], SYSTEM + [30], SYSTEM + [30]], [[40, 41, 42], [50, 51], [52, 53, 54]]),
    # row 1's prompt is row 0's prompt and response, and more; row 2 continues row 1's response
    "prompt-continues-a-response": ([SYSTEM, SYSTEM + [40, 41, 42, 43], SYSTEM + [40, 41, 42, 43, 50, 51]],
                                    [[40, 41, 42, 60], [50, 51, 52], [70, 71]]),
    "caterpillar-3": caterpillar(3),
    "nothing-shared": ([[11, 12], [21, 22, 23], [31]], [[40, 41], [50], [60, 61, 62]]),
}
# tokens the tree computes (the last response token of a row is predicted, never fed)
TREE_TOKENS = {"shared-prompt-prefix": 5 + 2 + 2 + 1 + 1 + 2, "prompt-continues-a-response": 5 + 3 + 1 + 2 + 1,
               "caterpillar-3": 5 + 3 + 6 + (3 + 3) + 6 + (3 + 3) + 6, "nothing-shared": 3 + 3 + 3}


def one_forward_per_row(model, batch: TrainBatch):
    """The definition: each row alone (its real tokens, nothing else), logprobs and entropy of
    its response tokens in (B, R) with zeros elsewhere."""
    P, R = batch.prompt_length, batch.response_length
    logprobs, entropy = torch.zeros(len(batch), R), torch.zeros(len(batch), R)
    for b in range(len(batch)):
        real = batch.attention_mask[b].bool()
        ids = batch.input_ids[b, real]
        n = int(batch.attention_mask[b, P:].sum())
        logp = torch.log_softmax(model(input_ids=ids[None]).logits[0, -n - 1 : -1].float(), -1)  # (n, V)
        logprobs = logprobs.index_put((torch.full((n,), b), torch.arange(n)), logp.gather(-1, ids[-n:, None])[:, 0])
        entropy = entropy.index_put((torch.full((n,), b), torch.arange(n)), -(logp.exp() * logp).sum(-1))
    return logprobs, entropy


def loss_and_grads(model, compute):
    model.zero_grad(set_to_none=True)
    logprobs, entropy, mask = compute()
    weights = torch.linspace(-1.0, 1.0, logprobs.shape[1])  # every column weighted differently
    ((logprobs + 0.1 * entropy) * weights * mask).sum().backward()
    return (logprobs * mask).detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def capture_layouts(monkeypatch) -> list[packed.PackedSegments]:
    layouts: list[packed.PackedSegments] = []
    real_hidden = packed.packed_hidden
    monkeypatch.setattr(packed, "packed_hidden", lambda m, layout: layouts.append(layout) or real_hidden(m, layout))
    return layouts


@pytest.mark.parametrize("tree", list(TREES))
def test_a_tree_gives_each_rows_logprobs_and_gradients_of_one_forward_per_row(model, monkeypatch, tree):
    batch = make_batch(*TREES[tree], observed={1: [1]})  # a tool token inside row 1's response
    mask = batch.response_mask
    want, want_grads = loss_and_grads(model, lambda: (*one_forward_per_row(model, batch), mask))
    layouts = capture_layouts(monkeypatch)
    got, grads = loss_and_grads(model, lambda: (*response_logprobs(model, batch, with_entropy=True), mask))
    segments = packed.pack_segments(packed.row_tokens(batch, packed.response_lengths(batch)),
                                    pair_cost=packed.attention_pair_cost(model.config))
    assert sum(s.tokens for s in segments) == TREE_TOKENS[tree]  # what the forward computed
    assert len(segments) == (3 if tree == "nothing-shared" else 1) and sum(len(x.ids) for x in layouts) == len(segments)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_grads_close(grads, want_grads)


def assert_grads_close(grads, want_grads):
    """Relative 1e-5 of each parameter's largest gradient: a shared token's gradient sums its rows'
    in another order than the per-row forwards do (fp32 rounding of that size), where a token
    read from the wrong node is off by order 1 (1e-7 absolute: a bias whose gradient, a sum of
    weights of both signs, cancels to about that)."""
    assert grads.keys() == want_grads.keys() and len(grads) > 0
    for name, want in want_grads.items():
        scale = float(want.abs().max())
        torch.testing.assert_close(grads[name], want, rtol=1e-5, atol=1e-5 * scale + 1e-7, msg=lambda m: f"{name}: {m}")


def test_critic_values_and_gradients_through_a_tree_equal_one_forward_per_row(tiny_model_dir, monkeypatch):
    from agentrl.trainer.workers import ValueModel

    torch.manual_seed(0)
    critic = ValueModel(str(tiny_model_dir))
    torch.nn.init.normal_(critic.head.weight, std=0.5)  # a head that is not all zeros
    batch = make_batch(*caterpillar(3))
    P, mask = batch.prompt_length, batch.response_mask
    weights = torch.linspace(-1.0, 1.0, batch.response_length)
    want = torch.zeros_like(mask)
    for b in range(len(batch)):
        real = batch.attention_mask[b].bool()
        n = int(batch.attention_mask[b, P:].sum())
        out = critic(batch.input_ids[b, real][None], torch.ones(1, int(real.sum()), dtype=torch.long),
                     torch.arange(int(real.sum()))[None]).logits[0, -n - 1 : -1, 0]
        want = want.index_put((torch.full((n,), b), torch.arange(n)), out)
    (want * weights * mask).sum().backward()
    want_grads = {name: p.grad.clone() for name, p in critic.named_parameters() if p.grad is not None}
    critic.zero_grad(set_to_none=True)
    layouts = capture_layouts(monkeypatch)
    values = response_values(critic, batch)
    (values * weights * mask).sum().backward()
    assert len(layouts) == 1 and layouts[0].ids.shape == (1, TREE_TOKENS["caterpillar-3"])
    torch.testing.assert_close(values.detach() * mask, want.detach() * mask, rtol=1e-5, atol=1e-6)
    assert_grads_close({name: p.grad for name, p in critic.named_parameters() if p.grad is not None}, want_grads)


def test_a_tree_longer_than_a_segment_is_cut_between_rows_and_stays_exact(model, monkeypatch):
    monkeypatch.setattr(packed, "MAX_SEGMENT_TOKENS", 20)  # the caterpillar's tree is 38 tokens, its longest row 26
    batch = make_batch(*caterpillar(3))
    tokens = packed.row_tokens(batch, packed.response_lengths(batch))
    # the history (a kept answer) sorts before a think block: its ids are lower
    assert tokens.length == [14, 20, 26] and tokens.order == [2, 1, 0] and tokens.common == [0, 14, 8]
    # row 1 shares 14 tokens with row 2 and adds 6: 32 tokens, past the cap, but a mask no bigger
    # than the two rows' apart (32^2 <= 26^2 + 20^2); row 0 would add 6 more: 38^2 > 26^2 + 20^2 + 14^2
    assert packed.pack_segments(tokens) == [packed.Segment(32, [2, 1], [0, 14]), packed.Segment(14, [0], [0])]
    want, want_grads = loss_and_grads(model, lambda: (*one_forward_per_row(model, batch), batch.response_mask))
    got, grads = loss_and_grads(model, lambda: (*response_logprobs(model, batch, with_entropy=True), batch.response_mask))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_grads_close(grads, want_grads)


def random_rows(rng: random.Random, count: int) -> tuple[list[list[int]], list[list[int]]]:
    """Rows over a 4-token vocabulary, most extending a cut of an earlier row: shared prefixes
    of every length, identical rows, rows that are another's prefix, a prompt that is another
    row's response."""
    sequences: list[list[int]] = []
    for _ in range(count):
        base = rng.choice(sequences)[: rng.randint(1, 12)] if sequences and rng.random() < 0.8 else []
        sequences.append(base + [rng.randint(1, 4) for _ in range(rng.randint(0 if len(base) >= 2 else 2, 6))])
    cuts = [rng.randint(1, len(s) - 1) for s in sequences]
    return [s[:c] for s, c in zip(sequences, cuts)], [s[c:] for s, c in zip(sequences, cuts)]


@pytest.mark.parametrize("seed", range(40))
def test_each_predicting_token_sees_exactly_its_rows_tokens_before_it(seed):
    rng = random.Random(seed)
    batch = make_batch(*random_rows(rng, rng.randint(1, 9)))
    tokens = packed.row_tokens(batch, packed.response_lengths(batch))
    segments = packed.pack_segments(tokens, max_tokens=rng.choice([4, 12, 1024]), share=rng.random() < 0.9)
    layout = packed.layout(tokens, segments, "cpu")
    visible = layout.attention_mask(torch.float32)[:, 0] == 0  # (S, L, L)
    L = layout.ids.shape[1]
    ids, positions = layout.ids.flatten(), layout.positions.flatten()
    P = batch.prompt_length
    for row, col, slot in zip(layout.rows.tolist(), layout.cols.tolist(), layout.source.tolist()):
        real = batch.attention_mask[row].bool()
        want = batch.input_ids[row, real][: int(real[:P].sum()) + col]  # its prompt and response tokens before col
        seen = visible[slot // L, slot % L].nonzero()[:, 0] + (slot // L) * L
        assert ids[seen].tolist() == want.tolist() and positions[seen].tolist() == list(range(len(want)))
        assert int(seen[-1]) == slot  # the predicting token is the row's token before col
    covered = sorted(zip(layout.rows.tolist(), layout.cols.tolist()))
    assert covered == [(b, c) for b, n in enumerate(packed.response_lengths(batch).tolist()) for c in range(n)]
    # every node is computed once per segment: no two slots of a segment hold the same prefix
    computed = sum(s.tokens for s in segments)
    assert computed <= sum(tokens.length) and len({s.tokens for s in segments}) >= 1
    if len(segments) == 1:
        prefixes = {tuple(batch.input_ids[b, batch.attention_mask[b].bool()][:d].tolist())
                    for b in range(len(batch)) for d in range(1, tokens.length[b] + 1)}
        assert computed == len(prefixes)


def test_forward_tokens_counts_the_tree_the_rows_and_the_trained_tokens():
    prompts, responses = caterpillar(16)
    batch = make_batch(prompts, responses, observed={0: [0]})
    counts = packed.forward_tokens(batch, max_tokens=10_000)
    # rows: 8 + 6k history tokens + 6 fed response tokens each; tree: the last row, plus each
    # earlier row's think block and first two answer tokens (6)
    assert counts == packed.ForwardTokens(computed=(8 + 6 * 15 + 6) + 6 * 15, rows=sum(14 + 6 * k for k in range(16)),
                                          trained=16 * 7 - 1)
    assert packed.forward_tokens(batch, share=False) == packed.ForwardTokens(counts.rows, counts.rows, counts.trained)


def test_a_pass_shares_within_each_micro_batch_only():
    batch = make_batch(*caterpillar(3))  # rows of 14, 20 and 26 tokens; the tree of all three: 38
    assert packed.pass_tokens([batch], 3) == packed.ForwardTokens(computed=38, rows=60, trained=21)
    # micro-batches of two rows: rows 0 and 1 share 8 tokens (14 + 12), row 2 alone (26)
    assert packed.pass_tokens([batch], 2) == packed.ForwardTokens(computed=52, rows=60, trained=21)
    assert packed.pass_tokens([batch.select([0, 1]), batch.select([2])], 4) == packed.pass_tokens([batch], 2)
