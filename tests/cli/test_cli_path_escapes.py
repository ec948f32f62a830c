"""A path is shown as one line in every message the command prints: a newline, a
carriage return or an escape sequence in a file or directory name (a bundle, the cache
directory, a warm file) is escaped, so that it cannot forge a line of the output, in
success lines and in errors, as text or as JSON's "message". cuDNN is
tests/fake_core.py (the `env` fixture)."""

from __future__ import annotations

import json
import os
import shutil

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastattn import cli, runtime

from helpers.cli import fill, run

FORGED = "FORGED fastattn: exported 999 entries"


def _one_line_each(out: str, err: str) -> None:
    for line in (out + err).split("\n"):
        assert line.isprintable(), repr(line)
        assert not line.startswith("FORGED"), repr(out + err)


def _commands(base, name: str):
    bundle = str(base / f"{name}.tar.gz")
    junk = base / f"{name}.junk"
    junk.write_bytes(b"not a bundle")
    warm_file = base / f"{name}.json"
    warm_file.write_text("{not json")
    return [
        (["cache", "export", "--all", bundle], {}),
        (["cache", "export", "--all", bundle], {}),  # the file exists
        (["cache", "import", "--force", bundle], {}),  # refused: unsigned, not trusted
        (["cache", "import", "--force", str(junk)], {"FASTATTN_CACHE_TRUSTED": "1"}),
        (["cache", "import", "--force", bundle], {"FASTATTN_CACHE_TRUSTED": "1"}),
        (["cache", "ls"], {}),
        (["cache", "clear"], {}),
        (["warm", str(warm_file)], {}),
    ]


NAMES = st.text(st.sampled_from("ab\n\r\x1b\x00\x07\u2028\x9b[31m"), min_size=1, max_size=6).filter(
    lambda t: "\x00" not in t and "/" not in t).map(lambda t: f"b{t}\n{FORGED}")


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=NAMES, as_json=st.booleans())
def test_every_path_in_every_message_is_one_line(env, capsys, monkeypatch, tmp_path_factory, name, as_json):
    base = tmp_path_factory.mktemp("paths")
    cache = base / f"cache{name}"
    monkeypatch.setenv("FASTATTN_CACHE_DIR", str(cache))
    runtime.clear()
    fill(1)
    for argv, variables in _commands(base, name):
        with monkeypatch.context() as m:
            for k, v in variables.items():
                m.setenv(k, v)
            runtime.clear()
            code, out, err = run(argv + (["--json"] if as_json else []), capsys)
        if as_json:
            json.loads(out)  # one document
            _one_line_each("", err)
        else:
            _one_line_each(out, err)
    shutil.rmtree(base, ignore_errors=True)
    assert not os.path.exists(cache)
