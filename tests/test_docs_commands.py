"""What README.md and docs/*.md show works as written: every `ot-dist` command in a ```bash block parses with
the real CLI parser, every configs/*.yaml it names exists, and every relative link points at a file (and, for a
link to a heading, at a heading that exists)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from ot_dist.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def bash_commands(text: str) -> list[tuple[int, str]]:
    """(line number, command) for every command of the ```bash blocks, `\\` continuations joined."""
    commands, in_bash, pending, start = [], False, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            in_bash = not in_bash and line.strip() == "```bash"
            continue
        if not in_bash:
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        commands.append((start, pending + line))
        pending = ""
    return commands


def ot_dist_arguments(command: str) -> list[str] | None:
    """The arguments given to ot-dist (`ot-dist ...`, `VAR=x ot-dist ...`, `... -m ot_dist ...`), else None."""
    words = shlex.split(command, comments=True)
    while words and ENV_ASSIGNMENT.match(words[0]):
        words = words[1:]
    if words[:1] == ["ot-dist"]:
        return words[1:]
    for i in range(len(words) - 1):
        if words[i : i + 2] == ["-m", "ot_dist"]:
            return words[i + 2 :]
    return None


def documented_commands() -> list[tuple[str, list[str]]]:
    found = []
    for doc in DOCUMENTS:
        for number, command in bash_commands(doc.read_text()):
            arguments = ot_dist_arguments(command)
            if arguments is not None:
                found.append((f"{doc.relative_to(REPO)}:{number}", arguments))
    return found


COMMANDS = documented_commands()


def test_the_docs_show_commands_of_every_kind():
    """The collection itself works: the tour's commands and the multi-line ones of the guides are found."""
    subcommands = {arguments[0] for _, arguments in COMMANDS}
    assert {"init", "train", "launch", "export", "k8s", "lora", "schedule", "config", "import"} <= subcommands
    assert any(arguments[:2] == ["lora", "merge"] and "--weight" in arguments for _, arguments in COMMANDS)


@pytest.mark.parametrize("where, arguments", COMMANDS, ids=[where for where, _ in COMMANDS])
def test_documented_command_parses(where, arguments):
    parser = build_parser()
    try:
        parser.parse_args(arguments)
    except SystemExit as exit_:
        pytest.fail(f"{where}: `ot-dist {shlex.join(arguments)}` does not parse (exit {exit_.code})")
    for word in arguments:
        for config in re.findall(r"configs/[A-Za-z0-9_.-]+\.yaml", word):
            assert (REPO / config).is_file(), f"{where}: {config} does not exist"


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file (lower case, punctuation dropped, spaces -> -)."""
    anchors, fence = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and re.match(r"^#{1,6} ", line):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("doc", DOCUMENTS, ids=[str(d.relative_to(REPO)) for d in DOCUMENTS])
def test_relative_links_point_at_files_and_headings(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            broken.append(f"{target}: {path} does not exist")
        elif anchor and path.suffix == ".md" and anchor not in heading_anchors(path):
            broken.append(f"{target}: no heading #{anchor} in {path.name}")
    assert broken == [], f"{doc.name}: " + "; ".join(broken)
