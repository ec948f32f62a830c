"""What each generator in tools/ does with the files it would write (gen_config.py,
gen_slots.py, cli_reference.py): write those that differ, or with --check write nothing
and exit 1 naming them (the tests under tests/package run --check)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent


def main(outputs: Callable[[], dict[Path, str]], script: str, doc: str, argv: list[str] | None = None) -> int:
    """outputs(): each file's whole text as the generator would write it. script: the
    generator's path from the repository root, for the message."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated file is stale; write nothing")
    args = parser.parse_args(argv)
    stale = [(path, text) for path, text in outputs().items()
             if (path.read_text() if path.exists() else None) != text]
    if args.check:
        if stale:
            names = ", ".join(str(path.relative_to(ROOT)) for path, _ in stale)
            print(f"stale (regenerate: python {script}): {names}", file=sys.stderr)
            return 1
        return 0
    for path, text in stale:
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")
    return 0
