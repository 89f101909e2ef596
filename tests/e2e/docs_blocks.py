"""The ```bash blocks of README.md and docs/*.md, split into commands, with the `<!-- docs-test: ... -->` marker
written right before a block that says how tests/e2e/test_docs_commands.py runs it (docs/testing.md, "Docs
commands"). A marker holds directives separated by `;`:

- `skip (REASON)`: the block is not run;
- `skip-line TEXT (REASON)`: the block's commands that contain TEXT are not run;
- `fails TEXT (REASON)`: the block's commands that contain TEXT must exit with a non-zero status (a refusal);
- `set KEY=VALUE`: `--set KEY=VALUE` is appended to each `fitlm train` and `fitlm profile` command of the block;
- `sub OLD => NEW`: OLD is replaced by NEW in the block's text (it must occur);
- `after FILE`: the block runs in a copy of the working directory FILE's blocks left (README.md's tour, ...).

Every skip carries its reason, and `python -m tests.e2e.docs_blocks` prints the table of what runs and what not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"<!--\s*docs-test:(.*?)-->", re.S)
HEREDOC = re.compile(r"<<-?\s*(['\"]?)(\w+)\1")


class MarkerError(ValueError):
    """A marker that cannot be honoured: unknown directive, skip without reason, a sub that matches nothing."""


def doc_files(root: Path = ROOT) -> list[str]:
    return ["README.md", *sorted(p.relative_to(root).as_posix() for p in (root / "docs").glob("*.md"))]


@dataclass
class Command:
    line: int  # the markdown file's line of its first line (1-based)
    text: str  # as written: continuation lines and heredoc bodies included, the block's `sub`s applied
    skip: str | None = None  # the reason it is not run
    fails: str | None = None  # why it must exit with a non-zero status


@dataclass
class Block:
    file: str
    line: int  # the line of the opening fence
    text: str
    skip: str | None = None
    after: str | None = None
    sets: list[str] = field(default_factory=list)
    subs: list[tuple[str, str]] = field(default_factory=list)
    skip_lines: list[tuple[str, str]] = field(default_factory=list)
    fail_lines: list[tuple[str, str]] = field(default_factory=list)
    commands: list[Command] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def _reason(text: str) -> tuple[str, str]:
    """Split `HEAD (REASON)` at its last balanced parenthesized group."""
    text = text.strip()
    if not text.endswith(")"):
        raise MarkerError(f"{text!r}: needs a reason in parentheses at its end")
    depth = 0
    for i in range(len(text) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(text[i], 0)
        if depth == 0:
            reason = text[i + 1 : -1].strip()
            if not reason:
                raise MarkerError(f"{text!r}: the reason is empty")
            return text[:i].strip(), reason
    raise MarkerError(f"{text!r}: unbalanced parentheses")


def _directives(marker: str) -> list[str]:
    """The marker split at each `;` outside parentheses (a reason may hold one)."""
    parts, depth, cur = [], 0, ""
    for c in marker:
        depth += {"(": 1, ")": -1}.get(c, 0)
        if c == ";" and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += c
    return [p.strip() for p in [*parts, cur] if p.strip()]


def parse_marker(block: Block, marker: str) -> None:
    for directive in _directives(marker):
        word, _, rest = directive.partition(" ")
        if word == "skip":
            head, block.skip = _reason(directive)
            if head != "skip":
                raise MarkerError(f"{block.where}: {directive!r}: `skip (REASON)`")
        elif word == "skip-line":
            text, reason = _reason(rest)
            if not text:
                raise MarkerError(f"{block.where}: {directive!r}: `skip-line TEXT (REASON)`")
            block.skip_lines.append((text, reason))
        elif word == "fails":
            text, reason = _reason(rest)
            if not text:
                raise MarkerError(f"{block.where}: {directive!r}: `fails TEXT (REASON)`")
            block.fail_lines.append((text, reason))
        elif word == "set" and re.fullmatch(r"\S+=\S+", rest.strip()):
            block.sets.append(rest.strip())
        elif word == "sub" and " => " in rest:
            old, new = rest.split(" => ", 1)
            block.subs.append((old.strip(), new.strip()))
        elif word == "after" and rest.strip():
            block.after = rest.strip()
        else:
            raise MarkerError(
                f"{block.where}: unknown docs-test directive {directive!r} (skip (REASON), skip-line TEXT (REASON), "
                "fails TEXT (REASON), set KEY=VALUE, sub OLD => NEW, after FILE)"
            )


def _scan(line: str, quote: str | None) -> tuple[int, str | None]:
    """Where the line's code ends (a comment starts) and the quote still open at its end."""
    i, prev = 0, " "
    while i < len(line):
        c = line[i]
        if quote == "'":
            if c == "'":
                quote = None
        elif c == "\\":
            i += 1
        elif quote == '"':
            if c == '"':
                quote = None
        elif c in "'\"":
            quote = c
        elif c == "#" and prev.isspace():
            return i, None
        prev = c
        i += 1
    return len(line), quote


def split_commands(text: str, first_line: int) -> list[Command]:
    """Logical shell commands: continuation lines, open quotes and heredoc bodies belong to their command;
    comment-only and blank lines to none."""
    commands: list[Command] = []
    lines: list[str] = []
    start, quote, heredoc = 0, None, None
    for n, line in enumerate(text.splitlines()):
        if heredoc is not None:
            lines.append(line)
            if line.strip() == heredoc:
                heredoc = None
                commands.append(Command(start, "\n".join(lines)))
                lines = []
            continue
        if not lines:
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            start = first_line + n
        lines.append(line)
        end, quote = _scan(line, quote)
        code = line[:end]
        if quote is None and (m := HEREDOC.search(code)):
            heredoc = m.group(2)
            continue
        if quote is None and not code.rstrip().endswith("\\"):
            commands.append(Command(start, "\n".join(lines)))
            lines = []
    if lines:
        commands.append(Command(start, "\n".join(lines)))
    return commands


def _append_set(text: str, sets: list[str]) -> str:
    """`--set KEY=VALUE` after the last line's code, before its comment."""
    head, _, last = text.rpartition("\n")
    end, _ = _scan(last, None)
    code = last[:end].rstrip() + "".join(f" --set {s}" for s in sets)
    last = code + ("  " + last[end:] if end < len(last) else "")
    return f"{head}\n{last}" if head else last


def parse_file(path: Path, name: str) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    marker: tuple[int, str] | None = None  # (line, text) of a marker waiting for its block
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if lines[i].startswith("<!-- docs-test:"):  # at the line's start: an indented one is an example
            j = i
            while "-->" not in lines[j] and j + 1 < len(lines):
                j += 1
            m = MARKER.search("\n".join(lines[i : j + 1]))
            if m is None:
                raise MarkerError(f"{name}:{i + 1}: a docs-test marker without its closing -->")
            marker, i = (i + 1, m.group(1)), j + 1
            continue
        if marker is not None and stripped and stripped != "```bash":
            raise MarkerError(f"{name}:{marker[0]}: a docs-test marker must stand right before a ```bash block")
        if stripped.startswith("```"):
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            if stripped == "```bash":
                blocks.append(_block(name, i + 1, "\n".join(lines[i + 1 : j]), marker[1] if marker else ""))
            marker, i = None, j + 1
            continue
        i += 1
    return blocks


def _block(name: str, line: int, text: str, marker: str) -> Block:
    block = Block(name, line, text)
    parse_marker(block, marker)
    for old, new in block.subs:
        if old not in block.text:
            raise MarkerError(f"{block.where}: `sub {old} => {new}`: {old!r} is not in the block")
        block.text = block.text.replace(old, new)
    block.commands = split_commands(block.text, line + 1)
    for cmd in block.commands:
        if block.skip:
            cmd.skip = block.skip
        for pattern, reason in block.skip_lines:
            if pattern in cmd.text:
                cmd.skip = reason
        for pattern, reason in block.fail_lines:
            if pattern in cmd.text:
                cmd.fails = reason
        if cmd.skip is None and block.sets and re.match(r"\s*fitlm (train|profile)\b", cmd.text):
            cmd.text = _append_set(cmd.text, block.sets)
    for word, pairs in (("skip-line", block.skip_lines), ("fails", block.fail_lines)):
        for pattern, _ in pairs:
            if not any(pattern in c.text for c in block.commands):
                raise MarkerError(f"{block.where}: `{word} {pattern}` matches no command of the block")
    return block


def all_blocks(root: Path = ROOT) -> dict[str, list[Block]]:
    return {name: parse_file(root / name, name) for name in doc_files(root)}


def table(blocks: dict[str, list[Block]]) -> str:
    """One row per file (blocks and commands run / skipped), the blocks run with changes, every skip with its reason."""
    rows, skips, changes = [], [], []
    for name, bs in blocks.items():
        if not bs:
            continue
        cmds = [c for b in bs for c in b.commands]
        run = sum(c.skip is None for c in cmds)
        rows.append(f"{name:28} blocks {sum(b.skip is None for b in bs)}/{len(bs)} run, commands {run}/{len(cmds)} run")
        for b in bs:
            edits = [f"after {b.after}"] * bool(b.after) + [f"set {k}" for k in b.sets]
            edits += [f"sub {old} => {new}" for old, new in b.subs]
            if edits and b.skip is None:
                changes.append(f"  {b.where}: " + "; ".join(edits))
            for c in b.commands:
                if c.skip:
                    first = c.text.strip().splitlines()[0]
                    skips.append(f"  {b.file}:{c.line}: {first[:70]}  -- skipped: {c.skip}")
    head = "docs commands (tests/e2e/test_docs_commands.py):"
    return "\n".join([head, *rows, "run with the marker's changes:", *changes, "not run:", *skips])


if __name__ == "__main__":
    print(table(all_blocks()))
