"""Where things are, from this file's place rather than the working directory or the
test module's folder (tests move between folders; these do not)."""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]  # tests/: conftest.py, fake_core.py, fake_site/, helpers/
ROOT = TESTS.parent  # the checkout: pyproject.toml, README.md, fastattn/, tools/
README = ROOT / "README.md"
DOCS = ROOT / "docs"  # the reference pages the README links to
ENVIRONMENT = DOCS / "ENVIRONMENT.md"  # the FASTATTN_* table, generated from fastattn/env.py
