"""A tiny tool-using model built locally: byte-level BPE tokenizer, chat template, Qwen2 weights.

No model hub is reachable on the machines agentrl is developed and tested on, so the embedded
default makes its own starting point. ``build_tiny_model`` trains a byte-level BPE tokenizer on
a generated corpus (digits are split one per token, as Qwen's tokenizer does, so numbers are
copied digit by digit), wraps it as a ``PreTrainedTokenizerFast`` with a Qwen2.5-style chat
template, and saves a randomly initialised Qwen2 next to it. Both reload with the standard
``AutoTokenizer`` / ``AutoModelForCausalLM``, and the ids are identical after reload: with
``model_type=qwen2`` transformers 5 loads ``Qwen2Tokenizer``, which rebuilds Qwen's normalizer
and pre-tokenizer and ignores those in ``tokenizer.json``, so the tokenizer is trained with
exactly Qwen's pipeline (NFC, Qwen's split regex, byte level) and both agree.

The chat template renders, for a system prompt with tools, a user turn, an assistant tool call,
a tool result and a final answer::

    <|im_start|>system
    Use the calculator.
    # Tools
    <tools>
    {"type": "function", "function": {...}}
    </tools>
    Call a tool as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
    <|im_start|>user
    What is 12 * 34?<|im_end|>
    <|im_start|>assistant
    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 34"}}
    </tool_call><|im_end|>
    <|im_start|>user
    <tool_response>
    408
    </tool_response><|im_end|>
    <|im_start|>assistant
    #### 408<|im_end|>

It is append-only: the rendering of a conversation is a prefix of the rendering of any
continuation of it, at every assistant boundary. Assistant content (with its ``<|im_end|>``)
is wrapped in ``{% generation %}``, so ``return_assistant_tokens_mask=True`` marks exactly
the tokens a model is trained on; the ``\\n`` after ``<|im_end|>`` is template, not assistant.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

if TYPE_CHECKING:
    from agentrl.config.schema import TrainConfig

__all__ = ["TINY_SIZES", "SKILLS", "SKILL_BASES", "skilled_model_path", "shipped_skilled_model", "skill_recipe_key", "SPECIAL_TOKENS", "TOOL_TOKENS", "CHAT_TEMPLATE", "build_tiny_model", "tiny_model_dir", "resolve_model", "model_dir_arg"]

BUILDER_VERSION = "1"
VOCAB_SIZE = 2048

# name -> Qwen2 shape; parameter counts include the tied embedding
TINY_SIZES: dict[str, dict[str, int]] = {
    "1m": dict(hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512),
    "5m": dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, intermediate_size=1024),
    "18m": dict(hidden_size=384, num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2, intermediate_size=1536),
    # the scaling benchmark's largest (agentrl bench scaling): a GPT-2-small-sized decoder
    "100m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4, intermediate_size=3072),
}

QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

CHAT_TEMPLATE = (
    "{%- if messages and messages[0].role == 'system' %}"
    "{%- set system = messages[0].content %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set system = none %}{%- set rest = messages %}{%- endif %}"
    "{%- if system is not none or tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if system is not none %}{{- system }}{%- endif %}"
    "{%- if tools %}"
    "{%- if system is not none %}{{- '\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.' }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in rest %}"
    "{%- if message.role == 'user' or message.role == 'system' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- if message.tool_calls %}"
    "{%- for call in message.tool_calls %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' }}"
    "{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>' }}"
    "{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or rest[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or rest[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_WORDS = (
    "what is the of and a to in it you that he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up other "
    "about out many then them these so some her would make like him into time has look two more write go see number "
    "no way could people my than first water been call who oil its now find long down day did get come made may part "
    "calculator expression answer tool result sum product total cost price each apples books pencils boxes dollars "
    "cents hours minutes days weeks miles bought sold gave has had buys sells needs spends earns left remaining "
    "correct incorrect response reflect try again use end with question multiply add subtract divide times plus minus "
    "Thought Action Input Observation Final Answer system user assistant function name arguments type object string "
    "properties required description parameters tools call"
).split()


def _corpus(seed: int) -> Iterator[str]:
    """Generated text covering what the tiny model will see: numbers, arithmetic, prose, JSON, markup."""
    rng = random.Random(seed)
    ops = ["+", "-", "*", "/"]
    for _ in range(4000):
        a, b = rng.randint(0, 99999), rng.randint(0, 9999)
        op = rng.choice(ops)
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16)))
        yield f"What is {a} {op} {b}? {words.capitalize()}."
        yield json.dumps({"name": "calculator", "arguments": {"expression": f"{a} {op} {b}"}})
        yield f"#### {rng.randint(-99999, 999999)}\n{words}\n"
        yield f"Thought: I should use the calculator.\nAction: calculator\nAction Input: {a}{op}{b}\nObservation: {a}\nFinal Answer: {b}"
    for _ in range(200):
        yield json.dumps(
            {"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression.",
             "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
        )


def _train_tokenizer(seed: int, corpus: Iterable[str] | None):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    # Qwen2's own pipeline (NFC, its split regex: one token per digit, then byte level), so that
    # transformers' Qwen2Tokenizer, which rebuilds exactly this, gives the same ids.
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus if corpus is not None else _corpus(seed), trainer=trainer)
    return tokenizer


def build_tiny_model(out_dir: str | Path, *, size: str = "1m", seed: int = 0, corpus: Iterable[str] | None = None) -> Path:
    """Train a tokenizer and save it with a freshly initialised Qwen2 of ``size`` into ``out_dir``."""
    import torch
    from tokenizers import AddedToken
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    if size not in TINY_SIZES:
        raise ValueError(f"unknown tiny model size {size!r}; sizes: {', '.join(TINY_SIZES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    raw = _train_tokenizer(seed, corpus)
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    # tool markup: one id each, but not "special", so decoding keeps it (as in Qwen2.5)
    raw.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.save_pretrained(out)

    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model_config = Qwen2Config(
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
        **TINY_SIZES[size],
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(model_config).float()
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, do_sample=False)
    model.save_pretrained(out)
    return out


# skill -> stages of (task, demonstrations' seed, batch size, peak learning rate, most steps): each
# warmed up for 20 steps, then on a cosine towards a tenth of the peak at its most steps, and
# stopped as soon as greedy decoding reproduces every assistant token of CHECK_DEMOS held-out
# demonstrations of its task (checked every CHECK_EVERY steps). Word problems first: several tool
# calls per demonstration, where copying from tool results appears soonest, though late and
# abruptly, and at a step that varies with the draw of demonstrations (hence a fixed draw); then
# the arith questions, which the copying carries over to quickly. The runs behind this:
# docs/learning.md. The build: agentrl/trainer/skilled_base.py.
SKILLS: dict[str, tuple[tuple[str, int, int, float, int], ...]] = {
    "calculator": (("word", 17, 16, 2e-3, 1500), ("arith", 17, 16, 3e-4, 200)),
    # solver_verifier's verifier checks an answer it is told against its own with the calculator
    # (`<own> - <told>`): copying two numbers from the context into a call, which the calculator
    # base does not do from a user message (docs/roles.md)
    "checking": (("solver_verifier", 19, 16, 1e-3, 2000),),
}
# a skill built on another skill's model (its stages continue from that model, shipped or built)
SKILL_BASES: dict[str, str] = {"checking": "calculator"}
SKILLS_VERSION = "3"


def skilled_model_path(skill: str, size: str = "1m", seed: int = 0, cache_root: str | Path | None = None) -> Path:
    """Where the tiny model with ``skill`` is cached (built or not): its name holds a hash of the
    recipe, the tiny model it starts from and the transformers version."""
    import transformers

    recipe = skill_recipe_key(skill, size, seed)  # refuses an unknown skill
    key = hashlib.sha256(f"{recipe}|{transformers.__version__}".encode()).hexdigest()[:12]
    root = Path(cache_root) if cache_root is not None else _cache_root()
    return root / f"{size}-seed{seed}-{skill}-{key}"


# Skilled models that ship with agentrl (built by scripts/build_skilled_base.py, a few minutes on a
# 2-core machine), so that a first run does not wait for the build. Each folder's recipe.json
# names the recipe it was built by; a folder built by another recipe is not used.
SHIPPED_MODELS = Path(__file__).resolve().parent / "tiny_models"


def skill_recipe_key(skill: str, size: str = "1m", seed: int = 0) -> str:
    """What a skilled model's weights follow from: the skill's recipe, the tiny model's builder and
    chat template, its size and seed (a shipped model's folder records it)."""
    if skill not in SKILLS:
        raise ValueError(f"unknown skill {skill!r}; skills: {', '.join(SKILLS)}")
    recipe = f"{SKILLS_VERSION}|{skill}|{SKILLS[skill]}|{BUILDER_VERSION}|{size}|{seed}|{CHAT_TEMPLATE}"
    if skill in SKILL_BASES:
        recipe += f"|on {skill_recipe_key(SKILL_BASES[skill], size, seed)}"
    return hashlib.sha256(recipe.encode()).hexdigest()[:12]


def shipped_skilled_model(skill: str, size: str = "1m", seed: int = 0) -> Path | None:
    """The skilled model shipped with agentrl for (skill, size, seed), if one was built by the
    current recipe; else None (it is then built once on this machine)."""
    path = SHIPPED_MODELS / f"{size}-seed{seed}-{skill}"
    try:
        recipe = json.loads((path / "recipe.json").read_text())
    except FileNotFoundError:
        return None
    return path if recipe.get("key") == skill_recipe_key(skill, size, seed) else None


def _cache_root() -> Path:
    return Path(os.environ.get("AGENTRL_CACHE", Path.home() / ".cache" / "agentrl")) / "tiny"


def _model_key(size: str, seed: int) -> str:
    import transformers

    key = hashlib.sha256(f"{BUILDER_VERSION}|{size}|{seed}|{CHAT_TEMPLATE}|{transformers.__version__}".encode()).hexdigest()[:12]
    return f"{size}-seed{seed}-{key}"


def tiny_model_dir(size: str = "1m", seed: int = 0, cache_root: str | Path | None = None) -> Path:
    """The tiny model of ``size``, built once into a cache directory and reused afterwards.

    The build goes to a temporary directory first and is renamed into place, so concurrent
    callers and interrupted builds never see a half-written model.
    """
    root = Path(cache_root) if cache_root is not None else _cache_root()
    return build_once(root / _model_key(size, seed), lambda staging: build_tiny_model(staging, size=size, seed=seed))


def build_once(final: Path, build: Callable[[Path], object]) -> Path:
    """``final``, built by ``build(staging)`` into a temporary sibling directory and renamed into
    place unless it already holds a model: concurrent callers and interrupted builds never see a
    half-written one."""
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        build(staging)
        try:
            staging.rename(final)
        except OSError:
            if not (final / "config.json").is_file():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def resolve_model(cfg: "TrainConfig") -> Path:
    """The model a job starts from: ``model.path``, else the tiny model of ``model.tiny`` (with
    its skills, when it names any); with ``model.chat_template``, that model under this template
    (``with_chat_template``), so every process that loads its tokenizer renders with it."""
    path = _resolve_model(cfg)
    return with_chat_template(path, cfg.model.chat_template) if cfg.model.chat_template is not None else path


def with_chat_template(model_dir: str | Path, template: str | Path, cache_root: str | Path | None = None) -> Path:
    """A directory that is ``model_dir`` with the chat template of the jinja file ``template``: the
    model's files linked, ``chat_template.jinja`` the template, ``tokenizer_config.json`` without a
    template of its own. Built once per (model, template text) into the cache, so the trainer, the
    engine's process and SGLang servers, which each load the tokenizer from a path, all get it."""
    model_dir, text = Path(model_dir).resolve(), Path(template).read_text(encoding="utf-8")
    key = hashlib.sha256(f"{model_dir}|{text}".encode()).hexdigest()[:16]
    root = Path(cache_root) if cache_root is not None else _cache_root().parent / "templated"

    def build(staging: Path) -> None:
        for item in model_dir.iterdir():
            if item.name not in ("chat_template.jinja", "tokenizer_config.json"):
                (staging / item.name).symlink_to(item)
        (staging / "chat_template.jinja").write_text(text, encoding="utf-8")
        config_file = model_dir / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        config.pop("chat_template", None)
        (staging / "tokenizer_config.json").write_text(json.dumps(config, indent=2))

    return build_once(root / f"{model_dir.name}-{key}", build)


def _resolve_model(cfg: "TrainConfig") -> Path:
    if cfg.model.path is not None:
        return Path(cfg.model.path)
    tiny = cfg.model.tiny
    if tiny.skills != "none":
        shipped = shipped_skilled_model(tiny.skills, tiny.size, seed=tiny.seed)
        if shipped is not None:
            return shipped
        path = skilled_model_path(tiny.skills, tiny.size, seed=tiny.seed)
        if not (path / "config.json").is_file():
            from agentrl.errors import ConfigError

            raise ConfigError([("model.tiny.skills", f"{tiny.skills!r}: this machine has not built that model yet; "
                                "`agentrl train` builds it (once, a few minutes) before it trains")])
        return path
    return tiny_model_dir(tiny.size, seed=tiny.seed)


def model_dir_arg(value: str | Path) -> Path:
    """A model directory given on a command line: ``tiny`` (or ``tiny:SIZE``, SIZE one of
    ``TINY_SIZES``) is the built-in tiny model, as ``model=tiny`` is for the config commands,
    so every command that takes a model directory also reaches it; anything else is a path."""
    text = str(value)
    name, _, size = text.partition(":")
    if name != "tiny" or Path(text).exists():  # a real directory named "tiny" wins
        return Path(text)
    size = size or "1m"
    if size not in TINY_SIZES:
        raise ValueError(f"{text}: the tiny model comes in sizes {', '.join(TINY_SIZES)}, not {size!r}")
    return tiny_model_dir(size)
