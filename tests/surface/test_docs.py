"""The docs say what the code does: every setting is listed once with its real flags and variable,
and every link between the pages leads to a file and heading that exist."""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
from pathlib import Path

import pytest

from prefixgate.cli import build_parser
from prefixgate.gateway.config import ENV_PREFIX, Settings

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", *(ROOT / "docs").glob("*.md")])
SETTING_ROW = re.compile(r"^\| `(?P<name>[a-z0-9_]+)` \| (?P<flags>[^|]*) \| `(?P<env>[A-Z0-9_]+)` \|")
LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def _settings_rows() -> dict[str, tuple[set[str], str]]:
    text = (ROOT / "docs" / "settings.md").read_text()
    section = text.split("## Every setting", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, tuple[set[str], str]] = {}
    for line in section.splitlines():
        m = SETTING_ROW.match(line)
        if m:
            assert m["name"] not in rows, f"{m['name']} is listed twice"
            rows[m["name"]] = (set(re.findall(r"`(--[a-z0-9-]+)`", m["flags"])), m["env"])
    return rows


def _gateway_flags() -> set[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {o for a in sub.choices["gateway"]._actions for o in a.option_strings}


def test_settings_page_lists_every_setting_and_nothing_else() -> None:
    rows = _settings_rows()
    assert set(rows) == {f.name for f in dataclasses.fields(Settings)}


def test_settings_page_names_real_flags_and_variables() -> None:
    flags = _gateway_flags()
    for name, (listed, env) in _settings_rows().items():
        assert env == ENV_PREFIX + name.upper(), name
        assert listed <= flags, f"{name}: {sorted(listed - flags)} are not flags of prefixgate gateway"


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    fenced = False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#{1,6} (.+)$", line)):
            slug = _slug(m[1])
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(page: Path) -> list[str]:
    out: list[str] = []
    fenced = False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            out += [m["target"] for m in LINK.finditer(line)]
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_lead_to_files_and_headings_that_exist(page: Path) -> None:
    broken = []
    for target in _links(page):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto: not ours to check offline
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_readme_links_every_docs_page() -> None:
    linked = {t.partition("#")[0] for t in _links(ROOT / "README.md")}
    for page in (ROOT / "docs").glob("*.md"):
        assert f"docs/{page.name}" in linked, page.name


def _commands(page: Path) -> list[str]:
    """The ``prefixgate ...`` lines of a page's code blocks, continuations joined, comments cut."""
    out: list[str] = []
    fenced, held = False, ""
    for raw in page.read_text().splitlines():
        if FENCE.match(raw):
            fenced = not fenced
            continue
        if not fenced:
            continue
        line = f"{held} {raw.strip()}" if held else raw.strip()
        held = ""
        if line.endswith("\\"):
            held = line[:-1].rstrip()
            continue
        m = re.match(r"^(?:[A-Z_]+=\S+ )*prefixgate (.*)$", line)
        if m and "..." not in m[1] and "<" not in m[1]:  # placeholders are for the reader
            out.append(m[1].split(" #")[0].strip())
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_commands_in_the_docs_parse(page: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    for command in _commands(page):
        try:
            parser.parse_args(shlex.split(command))
        except SystemExit:
            pytest.fail(f"{page.relative_to(ROOT)}: prefixgate {command}\n{capsys.readouterr().err}")
