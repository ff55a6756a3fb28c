"""The names an environment's library gives its environments, as agentrl resolves them: a library's
own id where it is not an importable name (verifiers' ``vf-calc-tool``), checked by the config
loader and the data check (``environment_problem``) and resolved by ``agentrl.environments.spec``."""

from __future__ import annotations

from typing import Callable

__all__ = ["library_module", "environment_problem"]


def library_module(library: str | None, name: str) -> str | None:
    """The module a library's own environment id names, where that is not the name itself:
    verifiers' ``load_environment(env_id)`` (the id ``vf-eval`` and ``vf.load_environment`` take)
    imports what follows the id's last ``/`` with each ``-`` read as ``_`` (``vf-calc-tool`` and
    ``owner/vf-calc-tool``: ``vf_calc_tool``). None for other libraries and ``pkg.mod:attr``."""
    if library != "verifiers" or ":" in name:
        return None
    module = name.replace("-", "_").split("/")[-1]
    return None if module == name else module


def environment_problem(import_problem: Callable[[str, str], str | None], library: str | None, name: str) -> str | None:
    """Why ``name`` does not load as an environment of ``library`` (None: it does), asked through
    ``import_problem(group, name)`` (``PluginRegistry.import_problem``): as an entry point or
    module, else as the module its library's own id names (``library_module``)."""
    problem = import_problem("environments", name)
    module = library_module(library, name) if problem is not None else None
    if module is None:
        return problem
    other = import_problem("environments", module)
    return None if other is None else f"{library} reads the id {name!r} as the module {module!r}: {other}"
