"""The SFT warm start stopped on purpose short of mastery: greedy matches of held-out
demonstrations (real tiny model, 1-rank FSDP2 in this process), the held-out split, the stop."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from agentrl.config.schema import ActorConfig, TrainConfig
from agentrl.errors import DataError
from agentrl.trainer.batch import collate_sequences
from agentrl.trainer.dist import free_port
from agentrl.trainer.sft import _conversations, run_sft_on_actor
from agentrl.trainer.workers import ActorWorker


@pytest.fixture
def actor(tiny_model_dir):
    worker = ActorWorker(model_path=str(tiny_model_dir), config=ActorConfig(), total_steps=1, temperature=1.0,
                         rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(), device="cpu", seed=0)
    yield worker
    if dist.is_initialized():
        dist.destroy_process_group()


def greedy_continuation(worker: ActorWorker, prompt: list[int], length: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(length):
            ids.append(int(worker.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_greedy_matches_is_one_exactly_where_every_trained_token_is_the_argmax(actor):
    prompt = [5, 17, 99, 3]
    greedy = greedy_continuation(actor, prompt, 6)
    wrong = list(greedy)
    wrong[3] = (wrong[3] + 1) % 200  # one trained token that is not the argmax
    masked_wrong = list(wrong)  # the same wrong token, but observed (mask 0): not judged
    batch = collate_sequences([prompt] * 3, [greedy, wrong, masked_wrong],
                              [[1] * 6, [1] * 6, [1, 1, 1, 0, 0, 0]], pad_token_id=0)
    assert actor.greedy_matches(batch, 2).tolist() == [1.0, 0.0, 1.0]


def test_generated_demonstrations_hold_out_the_test_split_only_when_stopping_is_on():
    off = TrainConfig.model_validate({"sft": {"num_demos": 8}})
    train, heldout = _conversations(off)
    assert len(train) == 8 and heldout == []
    on = TrainConfig.model_validate({"sft": {"num_demos": 8, "stop_at_success": 0.5, "eval_demos": 4}})
    train_on, heldout = _conversations(on)
    assert train_on == train and len(heldout) == 4
    questions = {c[1]["content"] for c in train}
    assert not questions & {c[1]["content"] for c in heldout}


def test_informal_rate_shapes_the_training_demonstrations_but_not_the_held_out_ones():
    cfg = TrainConfig.model_validate({"sft": {"num_demos": 8, "informal_rate": 1.0, "stop_at_success": 0.5, "eval_demos": 4}})
    train, heldout = _conversations(cfg)
    assert all(c[-1]["content"].startswith("The answer is ") for c in train)
    assert all(c[-1]["content"].startswith("#### ") for c in heldout)  # the check asks for the required format


def test_conversation_files_hold_out_their_last_rows_and_too_few_is_an_error_naming_the_field(tmp_path):
    from agentrl.data.io import write_rows

    convs = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}] for i in range(5)]
    path = write_rows([{"messages": c} for c in convs], tmp_path / "sft.parquet")
    cfg = TrainConfig.model_validate({"sft": {"train_files": [str(path)], "stop_at_success": 0.5, "eval_demos": 2}})
    train, heldout = _conversations(cfg)
    assert [c[0]["content"] for c in train] == ["q0", "q1", "q2"] and [c[0]["content"] for c in heldout] == ["q3", "q4"]
    too_many = cfg.model_copy(update={"sft": cfg.sft.model_copy(update={"eval_demos": 5})})
    with pytest.raises(DataError, match="sft.eval_demos = 5"):
        _conversations(too_many)


class ScriptedActor:
    """A one-rank actor group whose held-out success follows a script (the stop logic alone)."""

    world_size = 1

    def __init__(self, successes: list[float]):
        self.successes = successes
        self.steps = 0
        self.checks = 0

    def call_all(self, method, *args):
        return [None]

    def call_sharded(self, method, shards, *args):
        if method == "sft_step":
            self.steps += 1
            return [{"sft/loss_sum": 1.0, "sft/grad_norm": 0.0, "sft/lr": 1e-3}]
        assert method == "greedy_matches"
        rate = self.successes[self.checks]
        self.checks += 1
        n = len(shards[0])
        return [torch.tensor([1.0] * round(rate * n) + [0.0] * (n - round(rate * n)))]


class Log:
    def __init__(self):
        self.rows, self.console_lines = [], []

    def log(self, step, metrics):
        self.rows.append((step, dict(metrics)))

    def console(self, text):
        self.console_lines.append(text)


def test_sft_stops_at_the_first_check_reaching_the_target(tiny_tokenizer, tmp_path, capsys):
    cfg = TrainConfig.model_validate({"sft": {"num_demos": 40, "epochs": 1, "batch_size": 4, "stop_at_success": 0.5,
                                              "eval_every": 2, "eval_demos": 8}})
    actor, log = ScriptedActor([0.0, 0.25, 0.5, 1.0]), Log()
    metrics = run_sft_on_actor(actor, cfg, "unused", tiny_tokenizer, tiny_tokenizer.pad_token_id, log, tmp_path)
    assert actor.steps == 6 and actor.checks == 3  # checks after steps 2, 4, 6; 0.5 reached at step 6 of 10
    assert metrics["sft/step"] == 6.0 and metrics["sft/heldout_greedy_success"] == 0.5
    assert [m.get("sft/heldout_greedy_success") for _, m in log.rows] == [None, 0.0, None, 0.25, None, 0.5]
    assert "stopped at step 6 of 10" in capsys.readouterr().out
    # said before the first step, with the count (agentrl train's warm start says so with its own label)
    assert log.console_lines == ["agentrl sft: SFT: 10 steps (40 demonstrations, batch 4, 1 epoch; ends early at held-out greedy success 0.5)"]


def test_an_optimizer_reset_after_a_forward_only_pass_trains_the_sharded_parameters_and_saves(actor, tmp_path):
    """FSDP2 leaves the root's parameters unsharded after a forward without backward; a fresh
    optimizer must still hold the module's registered (sharded) parameters, or it updates stale
    copies and a checkpoint cannot name them."""
    from agentrl.config.schema import OptimConfig

    batch = collate_sequences([[5, 17, 99, 3]] * 2, [[7, 8, 9], [10, 11, 12]], [[1] * 3] * 2, pad_token_id=0)
    actor.greedy_matches(batch, 2)  # forward only, as the SFT stop check does
    actor.reset_optimizer(OptimConfig(lr=1e-2), 4)
    registered = {id(p) for p in actor.model.parameters()}
    assert all(id(p) in registered for group in actor.optimizer.param_groups for p in group["params"])
    embed_before = actor.full_state()["model.embed_tokens.weight"].clone()
    actor.sft_step(batch, float(batch.response_mask.sum()), 2)
    assert not torch.equal(actor.full_state()["model.embed_tokens.weight"], embed_before)
    actor.save(str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / "actor" / "tensors.safetensors").is_file()
