"""doccommands: the shell commands, code blocks, paths and links the project's docs show a reader.

Shared by tests/deploy/test_docs_commands.py (everything that can be checked offline) and
tests/e2e/test_localstack.py (the commands that need `make run`'s stack up).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The docs whose commands must stay true: the README and the operator guide, with the
# references split from them. endpoint-picker-protocol.md and envoy-facts.md quote facts,
# not commands to run.
DOCS = ("README.md", "docs/operations.md", "docs/configuration.md", "docs/metrics.md",
        "docs/picking.md")
# The first words of what a reader is told to type, in `inline code` or in an sh block.
COMMAND_WORDS = ("make", "kvgate", "envoy", "curl", "kubectl", "docker", "istioctl", "cp",
                 "kill", "pytest", "promtool", ".venv/bin/python", "python", "python3")

_SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")


@dataclass(frozen=True)
class Command:
    """Command is one command a doc shows: its text as written, where, and its words."""

    doc: str
    text: str

    @property
    def words(self) -> list[str]:
        return shlex.split(self.text, comments=True)


def blocks(doc: str, lang: str) -> list[str]:
    """blocks returns the fenced code blocks of ``doc`` in language ``lang``, dedented."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    found = []
    for m in re.finditer(r"^( *)```(\w*)\n(.*?)^\1```", text, re.S | re.M):
        if m.group(2) == lang:
            indent = len(m.group(1))
            found.append("".join(line[indent:] + "\n" for line in m.group(3).splitlines()))
    return found


def _prose(doc: str) -> str:
    """_prose is ``doc`` without its fenced blocks (whose spans are not inline code)."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    return re.sub(r"^( *)```.*?^\1```", "", text, flags=re.S | re.M)


def spans(doc: str) -> list[str]:
    """spans returns the inline code spans of ``doc``, outside its fenced blocks."""
    return _SPAN.findall(_prose(doc))


def commands(doc: str) -> list[Command]:
    """commands returns every command ``doc`` shows: each line of its sh blocks (a trailing
    backslash continues it; comments dropped) and each inline span that starts with a word of
    COMMAND_WORDS (``a && b`` is two)."""
    found = []
    for block in blocks(doc, "sh"):
        for line in block.replace("\\\n", " ").splitlines():
            line = " ".join(_without_comment(line).split())
            if line:
                found.append(Command(doc, line))
    for span in spans(doc):
        for part in span.split("&&"):
            part = part.strip()
            if part.split(" ", 1)[0] in COMMAND_WORDS:
                found.append(Command(doc, part))
    return found


def _without_comment(line: str) -> str:
    """_without_comment cuts a shell comment (`` # ...`` outside quotes) off ``line``."""
    for m in re.finditer(r"(^|\s)#", line):
        head = line[:m.start()]
        if head.count("'") % 2 == 0 and head.count('"') % 2 == 0:
            return head
    return line


def links(doc: str) -> list[str]:
    """links returns the targets of ``doc``'s markdown links that are not web addresses."""
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", _prose(doc)) if "://" not in t]


def slug(heading: str) -> str:
    """slug is a heading's anchor as GitHub writes it: lower case, punctuation dropped,
    spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(doc: str) -> set[str]:
    """anchors returns the anchors of ``doc``'s headings."""
    return {slug(h) for h in re.findall(r"^#+ (.+)$", _prose(doc), re.M)}


def local_stack_commands() -> list[Command]:
    """local_stack_commands returns the README's commands that talk to `make run`'s stack
    (curl to a loopback address): tests/e2e/test_localstack.py runs each of them."""
    return [c for c in commands("README.md") if c.words[0] == "curl" and "127.0.0.1" in c.text]


# `make run`'s ports as the README writes them, and the banner line that says each one.
STACK_PORTS = {"127.0.0.1:8080": r"Envoy \(send requests here\) +http://127\.0\.0\.1:(\d+)/",
               "127.0.0.1:8000": r"node-0 \(simulated vLLM\) +http://127\.0\.0\.1:(\d+)/",
               "127.0.0.1:9464": r"kvgate metrics +http://127\.0\.0\.1:(\d+)/"}


def for_stack(text: str, banner: str) -> str:
    """for_stack rewrites the README's ports in ``text`` to those the stack's ``banner``
    printed (a busy port is replaced by a free one)."""
    for written, pattern in STACK_PORTS.items():
        m = re.search(pattern, banner)
        assert m, f"the banner does not say {written}'s port:\n{banner}"
        text = text.replace(written, f"127.0.0.1:{m.group(1)}")
    return text
