"""Writes docs/CLI.md's reference part (every command, its description and every flag)
from the `fastattn` command's own parser (fastattn.cli._main.build_parser), between the
page's marker comments; the prose above them is written by hand.

    python tools/cli_reference.py           rewrite the generated part
    python tools/cli_reference.py --check   exit 1 if the page is not what it would write

Rendered from the parser's actions, not from argparse's --help text, whose layout changes
between Python versions and with the terminal's width.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this tree's parser, not an installed fastattn's

from tools import _generated  # noqa: E402

from fastattn.cli._main import build_parser  # noqa: E402

PAGE = ROOT / "docs" / "CLI.md"
BEGIN = "<!-- generated: python tools/cli_reference.py -->"
END = "<!-- end of generated reference -->"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.choices is not None:
        return " / ".join(f"`{c}`" for c in action.choices)
    metavar = action.metavar or (action.dest.upper() if action.option_strings else action.dest)
    return " ".join(f"`{m}`" for m in metavar) if isinstance(metavar, tuple) else f"`{metavar}`"


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%(" in text:
        text = text % {**vars(action), "prog": prog}
    return _cell(text)


def _section(parser: argparse.ArgumentParser, name: str, summary: str | None) -> list[str]:
    lines = [f"### `{name}`", ""]
    for text in (parser.description or summary, parser.epilog):
        if text:
            lines += [_cell(text), ""]
    rows = [a for a in parser._actions
            if not isinstance(a, (argparse._SubParsersAction, argparse._HelpAction)) and a.help != argparse.SUPPRESS]
    if rows:
        lines += ["| argument | value | meaning |", "| --- | --- | --- |"]
        for a in rows:
            flag = ", ".join(f"`{s}`" for s in a.option_strings) or f"`{a.dest.upper()}`" + (
                " (optional)" if a.nargs == "?" else "")
            lines.append(f"| {flag} | {_value(a)} | {_help(a, parser.prog)} |")
        lines.append("")
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            helps = {c.dest: c.help for c in a._choices_actions}
            for sub_name, sub in a.choices.items():
                lines += _section(sub, f"{name} {sub_name}", helps.get(sub_name))
    return lines


def reference() -> str:
    """The generated part of docs/CLI.md, markers excluded."""
    return "\n".join(_section(build_parser(), "fastattn", None)).rstrip("\n")


def page_with(text: str) -> str:
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{reference()}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    return _generated.main(lambda: {PAGE: page_with(PAGE.read_text())}, "tools/cli_reference.py", __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
