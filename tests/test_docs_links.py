"""Links between the docs, and the docs the code cites, resolve: every relative link of a page
names a file that exists and, with ``#anchor``, a heading of that page; every page of docs/
the code, configs and scripts mention exists, and every anchor they cite after its name is a
heading there. So a renamed or moved section fails here instead of leaving a dangling citation.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SKIP = {".git", ".venv", ".venv-vllm", ".cache", "runs", "node_modules", "fixtures", "build"}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CITED = re.compile(r"\bdocs/([\w/.-]+?\.md)(#[\w-]+)?")


def _files(pattern: str) -> list[Path]:
    return sorted(p for p in REPO.rglob(pattern) if not SKIP & set(p.relative_to(REPO).parts))


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``page`` (lower case, punctuation dropped, spaces
    to hyphens, ``-1``, ``-2`` ... on repeats), and the ``<a id=...>`` / ``name=`` it holds."""
    seen: dict[str, int] = {}
    out = set(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", page.read_text(encoding="utf-8")))
    in_code = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not re.match(r"#{1,6} ", line):
            continue
        text = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        n = seen.get(text, 0)
        seen[text] = n + 1
        out.add(text if n == 0 else f"{text}-{n}")
    return out


def _markdown_pages() -> list[Path]:
    return [p for p in _files("*.md") if p.parts[len(REPO.parts)] in ("docs", "experiments", "benchmarks")
            or p.parent == REPO]


@pytest.mark.parametrize("page", _markdown_pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_of_a_page_resolves(page: Path) -> None:
    bad = []
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # code blocks hold no links
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading with that anchor in {dest.relative_to(REPO)}")
    assert not bad, bad


def test_every_doc_the_code_cites_exists_with_its_anchor() -> None:
    bad = []
    sources = [*_files("*.py"), *_files("*.yaml"), *_files("*.sh"), *_files("*.html"), REPO / "Makefile",
               REPO / "pyproject.toml"]
    for source in sources:
        for name, anchor in CITED.findall(source.read_text(encoding="utf-8", errors="replace")):
            page = REPO / "docs" / name
            where = f"{source.relative_to(REPO)}: docs/{name}{anchor}"
            if not page.exists():
                bad.append(f"{where}: no such page")
            elif anchor and anchor[1:] not in anchors(page):
                bad.append(f"{where}: no heading with that anchor")
    assert not bad, bad
