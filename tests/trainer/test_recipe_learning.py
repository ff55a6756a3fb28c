"""Each recipe's math learns: addition answered by a small policy in this process.

The policy reads a prompt (a, b), a, b in 0..5, and writes the sum as two tokens (tens digit,
units digit), sampling each from its own softmax; the reward is 1 for the right sum, 0
otherwise. A step samples n = 8 answers per prompt, computes GRPO advantages
(``estimate_advantages``), applies the recipe (DAPO: dynamic sampling that drops groups whose
rewards are all equal and draws more prompts up to a cap; GSPO / CISPO: their losses; Dr.GRPO:
advantages not divided by the group's std and token sums over a constant length; rollout
correction: answers sampled by a hotter "engine", each token's loss weighted by the truncated
ratio of the trainer's probability to the engine's), and
takes two optimizer steps on the batch against its sampling logprobs (so the ratios move away
from 1 and the clipping acts). The success rate starts near 0 (a random two-token answer is
right once in 100 draws) and must pass 0.4 over the last 10 of 150 steps (seeds 0-2 reach
0.6-0.8 with each recipe). This pins the recipes' math end to end, without the
trainer: the trainer's own learning runs are the quickstart's.
"""

from __future__ import annotations

import pytest
import torch

from agentrl.trainer.algorithms.advantages import estimate_advantages
from agentrl.trainer.algorithms.losses import policy_loss
from agentrl.trainer.algorithms.recipes import dynamic_sampling_filter, rollout_correction_weights

N, PROMPTS, STEPS, DIGITS = 8, 16, 150, 6


class AdditionPolicy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(20 + 11, 32)  # a, b (offset 10) and the previous token (offset 20, 10 = none)
        self.body = torch.nn.Sequential(torch.nn.Linear(96, 64), torch.nn.Tanh(), torch.nn.Linear(64, 10))

    def logits(self, a, b, prev):  # (M,) each -> (M, 10)
        x = torch.cat([self.embed(a), self.embed(b + 10), self.embed(prev + 20)], -1)
        return self.body(x)

    def logprobs(self, a, b, tokens, temperature: float = 1.0):  # tokens (M, 2) -> (M, 2)
        first = torch.log_softmax(self.logits(a, b, torch.full_like(a, 10)) / temperature, -1).gather(1, tokens[:, :1])
        second = torch.log_softmax(self.logits(a, b, tokens[:, 0]) / temperature, -1).gather(1, tokens[:, 1:])
        return torch.cat([first, second], 1)

    @torch.no_grad()
    def sample(self, a, b, g, temperature: float = 1.0):
        t0 = torch.multinomial(torch.softmax(self.logits(a, b, torch.full_like(a, 10)) / temperature, -1), 1, generator=g)
        t1 = torch.multinomial(torch.softmax(self.logits(a, b, t0[:, 0]) / temperature, -1), 1, generator=g)
        return torch.cat([t0, t1], 1)


# rollout correction: the "engine" samples from another distribution than the trainer's policy
# (here a hotter one), as a bf16 or differently batched engine does by a little
ENGINE_TEMPERATURE = 1.3


def draw(policy, g, temperature: float = 1.0):
    a = torch.randint(0, DIGITS, (PROMPTS,), generator=g).repeat_interleave(N)
    b = torch.randint(0, DIGITS, (PROMPTS,), generator=g).repeat_interleave(N)
    tokens = policy.sample(a, b, g, temperature)
    reward = ((tokens[:, 0] * 10 + tokens[:, 1]) == a + b).float()
    groups = torch.arange(PROMPTS).repeat_interleave(N)
    return a, b, tokens, reward, groups


def train(recipe: str, seed: int = 0) -> list[float]:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    policy = AdditionPolicy()
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-3)
    low, high, mode, kind = {
        "dapo": (0.2, 0.28, "token-mean", "vanilla"),
        "gspo": (3e-4, 4e-4, "seq-mean-token-mean", "gspo"),
        "cispo": (1.0, 0.28, "token-mean", "cispo"),
        "drgrpo": (0.2, 0.2, "seq-mean-token-sum-norm", "vanilla"),  # with advantages not divided by the std
        "rollout_correction": (0.2, 0.2, "token-mean", "vanilla"),  # token-level truncated IS, cap 2
    }[recipe]
    temperature = ENGINE_TEMPERATURE if recipe == "rollout_correction" else 1.0
    success = []
    for _ in range(STEPS):
        a, b, tokens, reward, groups = draw(policy, g, temperature)
        success.append(float(reward.mean()))
        if recipe == "dapo":  # dynamic sampling: keep groups with a reward spread, refill up to 4 draws
            parts, kept_groups = [], 0
            for draws in range(4):
                if draws:
                    a, b, tokens, reward, groups = draw(policy, g)
                kept, counts = dynamic_sampling_filter(reward, groups)
                parts.append((a[kept], b[kept], tokens[kept], reward[kept], groups[kept] + 100 * draws))
                kept_groups += counts["groups_kept"]
                if kept_groups >= PROMPTS:
                    break
            a, b, tokens, reward, groups = (torch.cat(x) for x in zip(*parts))
            if len(a) == 0:
                continue
        mask = torch.ones(len(a), 2)
        token_rewards = torch.stack([torch.zeros_like(reward), reward], 1)  # the reward on the last token
        advantages, _ = estimate_advantages("grpo", token_rewards=token_rewards, response_mask=mask, group_ids=groups,
                                                 norm_adv_by_std_in_grpo=recipe != "drgrpo")
        weights = None
        with torch.no_grad():
            old = policy.logprobs(a, b, tokens)
            if recipe == "rollout_correction":
                engine = policy.logprobs(a, b, tokens, temperature)
                weights, _ = rollout_correction_weights(old, engine, mask, "token", cap=2.0)
        for _ in range(2):
            loss, _ = policy_loss(kind, policy.logprobs(a, b, tokens), old, advantages, mask,
                                       clip_ratio_low=low, clip_ratio_high=high, loss_agg_mode=mode, norm_length=2,
                                       rollout_is_weights=weights)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return success


@pytest.mark.parametrize("recipe", ["dapo", "gspo", "cispo", "drgrpo", "rollout_correction"])
def test_the_recipe_learns_addition(recipe):
    success = train(recipe)
    first, last = sum(success[:5]) / 5, sum(success[-10:]) / 10
    assert first < 0.15  # it starts from guessing
    assert last > 0.4, f"{recipe}: success {first:.2f} over the first 5 steps, {last:.2f} over the last 10 of {STEPS}"
