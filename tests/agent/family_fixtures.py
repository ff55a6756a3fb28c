"""Tokenizers of real model families for tests: the real chat template, and a stand-in vocabulary
or, for five families, the released one (``real_vocab.py``).

``tests/fixtures/families/<family>/chat_template.jinja`` is the family's released chat template
(source and license in that folder's README). No model hub is reachable here, so the vocabulary
is a small byte-level BPE trained locally (as ``agentrl.tiny`` does) around the family's exact
special tokens, eos/bos/pad and ``generation_config.json`` eos ids. What the token-exactness
tests check - how the template renders turns and where its special tokens fall - depends on
the template and the special tokens, not on how ordinary words are split.
"""

from __future__ import annotations

import json
from pathlib import Path

from real_vocab import VOCABS as REAL_VOCABS
from real_vocab import build_tokenizer as build_real_tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "families"
SPECS: dict[str, dict] = {k: v for k, v in json.loads((FIXTURES / "families.json").read_text()).items() if not k.startswith("_")}
FAMILIES = list(SPECS)
REAL_VOCAB_FAMILIES = list(REAL_VOCABS)


def family_template(family: str) -> str:
    return (FIXTURES / family / "chat_template.jinja").read_text()


def build_family_dir(family: str, out_dir: Path, *, real_vocab: bool = False) -> Path:
    """A tokenizer directory (tokenizer.json, tokenizer_config.json, generation_config.json) for
    ``family``: the stand-in vocabulary, or with ``real_vocab`` the released one (``real_vocab.py``,
    for the families in ``REAL_VOCAB_FAMILIES``)."""
    from transformers import PreTrainedTokenizerFast

    spec = SPECS[family]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = build_real_tokenizer(family) if real_vocab else _standin_tokenizer(spec)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token=spec["eos_token"],
        bos_token=spec["bos_token"],
        pad_token=spec["pad_token"],
        chat_template=family_template(family),
        model_max_length=8192,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.save_pretrained(out)
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in spec["generation_config_eos"]]
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids if len(eos_ids) > 1 else eos_ids[0]}))
    return out


def _standin_tokenizer(spec: dict):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    from agentrl.tiny import QWEN2_SPLIT_REGEX, _corpus

    # agentrl.tiny's pipeline, trained without tiny's own special tokens: only the family's are added
    raw = Tokenizer(models.BPE())
    raw.normalizer = normalizers.NFC()
    raw.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    raw.train_from_iterator((line for _, line in zip(range(3000), _corpus(0))), trainer=trainer)
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec["added_tokens"]])
    return raw
