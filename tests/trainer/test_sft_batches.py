"""SFT batches put the tokens every demonstration shares (system prompt and tools block) in the
rows' common prompt, so the shared-prompt forward computes them once per batch: the same loss
and gradients as rows that start at their first token, on the real tiny model."""

from __future__ import annotations

import torch

from agentrl.trainer.prefix import response_logprobs
from agentrl.trainer.sft import shared_prefix_length, sft_batches, tokenize_conversations, tool_schemas
from agentrl_data_prep.tasks import sft_conversations


def test_the_shared_prefix_stops_where_rows_differ_where_training_starts_and_before_the_end():
    assert shared_prefix_length([([5, 6, 7, 8], [0, 0, 0, 1]), ([5, 6, 9, 8], [0, 0, 0, 1])]) == 2
    assert shared_prefix_length([([5, 6, 7, 8], [0, 1, 1, 1]), ([5, 6, 7, 8], [0, 0, 0, 1])]) == 1  # a trained token ends it
    assert shared_prefix_length([([5, 6, 7], [0, 0, 1]), ([5, 6, 7], [0, 0, 1])]) == 2  # one response token is left
    assert shared_prefix_length([([4, 6], [0, 1]), ([5, 6], [0, 1])]) == 1  # nothing shared: the first token
    assert shared_prefix_length([]) == 1


def test_sft_loss_and_gradients_equal_those_of_rows_starting_at_their_first_token(tiny_model_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    from agentrl.config import load_config
    from agentrl.trainer.batch import collate_sequences

    cfg = load_config("train", [f"model.path={tiny_model_dir}"])
    conversations = sft_conversations("arith", 6, seed=3, tool_rate=0.5)
    examples = tokenize_conversations(tiny_tokenizer, conversations, tools=tool_schemas(cfg, conversations), max_length=512)
    k = shared_prefix_length(examples)
    system_and_tools = tiny_tokenizer.apply_chat_template(conversations[0][:1], tools=tool_schemas(cfg, conversations))
    assert k >= len(system_and_tools) - 2 and k < min(len(ids) for ids, _ in examples)
    shared = sft_batches(examples, batch_size=6, pad_token_id=tiny_tokenizer.pad_token_id, epochs=1, seed=0)[0]
    assert shared.prompt_length == k
    order = torch.randperm(6, generator=torch.Generator().manual_seed(0)).tolist()  # sft_batches' shuffle
    chosen = [examples[i] for i in order]
    plain = collate_sequences([ids[:1] for ids, _ in chosen], [ids[1:] for ids, _ in chosen], [m[1:] for _, m in chosen],
                              pad_token_id=tiny_tokenizer.pad_token_id)
    assert shared.response_mask.sum() == plain.response_mask.sum() == sum(sum(m) for _, m in examples)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)

    def loss_and_grads(batch):
        model.zero_grad()
        logprobs, _ = response_logprobs(model, batch)
        loss = -(logprobs * batch.response_mask).sum() / batch.response_mask.sum()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    shared_loss, shared_grads = loss_and_grads(shared)
    plain_loss, plain_grads = loss_and_grads(plain)
    torch.testing.assert_close(shared_loss, plain_loss, atol=1e-6, rtol=0)
    for a, b in zip(shared_grads, plain_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
