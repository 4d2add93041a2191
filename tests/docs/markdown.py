"""Just enough Markdown for the doc tests: fenced blocks with their doctest markers, links
outside code, and GitHub's heading anchors."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_MARKER = re.compile(r"^<!--\s*doctest:\s*(?P<marker>.*?)\s*-->$")
_INLINE_CODE = re.compile(r"(`+).*?\1", re.DOTALL)
_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]"  # [text], one level of nested brackets allowed
    r"\(\s*<?(?P<target>[^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)"  # (target "title")
)
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(?P<target>\S+?)>?(?:\s+.*)?$", re.MULTILINE)
_HEADING = re.compile(r"^ {0,3}#{1,6}\s+(?P<text>.*?)\s*#*\s*$")


def markdown_files() -> list[Path]:
    """README.md and every Markdown file under docs/."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


@dataclass(frozen=True)
class Block:
    """One fenced code block."""

    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    marker: str | None  # from `<!-- doctest: ... -->` on the line just before the fence

    @property
    def location(self) -> str:
        return where(self.path, self.line)


def blocks(path: Path) -> list[Block]:
    """Every fenced code block of a Markdown file, in order."""
    found: list[Block] = []
    lines = path.read_text().splitlines()
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        fence = opening.group("fence")
        start = index
        body: list[str] = []
        index += 1
        while index < len(lines) and not _closes(lines[index], fence):
            body.append(lines[index])
            index += 1
        previous = lines[start - 1].strip() if start > 0 else ""
        marker = _MARKER.match(previous)
        found.append(
            Block(
                path=path,
                line=start + 1,
                lang=opening.group("info").strip().split(" ")[0].lower(),
                code="\n".join(body) + "\n",
                marker=marker.group("marker") if marker else None,
            )
        )
        index += 1
    return found


def _closes(line: str, fence: str) -> bool:
    """Whether ``line`` closes a block opened with ``fence``."""
    text = line.strip()
    return text.startswith(fence) and not text.strip(fence[0])


def prose(path: Path, *, code_spans: bool = False) -> list[tuple[int, str]]:
    """(line number, text) of every line outside fenced blocks; inline code removed unless
    ``code_spans``."""
    kept: list[tuple[int, str]] = []
    inside: str | None = None
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        opening = _FENCE.match(line)
        if inside is None and opening is not None:
            inside = opening.group("fence")
            continue
        if inside is not None:
            if _closes(line, inside):
                inside = None
            continue
        kept.append((number, line if code_spans else _INLINE_CODE.sub("", line)))
    return kept


@dataclass(frozen=True)
class Link:
    path: Path
    line: int
    target: str

    @property
    def location(self) -> str:
        return where(self.path, self.line)


def links(path: Path) -> list[Link]:
    """Inline links, images and reference definitions outside code."""
    found = []
    for number, text in prose(path):
        for match in _LINK.finditer(text):
            found.append(Link(path, number, match.group("target")))
        for match in _REFERENCE.finditer(text):
            found.append(Link(path, number, match.group("target")))
    return found


def slug(heading: str, seen: dict[str, int]) -> str:
    """GitHub's anchor for a heading (``seen`` numbers repeated ones: x, x-1, x-2)."""
    text = _INLINE_CODE.sub(lambda m: m.group(0).strip("`"), heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text only
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
    count = seen.get(text, 0)
    seen[text] = count + 1
    return text if count == 0 else f"{text}-{count}"


def anchors(path: Path) -> set[str]:
    """The anchors GitHub makes for a Markdown file's headings."""
    seen: dict[str, int] = {}
    result = set()
    for _, text in prose(path, code_spans=True):
        heading = _HEADING.match(text)
        if heading is not None:
            result.add(slug(heading.group("text"), seen))
    return result
