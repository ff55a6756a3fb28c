"""Every config key is read by some code: a knob that is validated and then ignored is a lie.

For each leaf of ``TrainConfig`` (``actor.optim.lr``, ...) the package source must read it as an
attribute, reached through the section that holds it: ``<x>.actor.optim.lr`` where ``x`` holds a
``TrainConfig``, ``<y>.optim.lr`` where ``y`` holds an ``ActorConfig``, or ``<z>.lr`` where ``z``
holds an ``OptimConfig``. A name holds a section when it is annotated with the section's class
(``cfg: TrainConfig``, ``config: ActorConfig``), is assigned from an access that ends at it
(``kl = cfg.algorithm.kl_ctrl``, ``cfg = self.config``), or is ``self`` in a method of the
section's own class (``TrainerConfig.planned_steps`` reads ``self.total_epochs``). A key that no code reads this way fails the test by name;
remove it, wire it, or (when it is read in a way this scan cannot see) list it in ``READ_ELSEWHERE``
with the reason.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel

from agentrl.config.schema import TrainConfig

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("agentrl", "agent_loops", "tools", "interactions")
SCHEMA = REPO / "agentrl" / "config" / "schema.py"  # defines the keys: only its methods' reads count

# key -> why the scan cannot see its read
READ_ELSEWHERE: dict[str, str] = {}


def sections(model: type[BaseModel] = TrainConfig, path: tuple[str, ...] = ()):
    """(path, class) of every section, the root first."""
    yield path, model
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from sections(field.annotation, path + (name,))


def leaf_keys() -> list[tuple[str, ...]]:
    return [
        path + (name,)
        for path, model in sections()
        for name, field in model.model_fields.items()
        if not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel))
    ]


def source_files() -> dict[str, tuple[str, str | None]]:
    """label -> (text, the class whose `self` it is written in); schema.py one class at a time."""
    files = {str(p): (p.read_text(), None) for root in SOURCES for p in (REPO / root).rglob("*.py") if p != SCHEMA}
    for chunk in re.split(r"^(?=class )", SCHEMA.read_text(), flags=re.M)[1:]:
        name = re.match(r"class (\w+)", chunk).group(1)
        files[f"{SCHEMA}:{name}"] = (chunk, name)
    return files


def aliases(text: str, self_class: str | None = None) -> dict[tuple[str, ...], set[str]]:
    """The names that hold each section in one file."""
    found: dict[tuple[str, ...], set[str]] = {}
    for path, model in sections():  # parents come first, so their aliases are known here
        names = set(re.findall(rf"\b(\w+)\s*:\s*[\"']?{model.__name__}\b", text))
        if model.__name__ == self_class:
            names.add("self")
        if not path:
            names |= set(re.findall(r"\b(\w+)\s*=\s*(?:load_config|validate_config|TrainConfig)\(", text))
        for i in range(len(path)):
            rest = r"\.".join(path[i:])
            for parent in found.get(path[:i], ()):
                names |= set(re.findall(rf"\b(\w+)\s*=\s*(?:[\w.]*\.)?{parent}\.{rest}\b(?![\w.(\[])", text))
        while True:  # copies of a holder hold the section too: `cfg = self.config`
            more = {m for a in names for m in re.findall(rf"\b(\w+)\s*=\s*(?:[\w.]*\.)?{a}\b(?![\w.(\[])", text)}
            if more <= names:
                break
            names |= more
        found[path] = names
    return found


def readers(key: tuple[str, ...], files: dict[str, tuple[str, str | None]], held: dict[str, dict]) -> list[str]:
    out = []
    for file, (text, _) in files.items():
        for i in range(len(key)):
            rest = r"\.".join(key[i:])
            if any(re.search(rf"\b{alias}\.{rest}\b", text) for alias in held[file].get(key[:i], ())):
                out.append(file)
                break
    return out


def test_every_config_key_is_read_by_some_code():
    files = source_files()
    held = {file: aliases(text, self_class) for file, (text, self_class) in files.items()}
    unread = [".".join(k) for k in leaf_keys() if ".".join(k) not in READ_ELSEWHERE and not readers(k, files, held)]
    assert not unread, f"config keys that no code reads (wire them or remove them): {', '.join(unread)}"


def test_the_scan_finds_reads_through_each_kind_of_alias():
    """The scan itself: a direct chain, an annotated section, an assigned section; and a miss."""
    text = (
        "def f(cfg: TrainConfig, opt: OptimConfig, actor: ActorConfig):\n"
        "    kl = cfg.algorithm.kl_ctrl\n"
        "    a = actor\n"
        "    return cfg.data.seed, opt.lr, kl.horizon, a.clip_ratio, other.trainer.seed, engine.model.dtype\n"
    )
    files = {"x.py": (text, None), "schema.py:TrainerConfig": ("    return self.total_epochs, self.n", "TrainerConfig")}
    held = {label: aliases(text, self_class) for label, (text, self_class) in files.items()}
    assert readers(("data", "seed"), files, held) == ["x.py"]
    assert readers(("sft", "optim", "lr"), files, held)  # OptimConfig is the type of every optim
    assert readers(("algorithm", "kl_ctrl", "horizon"), files, held)
    assert readers(("actor", "clip_ratio"), files, held)
    assert readers(("trainer", "total_epochs"), files, held) == ["schema.py:TrainerConfig"]
    assert not readers(("trainer", "seed"), files, held)  # `other` holds no config
    assert not readers(("rollout", "n"), files, held)  # `self` of another class
    assert not readers(("model", "dtype"), files, held)  # a torch model's dtype is no config read
    assert not readers(("model", "path"), files, held)


def test_every_listed_exception_is_a_real_key():
    keys = {".".join(k) for k in leaf_keys()}
    assert set(READ_ELSEWHERE) <= keys, set(READ_ELSEWHERE) - keys
