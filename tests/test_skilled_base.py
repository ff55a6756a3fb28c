"""The quickstart's base model (model.tiny.skills): shipped with agentrl when built by the current
recipe, else built once into the cache, stopped by a held-out check, refused with the reason when
the check is not reached, chosen by model.tiny.skills. The real build takes minutes
(scripts/build_skilled_base.py); the tests check the shipped one against the recipe's last check."""

from __future__ import annotations

import json

import pytest
import torch

import agentrl.trainer.skilled_base as skilled_base
from agentrl.trainer.batch import collate_sequences


def test_greedy_exact_counts_rows_whose_every_trained_token_is_the_argmax(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    prompt = [5, 9, 14, 3]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(4):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    greedy = ids[len(prompt):]
    wrong = greedy[:2] + [(greedy[2] + 1) % 50 + 3] + greedy[3:]
    batch = collate_sequences([prompt] * 3, [greedy, wrong, wrong], [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]], pad_token_id=0)
    # row 2's wrong token is not trained: it still counts as exact
    assert skilled_base.greedy_exact(model, batch) == pytest.approx(2 / 3)
    assert model.training is False  # the mode it was in


@pytest.fixture
def fast_skills(monkeypatch, tmp_path):
    monkeypatch.setattr(skilled_base, "SKILLS", {"calculator": (("arith", 17, 2, 1e-3, 4),)})
    monkeypatch.setattr(skilled_base, "CHECK_DEMOS", 4)
    monkeypatch.setattr(skilled_base, "CHECK_EVERY", 2)
    return tmp_path / "cache"


def test_a_build_stops_at_the_target_is_cached_and_reused(fast_skills, monkeypatch):
    monkeypatch.setattr(skilled_base, "TARGET", 0.0)  # reached at the first check
    built = skilled_base.skilled_model_dir("calculator", cache_root=fast_skills)
    assert (built / "config.json").is_file() and (built / "tokenizer.json").is_file()
    assert built.name.startswith("1m-seed0-calculator-")
    monkeypatch.setattr(skilled_base, "_train", lambda *a: pytest.fail("rebuilt a cached base"))
    assert skilled_base.skilled_model_dir("calculator", cache_root=fast_skills) == built


def test_a_build_short_of_the_target_is_an_error_and_leaves_nothing_cached(fast_skills, monkeypatch):
    monkeypatch.setattr(skilled_base, "TARGET", 1.01)  # never reached
    with pytest.raises(RuntimeError, match="did not reach 101% held-out exactness on arith within 4 steps"):
        skilled_base.skilled_model_dir("calculator", cache_root=fast_skills)
    assert not any(p.name.startswith(("1m-seed0-calculator", ".1m-seed0-calculator")) for p in fast_skills.iterdir())


def test_an_unknown_skill_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="unknown skill 'juggling'; skills: calculator, checking$"):
        skilled_base.skilled_model_dir("juggling")


def test_a_skill_built_on_another_continues_from_its_model(fast_skills, monkeypatch):
    import agentrl.tiny as tiny
    import agentrl.trainer.prefix as prefix

    recipes = {"calculator": (("arith", 17, 2, 1e-3, 4),), "checking": (("solver_verifier", 17, 2, 1e-3, 6),)}
    monkeypatch.setattr(skilled_base, "SKILLS", recipes)
    monkeypatch.setattr(tiny, "SKILLS", recipes)  # the recipe keys: neither is the shipped base now
    monkeypatch.setattr(skilled_base, "TARGET", 0.0)  # each stage stops at its first check (step 2)
    starts, steps = [], []
    train, forward = skilled_base._train, prefix.response_logprobs
    monkeypatch.setattr(skilled_base, "_train", lambda base, out, skill, seed: (starts.append((skill, base)), train(base, out, skill, seed)))
    monkeypatch.setattr(prefix, "response_logprobs", lambda model, batch: (steps.append(1), forward(model, batch))[1])
    checking = skilled_base.skilled_model_dir("checking", cache_root=fast_skills)
    calculator = skilled_base.skilled_model_path("calculator", cache_root=fast_skills)  # not shipped: that recipe changed
    assert starts == [("calculator", skilled_base._start_of("calculator", "1m", 0, fast_skills)), ("checking", calculator)]
    assert len(steps) == 2 + 2  # each stage stopped at its first check
    assert checking.name.startswith("1m-seed0-checking-") and (checking / "config.json").is_file()


def test_the_shipped_base_was_built_by_the_current_recipe():
    from agentrl.tiny import SHIPPED_MODELS, shipped_skilled_model, skill_recipe_key

    recorded = json.loads((SHIPPED_MODELS / "1m-seed0-calculator" / "recipe.json").read_text())
    assert recorded == {"skill": "calculator", "size": "1m", "seed": 0, "key": skill_recipe_key("calculator")}, (
        "agentrl.tiny.SKILLS (or the tiny model's builder or template) changed: rebuild the shipped base "
        "with scripts/build_skilled_base.py")
    assert shipped_skilled_model("calculator") == SHIPPED_MODELS / "1m-seed0-calculator"
    assert shipped_skilled_model("calculator", seed=3) is None  # not shipped: built on the machine
    checking = json.loads((SHIPPED_MODELS / "1m-seed0-checking" / "recipe.json").read_text())
    assert checking == {"skill": "checking", "size": "1m", "seed": 0, "key": skill_recipe_key("checking")}, (
        "rebuild the shipped checking base: scripts/build_skilled_base.py --skill checking")


def test_the_shipped_base_passes_its_recipes_last_check():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.tiny import SKILLS, shipped_skilled_model

    path = shipped_skilled_model("calculator")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    last = len(SKILLS["calculator"]) - 1
    task = SKILLS["calculator"][last][0]
    assert skilled_base.greedy_exact(model, skilled_base.check_batch(tokenizer, task, 0, last)) >= skilled_base.TARGET


def test_a_recipe_change_makes_the_shipped_base_unused(monkeypatch):
    import agentrl.tiny as tiny

    assert tiny.shipped_skilled_model("calculator") is not None and tiny.shipped_skilled_model("checking") is not None
    monkeypatch.setattr(tiny, "SKILLS", {**tiny.SKILLS, "calculator": (("arith", 17, 16, 3e-4, 201),)})
    assert tiny.shipped_skilled_model("calculator") is None
    assert tiny.shipped_skilled_model("checking") is None  # built on the calculator base, whose recipe changed


def test_the_training_commands_and_rollout_use_the_shipped_base_without_building(monkeypatch, tmp_path):
    from agentrl.config.schema import TrainConfig
    from agentrl.tiny import resolve_model, shipped_skilled_model

    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path))
    monkeypatch.setattr(skilled_base, "skilled_model_dir", lambda *a, **k: pytest.fail("built a shipped base"))
    cfg = TrainConfig.model_validate({"model": {"tiny": {"skills": "calculator"}}})
    assert skilled_base.ensure_model(cfg) == resolve_model(cfg) == shipped_skilled_model("calculator")
    assert not list(tmp_path.iterdir())


def test_model_tiny_skills_chooses_the_skilled_base_which_only_the_training_commands_build(monkeypatch, tmp_path):
    from agentrl.config.schema import TrainConfig
    from agentrl.errors import ConfigError
    from agentrl.tiny import resolve_model, skilled_model_path

    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path))
    cfg = TrainConfig.model_validate({"model": {"tiny": {"skills": "calculator", "seed": 3}}})  # seed 3: not shipped
    with pytest.raises(ConfigError, match="model.tiny.skills: 'calculator': this machine has not built that model yet"):
        resolve_model(cfg)  # what `agentrl rollout` does: it never trains one
    built = []

    def build(skill, size, seed):
        built.append((skill, size, seed))
        path = skilled_model_path(skill, size, seed)
        path.mkdir(parents=True)
        (path / "config.json").write_text("{}")
        return path

    monkeypatch.setattr(skilled_base, "skilled_model_dir", build)
    path = skilled_base.ensure_model(cfg)  # what `agentrl train` does
    assert built == [("calculator", "1m", 3)] and path == skilled_model_path("calculator", "1m", 3)
    assert path.parent == tmp_path / "tiny" and resolve_model(cfg) == path
    with pytest.raises(Exception, match="skills"):
        TrainConfig.model_validate({"model": {"tiny": {"skills": "juggling"}}})
