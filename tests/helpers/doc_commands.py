"""The commands a reader copies from the README and the docs, checked against the code that
takes them: ``radixserve ...`` against the CLI's parser, ``python bench/NAME.py ...`` against
that benchmark's ``parse_args``."""

from __future__ import annotations

import importlib
import os
import re
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A shell word that ends the command being checked: a pipe, a redirect, a background job.
_SHELL_BREAKS = ("|", "||", "&&", "&", ";", ">", "2>", ">>", "<")
_ENV_ASSIGN = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")


def fenced_blocks(text: str, lang: str) -> list[str]:
    """The bodies of the ```lang fences in ``text`` (trailing newline stripped)."""
    return [m.group(1).rstrip("\n") for m in re.finditer(rf"```{lang}\n(.*?)```", text, re.S)]


def shell_commands(text: str) -> list[str]:
    """The commands in ```bash fences and in inline code: continuation lines joined,
    comments dropped, each command of a ``&&`` chain on its own."""
    commands: list[str] = []
    for block in fenced_blocks(text, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            commands.extend(part.strip() for part in re.split(r"\s&&\s|;\s", line))
    for span in re.findall(r"`([^`\n]+)`", text):
        # inline, `radixserve generate` names a command; with arguments it is one to copy
        commands.extend(part.strip() for part in re.split(r"\s&&\s|;\s", span) if len(part.split()) > 2)
    return commands


def _words(command: str) -> list[str]:
    words = shlex.split(command, comments=True)
    while words and _ENV_ASSIGN.match(words[0]):
        words = words[1:]
    for i, word in enumerate(words):
        if word in _SHELL_BREAKS:
            return words[:i]
    return words


def _parse_radixserve(argv: list[str]) -> None:
    from radixserve.cli import _build_parser

    if argv[:1] == ["bench"]:
        from radixserve.cli.bench import BENCHMARKS

        name = argv[1] if len(argv) > 1 else "--help"
        if name.islower():  # not an option or a NAME placeholder
            if name not in BENCHMARKS:
                raise SystemExit(f"radixserve bench has no benchmark {name!r}")
            _parse_bench(f"bench/{name}", argv[2:])
        return
    _build_parser().parse_args(argv)


def _parse_bench(script: str, argv: list[str]) -> None:
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    importlib.import_module(script.replace("/", ".")).parse_args(argv)


def check_commands(text: str, where: str) -> list[str]:
    """Parse every ``radixserve`` and ``python bench/NAME.py`` command of ``text``; raise
    AssertionError naming the first one its parser refuses.  Returns the commands checked."""
    checked = []
    for command in shell_commands(text):
        try:
            words = _words(command)
        except ValueError:  # an inline fragment that is not a whole command (an open quote)
            continue
        if not words:
            continue
        try:
            if words[0] == "radixserve" and len(words) > 1:
                _parse_radixserve(words[1:])
            elif words[:1] == ["python"] and len(words) > 1 and re.fullmatch(r"bench/[a-z0-9_]+\.py", words[1]):
                _parse_bench(words[1][:-3], words[2:])
            else:
                continue
        except SystemExit as e:
            if e.code not in (0, None):  # --help exits 0
                raise AssertionError(f"{where}: `{command}` is refused (exit {e.code})") from None
        checked.append(" ".join(words))
    return checked
