"""The docs site builds in strict mode, so a broken page link, anchor, nav entry or repository file
link fails ``pytest`` (and CI, which installs the ``docs`` extra: a skip there is a failure); the
reference pages are generated from the schema and the commands' ``--help``; the README's links
land on pages and anchors that exist."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
needs_mkdocs = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
    reason='mkdocs is not installed: pip install -e ".[docs]"',
)


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True, text=True, timeout=600, env=env, cwd=REPO,
    )


class Ids(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        self.ids.update(value for name, value in attrs if name == "id" and value)


def page_ids(html: Path) -> set[str]:
    parser = Ids()
    parser.feed(html.read_text())
    return parser.ids


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    if os.environ.get("AGENTRL_DOCS_SITE"):  # .ci/run built it strictly from this tree a moment ago
        return Path(os.environ["AGENTRL_DOCS_SITE"])
    site = tmp_path_factory.mktemp("site")
    out = mkdocs_build(REPO / "mkdocs.yml", site)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    return site


@needs_mkdocs
def test_the_site_builds_strictly_with_every_docs_page_in_it(site):
    pages = sorted(p.relative_to(REPO / "docs").with_suffix("").as_posix() for p in (REPO / "docs").rglob("*.md"))
    for page in pages:
        # a folder's index.md is the folder's page (environments/index.md -> environments/index.html)
        built = site / (page.removesuffix("index") + "index.html" if page.rsplit("/", 1)[-1] == "index" else f"{page}/index.html")
        assert built.exists(), f"docs/{page}.md was not built"


@needs_mkdocs
def test_the_configuration_reference_lists_every_schema_key_with_its_type_default_and_doc(site):
    from agentrl.config.help import config_keys, schema_docs

    html = (site / "reference/configuration/index.html").read_text()
    rows = re.findall(r"<tr>\s*<td><code>([\w.]+)</code></td>\s*<td><code>([^<]*)</code></td>\s*<td><code>([^<]*)</code></td>", html)
    keys = [key for key, *_ in rows]
    assert sorted(keys) == sorted(key for key, *_ in config_keys())
    by_key = {key: (type_name, default) for key, type_name, default in rows}
    assert by_key["data.train_batch_size"] == ("int", "16")  # the schema's; the quickstart preset's 8 beside it
    assert re.search(r"<code>data\.train_batch_size</code></td>\s*<td><code>int</code></td>\s*<td><code>16</code></td>\s*<td><code>8</code></td>", html)
    assert schema_docs()["DataConfig.train_batch_size"] == "prompts per step" and "prompts per step</td>" in html


@needs_mkdocs
def test_the_cli_reference_has_every_command_and_subcommand_help(site):
    from agentrl.cli import COMMANDS

    ids = page_ids(site / "reference/cli/index.html")
    assert {f"agentrl-{name}" for name in COMMANDS} <= ids
    assert {"agentrl-replay-show", "agentrl-bench-engine", "agentrl-data-validate", "agentrl-tools-call"} <= ids
    html = (site / "reference/cli/index.html").read_text()
    assert "usage: agentrl replay show" in html and "--min-reward" in html


@needs_mkdocs
def test_the_readme_links_land_on_files_and_anchors_that_exist(site):
    readme = (REPO / "README.md").read_text()
    links = [link for link in re.findall(r"\]\(([^)\s]+)\)", readme) if not re.match(r"[a-z]+://", link)]
    assert any(link.startswith("docs/") for link in links)
    for link in links:
        path, _, anchor = link.partition("#")
        assert not path or (REPO / path).exists(), f"README links {link}: no such file"
        if anchor and not path:  # a heading of the README itself, as GitHub writes its anchors
            headings = re.findall(r"^#+ (.+)$", readme, flags=re.MULTILINE)
            slugs = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
            assert anchor in slugs, f"README links #{anchor}: no README heading has that anchor"
        elif anchor:
            assert path.startswith("docs/") and path.endswith(".md"), f"README links {link}: anchors only into docs pages"
            page = path.removeprefix("docs/").removesuffix(".md")
            html = site / ("index.html" if page == "index" else f"{page}/index.html")
            assert anchor in page_ids(html), f"README links {link}: docs/{page}.md has no heading with that anchor"


def test_the_readme_is_a_front_door_with_the_two_commands_as_ci_runs_them():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200, "the README is the front door: reference material goes to docs/"
    assert 'python3 -m venv .venv && .venv/bin/pip install "torch==2.13.0" -e . && .venv/bin/agentrl train\n' in readme
    assert 'python3 -m venv .venv && .venv/bin/pip install "torch==2.13.0" -e ".[test]" && .venv/bin/python -m pytest\n' in readme
    ci = (REPO / ".ci" / "run").read_text()
    assert '.venv/bin/pip install -q "torch==2.13.0" -e ".[test]"' in ci and "\n.venv/bin/python -m pytest" in ci


def test_every_docs_page_is_in_the_nav():
    nav_yaml = (REPO / "mkdocs.yml").read_text()
    listed = set(re.findall(r":\s*([\w/.-]+\.md)\s*$", nav_yaml, flags=re.MULTILINE))
    written = {p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").rglob("*.md")}
    assert written <= listed, f"docs pages missing from mkdocs.yml's nav: {sorted(written - listed)}"


def test_every_docs_page_the_code_names_exists():
    # the schema's comments are `agentrl train --help`'s docs: a user follows the page they name
    named: dict[str, str] = {}
    for folder in ("agentrl", "agent_loops", "interactions", "tools", "data_prep", "configs"):
        for source in sorted((REPO / folder).rglob("*")):
            if source.suffix in (".py", ".yaml"):
                for page in re.findall(r"docs/[\w/-]+\.md", source.read_text()):
                    named.setdefault(page, source.relative_to(REPO).as_posix())
    assert "docs/training.md" in named
    missing = {page: source for page, source in named.items() if not (REPO / page).exists()}
    assert not missing, f"pages named in the code that do not exist (page: first file naming it): {missing}"


@needs_mkdocs
def test_a_strict_build_with_this_config_fails_on_a_broken_link_anchor_and_an_unlisted_page(tmp_path):
    ours = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    config = {key: ours[key] for key in ("site_name", "strict", "validation", "markdown_extensions")}  # not the hooks, theme or nav
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n## Real heading\n\n[ok](#real-heading) [gone](gone.md) [bad anchor](other.md#nowhere)\n")
    (docs / "other.md").write_text("# Other\n")
    (docs / "unlisted.md").write_text("# Not in the nav\n")
    config.update(docs_dir=str(docs), theme={"name": "mkdocs"}, nav=["index.md", "other.md"])
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    out = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert out.returncode == 1, out.stderr[-3000:]
    warnings = "\n".join(line for line in out.stderr.splitlines() if line.startswith("WARNING"))
    assert "'gone.md'" in warnings  # each a warning, which strict mode turns into a failed build
    assert "#nowhere" in warnings
    assert 'not included in the "nav"' in warnings and "- unlisted.md" in out.stderr
    assert "#real-heading" not in out.stderr


@needs_mkdocs
def test_a_link_to_a_repository_file_is_checked_and_shown_as_its_path():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import docs_hooks
    finally:
        sys.path.remove(str(REPO / "scripts"))

    class File:
        src_uri = "plugins.md"

    class Page:
        file = File()

    config = {"docs_dir": str(REPO / "docs")}
    text = "see [`examples/plugin_package/`](../examples/plugin_package) and [the policy](../SECURITY.md), [a page](rewards.md)"
    out = docs_hooks.on_page_markdown(text, Page(), config, None)
    assert out == "see `examples/plugin_package/` and the policy (`SECURITY.md`), [a page](rewards.md)"
    with pytest.raises(AssertionError):  # a missing file is a warning, which fails the strict build
        with _warnings_raise():
            docs_hooks.on_page_markdown("[x](../no_such_file.md)", Page(), config, None)


class _warnings_raise:
    """Turns the hook's log warnings into an AssertionError naming the message."""

    def __enter__(self):
        import logging

        class Raise(logging.Handler):
            def emit(self, record):
                raise AssertionError(record.getMessage())

        self.handler = Raise(level=logging.WARNING)
        self.logger = logging.getLogger("mkdocs.plugins.agentrl_docs")
        self.logger.addHandler(self.handler)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)
        return False
