"""The docs: the site builds strictly, the generated reference pages match the code, the README stays a front page.

All in process (mkdocs through its Python API), so these are fast-tier tests.
"""
from __future__ import annotations

import logging
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify

from docsgen.pages import PAGES, REGENERATE, ROOT, stale

README = ROOT / "README.md"
README_MAX_LINES = 150
LINK = re.compile(r"\]\(([^)\s]+)\)|src=\"([^\"]+)\"")  # [text](target) and <img src="target">
EXTERNAL = ("http://", "https://", "mailto:")


@pytest.mark.parametrize("path", sorted(PAGES))
def test_a_generated_page_matches_what_the_code_renders_now(path: str) -> None:
    committed = (ROOT / path).read_text(encoding="utf-8")
    assert committed == PAGES[path](), f"{path} is stale: run `{REGENERATE}` from the repository root and commit it"


def test_a_changed_server_default_makes_the_configuration_page_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    from servers.config import ServerConfig

    monkeypatch.setattr(ServerConfig.__dataclass_fields__["max_merge_tokens"], "default", 4099)
    assert "docs/reference/configuration.md" in stale()


def test_a_changed_setting_default_makes_the_configuration_page_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    from jobs.settings import Settings

    monkeypatch.setattr(Settings.model_fields["checkpoint_every"], "default", 9)
    assert "docs/reference/configuration.md" in stale()


def test_the_site_builds_with_strict_checks(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    caplog.set_level(logging.INFO, logger="mkdocs")  # the strict count sees every warning, whatever the root level
    site = tmp_path / "site"
    build(load_config(config_file=str(ROOT / "mkdocs.yml"), site_dir=str(site), strict=True))
    assert (site / "index.html").exists() and (site / "img" / "architecture.svg").exists()
    assert (site / "reference" / "cli" / "index.html").exists()


def test_the_readme_is_a_front_page() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (f"README.md has {len(lines)} lines, at most {README_MAX_LINES}: move the "
                                            f"details into a page of docs/ and link it")


def test_the_readme_links_only_to_files_and_headings_that_exist() -> None:
    missing = [target for target in readme_links() if not link_resolves(target)]
    assert readme_links() and not missing, f"README.md links to what does not exist: {missing}"


def test_the_readme_shows_the_picture_of_the_parts_and_its_two_commands() -> None:
    text = README.read_text(encoding="utf-8")
    pictures = [t for t in readme_links() if t.endswith(".svg")]
    assert pictures, "README.md shows no picture of the parts"
    assert all(ET.parse(ROOT / t).getroot().tag == "{http://www.w3.org/2000/svg}svg" for t in pictures)
    for command in ("./scripts/demo.sh", "./scripts/test.sh"):
        assert f"\n{command}\n" in text and (ROOT / command).stat().st_mode & 0o111, command


def readme_links() -> list[str]:
    """Every local link target of the README (external links left out)."""
    found = [a or b for a, b in LINK.findall(README.read_text(encoding="utf-8"))]
    return [t for t in found if not t.startswith(EXTERNAL)]


def link_resolves(target: str) -> bool:
    """Whether a README link names a file that exists and, when it has an anchor, a heading of that Markdown file."""
    path, _, anchor = target.partition("#")
    file = ROOT / path if path else README
    if not file.exists():
        return False
    return not anchor or anchor in heading_anchors(file)


def heading_anchors(page: Path) -> set[str]:
    """The anchors Python-Markdown's toc gives a page's headings (code spans reduced to their text)."""
    headings = re.findall(r"^#{1,6} (.+)$", page.read_text(encoding="utf-8"), flags=re.MULTILINE)
    return {slugify(heading.replace("`", ""), "-") for heading in headings}


# ---- the TLS proxy example of docs/deploying.md ---------------------------------------------------------------------
DEPLOYING = ROOT / "docs" / "deploying.md"
CADDY_DURATION = re.compile(r"^(\d+)(s|m|h)$")
CADDY_UNITS = {"s": 1, "m": 60, "h": 3600}


def test_the_tls_proxy_example_sets_the_timeouts_that_the_api_leaves_to_the_proxy() -> None:
    from jobs.settings import Settings

    # the Caddyfile of "TLS in front of the API": a global options block first, then the site
    blocks = caddy_blocks(fenced_block(DEPLOYING, "### TLS in front of the API"))
    assert blocks[0][0] == (), "the global options block (`{ ... }`) must come first"
    timeouts = {line[0]: line[1:] for line in blocks_at(blocks, ("", "servers", "timeouts"))}
    seconds = {name: caddy_seconds(value) for name, value in timeouts.items()}
    assert set(seconds) == {"read_header", "read_body", "write", "idle"}, timeouts
    # a request head is short; a body may take as long as the API's own body deadline (its 408 comes first)
    assert 0 < seconds["read_header"] <= 60
    assert seconds["read_body"] >= Settings.model_fields["body_deadline_seconds"].default
    assert seconds["write"] > 0 and 0 < seconds["idle"] <= 300
    assert ["reverse_proxy", "127.0.0.1:8000"] in blocks_at(blocks, ("batch.example.internal",))


def fenced_block(page: Path, heading: str) -> str:
    """The first fenced code block after `heading` on `page`."""
    text = page.read_text(encoding="utf-8")
    assert heading in text, f"{page.name} has no heading {heading!r}"
    found = re.search(r"^```[^\n]*\n(.*?)^```", text[text.index(heading):], flags=re.MULTILINE | re.DOTALL)
    assert found, f"no code block under {heading!r}"
    return found.group(1)


def caddy_blocks(caddyfile: str) -> list[tuple[tuple[str, ...], list[str]]]:
    """Each directive line of a Caddyfile with the path of blocks it sits in (a global options block is "")."""
    path: list[str] = []
    lines: list[tuple[tuple[str, ...], list[str]]] = []
    for raw in caddyfile.splitlines():
        words = raw.split("#", 1)[0].split()
        if words[-1:] == ["{"]:
            path.append(" ".join(words[:-1]))
            lines.append((tuple(path[:-1]), words[:-1]))
        elif words == ["}"]:
            assert path, "a } closes no block"
            path.pop()
        elif words:
            lines.append((tuple(path), words))
    assert not path, f"unclosed blocks: {path}"
    return lines


def blocks_at(blocks: list[tuple[tuple[str, ...], list[str]]], path: tuple[str, ...]) -> list[list[str]]:
    """The directive lines directly inside the block at `path`."""
    return [line for where, line in blocks if where == path]


def caddy_seconds(value: list[str]) -> int:
    """A Caddyfile duration (one word: 10s, 5m, 1h) in seconds."""
    assert len(value) == 1 and (match := CADDY_DURATION.match(value[0])), value
    return int(match.group(1)) * CADDY_UNITS[match.group(2)]
