"""The trainer's response logprobs equal one padded forward of the whole batch, in logprobs and
in gradients, on both of its paths: the packed forward (``packed.py``: prompts once, responses
packed after them, one call) and the module forward with shared prompts and length buckets
(``prefix.py``; what FSDP2 and gradient checkpointing use)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from agentrl.trainer import packed
from agentrl.trainer.batch import TrainBatch
from agentrl.trainer.prefix import distinct_prompts, length_buckets, response_logprobs

PATHS = ["packed", "buckets"]


@pytest.fixture(params=PATHS)
def forward_path(request, monkeypatch):
    """Runs a test on each path; ``buckets`` is what a model the packed forward cannot take gets."""
    if request.param == "buckets":
        monkeypatch.setattr(packed, "packed_supported", lambda model, batch: False)
    return request.param


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


def padded_forward(model, batch: TrainBatch):
    """The definition: one forward of the whole padded batch, logprobs of the response columns."""
    R = batch.response_length
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids).logits
    logits = logits[:, -R - 1 : -1].float()
    logprobs = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[:, -R:, None]).squeeze(-1)
    probs = torch.softmax(logits, -1)
    return logprobs, -(probs * torch.log_softmax(logits, -1)).sum(-1)


@pytest.mark.parametrize("share", [True, False], ids=["shared-prompts", "own-prompts"])
@pytest.mark.parametrize("call_cost", [0, 1000], ids=["bucket-per-length", "one-bucket"])
def test_logprobs_and_gradients_equal_one_padded_forward(model, monkeypatch, forward_path, share, call_cost):
    # Two groups of three samples (prompts of different lengths, so B's are left-padded), responses
    # of different lengths (right padding) and tool output inside two of them.
    monkeypatch.setattr("agentrl.trainer.prefix.CALL_COST_TOKENS", call_cost)
    batch = make_batch(
        [GROUP_A] * 3 + [GROUP_B] * 3,
        [[30, 31, 32, 33, 34], [40, 41, 42], [50, 51, 52, 53, 54], [60, 61], [70, 71, 72, 73, 74], [80, 81, 82, 83]],
        observed={2: [2, 3], 4: [1]},
    )
    model.zero_grad(set_to_none=True)
    weights = torch.linspace(-1.0, 1.0, batch.response_length)
    lp, ent = padded_forward(model, batch)
    ((lp + 0.1 * ent) * weights * batch.response_mask).sum().backward()
    expected_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    expected = lp.detach() * batch.response_mask

    got, grads = logprobs_and_grads(model, batch, share=share)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert grads.keys() == expected_grads.keys() and len(grads) > 0
    for name in grads:
        torch.testing.assert_close(grads[name], expected_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_columns_past_a_rows_last_token_are_zero(model, forward_path, monkeypatch):
    monkeypatch.setattr("agentrl.trainer.prefix.CALL_COST_TOKENS", 1000)  # one bucket as wide as its longest row
    batch = make_batch([GROUP_A] * 2 + [GROUP_B], [[30, 31, 32, 33], [40], [50, 51]])
    with torch.no_grad():
        logprobs, entropy = response_logprobs(model, batch, with_entropy=True)
    real = batch.response_attention_mask.bool()
    assert bool((logprobs[~real] == 0).all() and (entropy[~real] == 0).all())
    assert bool((logprobs[real] < 0).all() and (entropy[real] > 0).all())


def test_buckets_minimize_padded_tokens_plus_a_charge_per_call():
    lengths = torch.tensor([1, 9, 1, 2, 9, 1])
    as_lists = lambda buckets: [b.tolist() for b in buckets]  # noqa: E731
    # Free calls: one bucket per distinct length, rows in their original order within a bucket.
    assert as_lists(length_buckets(lengths, call_cost=0)) == [[0, 2, 5], [3], [1, 4]]
    # Dear calls: one bucket padded to 9 (54 + 100 = 154) beats two ({1,1,1,2}, {9,9}: 8 + 18 + 200).
    assert as_lists(length_buckets(lengths, call_cost=100)) == [[0, 2, 5, 3, 1, 4]]
    # At 5 per call: {1,1,1,2} padded to 2 (8 + 5) and {9,9} (18 + 5) = 36 beats one bucket
    # (54 + 5), and three buckets (3 + 2 + 18 + 15 = 38).
    assert as_lists(length_buckets(lengths, call_cost=5)) == [[0, 2, 5, 3], [1, 4]]


def test_each_distinct_prompt_goes_through_the_model_once_on_the_bucket_path(model, monkeypatch):
    monkeypatch.setattr(packed, "packed_supported", lambda model, batch: False)
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


def test_the_packed_path_feeds_each_prompt_once_then_its_responses_without_padding(model, monkeypatch):
    batch = make_batch([GROUP_A] * 3 + [GROUP_B] * 3, [[30, 31, 32], [40], [50, 51], [60, 61, 62], [70, 71, 72], [80]])
    layouts: list[packed.PackedSegments] = []
    real_hidden = packed.packed_hidden
    monkeypatch.setattr(packed, "packed_hidden", lambda m, layout: layouts.append(layout) or real_hidden(m, layout))
    monkeypatch.setattr("agentrl.trainer.prefix.CALL_COST_TOKENS", 1000)  # both segments in one call
    response_logprobs(model, batch, share_prompts=True)
    (layout,) = layouts
    # A response's last token is predicted, never fed: rows add 2, 0, 1 and 2, 2, 0 tokens.
    # Segments are ordered by length (length_buckets): B's (8 tokens) before A's (10).
    assert layout.ids.tolist() == [
        GROUP_B + [60, 61] + [70, 71] + [0, 0],  # padded to the longer segment
        GROUP_A + [30, 31] + [50],
    ]
    # Each node's subtree ends at: the prompt's, the segment's end; a response token's, the next
    # row's first own token; a padding slot's, the next slot (it sees only itself).
    assert layout.end.tolist() == [[8] * 4 + [6, 6, 8, 8, 9, 10], [10] * 7 + [9, 9, 10]]
    assert layout.positions.tolist() == [[0, 1, 2, 3, 4, 5, 4, 5, 0, 0], list(range(9)) + [7]]
    # Row 0's three columns are predicted by the last prompt token and its own two fed tokens.
    L = layout.ids.shape[1]
    assert [int(s) - L for s, r in zip(layout.source, layout.rows) if r == 0] == [6, 7, 8]
    assert [int(s) for s, r in zip(layout.source, layout.rows) if r == 3] == [3, 4, 5]
    assert layout.cols[layout.rows == 1].tolist() == [0]  # a one-token response: the prompt predicts it

    visible = layout.attention_mask(torch.float32)[0, 0] == 0  # segment 0, [query, key]
    assert visible[7].tolist() == [True] * 4 + [False, False, True, True, False, False]  # row 4's 2nd token
    assert visible[5].tolist() == [True] * 6 + [False] * 4  # row 3's 2nd token: its prompt and itself


def test_a_group_longer_than_a_segment_is_cut_and_each_part_gets_its_prompt(model, monkeypatch):
    monkeypatch.setattr(packed, "MAX_SEGMENT_TOKENS", 10)
    batch = make_batch([GROUP_A] * 3 + [GROUP_B], [[30, 31, 32, 33, 34, 35], [40, 41, 42, 43, 44, 45], [50, 51, 52],
                                                   [60, 61, 62, 63, 64, 65, 66, 67, 68]])
    tokens = packed.row_tokens(batch, torch.tensor([6, 6, 3, 9]))
    # Group A's rows feed 12, 12 and 9 tokens. Row 1 would make row 0's segment 17 > 10, and its
    # mask bigger than theirs apart (17^2 > 12^2 + 12^2): a second segment. Row 2 joins that one
    # (14^2 <= 12^2 + 9^2: past the cap, in the memory the two would take apart); row 3 is alone.
    Segment = packed.Segment
    assert packed.pack_segments(tokens) == [Segment(12, [0], [0]), Segment(14, [1, 2], [0, 7]), Segment(12, [3], [0])]
    got, _ = logprobs_and_grads(model, batch, share=True)
    with torch.no_grad():
        expected = padded_forward(model, batch)[0] * batch.response_mask
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_rows_share_a_segment_only_when_that_costs_less_than_their_own():
    # Join: the row's tokens plus pair_cost * (new length^2 - old length^2); alone: prompt +
    # tokens plus pair_cost * length^2 (token-equivalents).
    grpo = packed.row_tokens(make_batch([GROUP_A] * 2, [[30, 31, 32], [40, 41, 42]]), torch.tensor([3, 3]))  # 2 tokens after 7
    # join 2 + 0.01 * (11^2 - 9^2) = 2.4 < alone 9 + 0.01 * 9^2 = 9.81
    assert packed.pack_segments(grpo, pair_cost=0.01) == [packed.Segment(11, [0, 1], [0, 7])]
    # a one-token "prompt" before 40 tokens
    sft = packed.row_tokens(make_batch([[5]] * 2, [list(range(40, 80)), list(range(80, 120))]), torch.tensor([40, 40]))
    # join 39 + 0.01 * (79^2 - 40^2) = 85.4 > alone 40 + 0.01 * 40^2 = 56
    alone = [packed.Segment(40, [0], [0]), packed.Segment(40, [1], [0])]
    assert packed.pack_segments(sft, pair_cost=0.01) == alone
    assert packed.pack_segments(sft, pair_cost=0.0) == [packed.Segment(79, [0, 1], [0, 1])]  # attention free
    assert packed.pack_segments(sft, pair_cost=0.0, share=False) == alone


def test_gradient_checkpointing_and_a_missing_prompt_take_the_module_path(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    batch = make_batch([GROUP_A, GROUP_B], [[30], [40, 41]])
    assert packed.packed_supported(model, batch)
    no_prompt = batch.replace(attention_mask=batch.attention_mask.clone())
    no_prompt.attention_mask[1, : batch.prompt_length] = 0
    assert not packed.packed_supported(model, no_prompt)  # nothing would predict its first token
    model.gradient_checkpointing_enable()
    assert not packed.packed_supported(model, batch)  # checkpointing lives in the module forward


def test_one_token_responses_need_only_the_prompt_pass(model, forward_path):
    batch = make_batch([GROUP_A] * 4, [[30], [31], [32], [33]])
    shared, _ = logprobs_and_grads(model, batch, share=True)
    with torch.no_grad():
        expected = padded_forward(model, batch)[0]
    torch.testing.assert_close(shared, expected, atol=1e-5, rtol=0)


def test_rows_share_a_prompt_only_when_tokens_and_padding_agree():
    batch = make_batch([[5, 6], [7, 5, 6], [5, 6], [0, 5, 6], [7, 5, 6]], [[9]] * 5)
    # Row 3's prompt starts with token 0, the pad id: the same ids as rows 0 and 2 after left
    # padding, but its attention mask differs, so it is a prompt of its own.
    first, inverse = distinct_prompts(batch)
    groups = [int(first[i]) for i in inverse]
    assert groups == [0, 1, 0, 3, 1]
    assert sorted(first.tolist()) == [0, 1, 3]


@pytest.mark.parametrize("share", [True, False], ids=["shared-prompts", "own-prompts"])
def test_critic_values_and_gradients_equal_one_padded_forward(tiny_model_dir, monkeypatch, forward_path, share):
    from agentrl.trainer.prefix import response_values
    from agentrl.trainer.workers import ValueModel

    monkeypatch.setattr("agentrl.trainer.prefix.CALL_COST_TOKENS", 0)  # a bucket per response length
    torch.manual_seed(0)
    critic = ValueModel(str(tiny_model_dir))
    torch.nn.init.normal_(critic.head.weight, std=0.5)  # a head that is not all zeros
    batch = make_batch([GROUP_A] * 3 + [GROUP_B] * 3, [[30, 31, 32, 33, 34], [40, 41], [50, 51, 52], [60], [70, 71, 72, 73], [80, 81]])
    P, R = batch.prompt_length, batch.response_length
    weights = torch.linspace(-1.0, 1.0, R)

    full = critic(batch.input_ids, batch.attention_mask, batch.position_ids).logits[:, P - 1 : P + R - 1, 0] * batch.response_mask
    (full * weights).sum().backward()
    expected_grads = {name: p.grad.clone() for name, p in critic.named_parameters() if p.grad is not None}
    critic.zero_grad(set_to_none=True)

    values = response_values(critic, batch, share_prompts=share) * batch.response_mask
    (values * weights).sum().backward()
    torch.testing.assert_close(values.detach(), full.detach(), atol=1e-5, rtol=0)
    # fp32 sums in another order: one element in 8192 differed by 2e-4 relative with a 1e-4 bound;
    # a wrong K/V mapping is off by order 1.
    for name, grad in expected_grads.items():
        torch.testing.assert_close(critic.get_parameter(name).grad, grad, atol=1e-4, rtol=1e-3, msg=lambda m: f"{name}: {m}")


def test_a_metric_only_entropy_equals_the_differentiable_one_and_carries_no_graph(model, forward_path):
    batch = make_batch([GROUP_A] * 2 + [GROUP_B], [[30, 31, 32], [40, 41], [50, 51, 52]])
    logprobs, with_grad = response_logprobs(model, batch, with_entropy=True)
    logprobs_m, metric = response_logprobs(model, batch, with_entropy=True, entropy_grad=False)
    assert with_grad.requires_grad and not metric.requires_grad
    assert logprobs_m.requires_grad  # the logprobs keep their graph either way
    torch.testing.assert_close(metric, with_grad.detach(), rtol=0, atol=0)
    torch.testing.assert_close(logprobs_m, logprobs, rtol=0, atol=0)
    _, expected = padded_forward(model, batch)
    torch.testing.assert_close(metric * batch.response_mask, expected.detach() * batch.response_mask, rtol=0, atol=1e-5)


def test_gradient_checkpointing_in_training_gives_the_same_logprobs_and_gradients(tiny_model_dir, monkeypatch):
    """A checkpointed model returns no K/V while training: rows then run their own prompts
    (this path crashed with prompt sharing on, the default)."""
    monkeypatch.setattr(packed, "packed_supported", lambda model, batch: False)
    batch = make_batch([[5, 6, 7], [5, 6, 7], [9, 8]], [[11, 12, 13], [14, 15], [16]])
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    checkpointed = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    checkpointed.gradient_checkpointing_enable()
    plain.train(), checkpointed.train()
    want_lp, want_grads = logprobs_and_grads(plain, batch, share=False)  # what it must fall back to
    got_lp, got_grads = logprobs_and_grads(checkpointed, batch, share=True)
    torch.testing.assert_close(got_lp, want_lp, atol=1e-6, rtol=0)
    assert want_grads.keys() == got_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], atol=1e-6, rtol=1e-5)
