"""Flag values as the command reads and quotes them: a usage error names the flag and
quotes its value, shortened (a 5000-digit value is its first characters and its
length, not a screenful).
"""

from __future__ import annotations

import json

import pytest

from fastattn import cli
from fastattn.cli import _common
from helpers.cli import run

LONG = "9" * 5000
PROBE = ["probe", "--batch", "1", "--heads-q", "8", "--seqlen-q", "128", "--head-dim-qk", "64"]


@pytest.mark.parametrize("argv,flag", [
    (["probe", "--batch", LONG], "--batch"),
    (["probe", "--scale", LONG], "--scale"),
    (["probe", "--window", LONG, "0"], "--window"),
    (["probe", "--dtype", "x" * 5000], "--dtype"),
    (["matrix", "--head-dims", LONG], "--head-dims"),
    (["matrix", "--masks", "x" * 5000], "--masks"),
    (["warm", "--seqlens", LONG], "--seqlens"),
    (["warm", "--shape-classes", LONG], "--shape-classes"),
    (["cache", "prune", "--max-bytes", LONG], "--max-bytes"),
    (["cache", "prune", "--max-age", LONG], "--max-age"),
    (["warm", "--report", "x" * 5000 + "/r.json"], "--report"),
    (["probe", "--config", "x" * 5000], "--config"),
    (["probe", "x" * 5000], "unrecognized arguments"),
    (PROBE + ["--config", "{" + "x" * 5000], "--config"),
    (["cache", "show", "a" * 5000], "key"),
])
def test_a_long_value_is_echoed_shortened(argv, flag, capsys, cache_dir, no_work):
    code, out, err = run(argv, capsys)
    assert code == cli.EXIT_BAD_INPUT and flag in err, err
    message = err.splitlines()[-1]
    assert len(message) < 400 and "characters)" in message, message
    code, out, _ = run(argv + ["--json"], capsys)
    body = json.loads(out)
    assert code == cli.EXIT_BAD_INPUT and len(body["message"]) < 400 and flag in body["message"], body


def test_echo_quotes_short_values_whole_and_long_ones_shortened():
    assert _common.echo("64") == "'64'"
    assert _common.echo("a\nb") == "'a\\nb'"
    shown = _common.echo("7" * 5000)
    assert shown.startswith("'777") and shown.endswith("...' (5000 characters)") and len(shown) < 120
    assert _common.echo("x" * 80) == repr("x" * 80)  # at the limit: whole
