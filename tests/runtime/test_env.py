"""Every FASTATTN_* variable is read through one parser (fastattn.env),
so that a bad value is an InvalidArgumentError naming the variable and the value from
the API and exit 2 from the CLI, the same on every path; docs/ENVIRONMENT.md's table is the
parser's table. The generated values are below the regressions."""

from __future__ import annotations

import ast
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastattn
from fastattn import cli, runtime, store
from fastattn import env as _env

from helpers.paths import ENVIRONMENT, ROOT

WARM_FILE = '{"configs": [{"batch": 1, "heads_q": 8, "seqlen_q": 128, "head_dim_qk": 64}]}'


def run(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "a bug in fastattn" not in out + err
    return code, out, err


# -- the values -------------------------------------------------------------------------


@pytest.mark.parametrize("url,why", [
    ("redis://127.0.0.1:99999/0", "port"),  # was exit 5, "ValueError: Port out of range", and plan()'s bare ValueError
    ("redis://127.0.0.1:6379/abc", "database"),  # was accepted (redis-py ignores a path it cannot read)
    ("redis://127.0.0.1:0/0", "port 0"),
    ("redis://:6379/0", "no host"),
    ("redis://h:6379/0?foo=1", "query"),  # was a TypeError from inside redis-py at the first connection
    ("http://h:6379/0", "expected redis://"),
])
def test_a_bad_redis_url_is_bad_input_on_every_path(env, capsys, monkeypatch, url, why):
    monkeypatch.setenv("FASTATTN_REMOTE_CACHE", url)
    monkeypatch.setenv("FASTATTN_CACHE_TRUSTED", "1")
    head = f"FASTATTN_REMOTE_CACHE={url!r}: "
    with pytest.raises(fastattn.InvalidArgumentError) as e:
        store.settings_from_env()
    assert str(e.value).startswith(head) and why in str(e.value)
    runtime.clear()
    with pytest.raises(fastattn.InvalidArgumentError, match=re.escape(head)):
        fastattn.plan(dict(batch=1, heads_q=8, seqlen_q=128, head_dim_qk=64))
    (env / "w.json").write_text(WARM_FILE)
    for argv in (["info"], ["cache", "push", "--all"], ["cache", "ls"], ["warm", str(env / "w.json"), "--no-torch-ops"]):
        runtime.clear()
        code, out, err = run(argv + ["--json"], capsys)
        assert code == cli.EXIT_BAD_INPUT, (argv, out, err)
        body = json.loads(out)
        assert body["error"] == "InvalidArgumentError" and body["message"].startswith(head), (argv, body)


def test_a_password_in_a_bad_url_is_never_shown():
    with pytest.raises(fastattn.InvalidArgumentError) as e:
        _env.get("FASTATTN_REMOTE_CACHE", {"FASTATTN_REMOTE_CACHE": "redis://u:hunter2@h:99999/0"})
    assert "hunter2" not in str(e.value) and "***" in str(e.value)


@pytest.mark.parametrize("value,shared", [("1", True), ("yes", True), ("TRUE", True), ("on", True), (" On ", True),
                                          ("0", False), ("no", False), ("False", False), ("off", False), ("", False)])
def test_every_boolean_takes_one_set_of_words(value, shared):
    # FASTATTN_CACHE_SHARED=2 was refused while yes and true passed; on/off were refused.
    assert store.settings_from_env({"FASTATTN_CACHE_SHARED": value}).shared is shared
    for var in _env.VARIABLES.values():
        if var.kind == "bool":  # (empty: the variable's default)
            assert _env.get(var.name, {var.name: value}) is (shared if value else var.default)


@pytest.mark.parametrize("value", ["2", "maybe", "y", "t", "1.0", "enabled"])
def test_a_boolean_outside_the_set_is_named(value):
    for var in _env.VARIABLES.values():
        if var.kind == "bool":
            with pytest.raises(fastattn.InvalidArgumentError, match=rf"^{var.name}={value!r}: must be a boolean"):
                _env.get(var.name, {var.name: value})


def test_a_bad_torch_path_is_bad_input_for_info_and_warm(env, capsys, monkeypatch):
    # `info` reported FASTATTN_TORCH_PATH=bogus as a path "none" and exited 0 or 3;
    # warm built the op library (its own reading took anything but "python" as yes).
    monkeypatch.setenv("FASTATTN_TORCH_PATH", "bogus")
    (env / "w.json").write_text(WARM_FILE)
    for argv in (["info"], ["warm", str(env / "w.json")]):
        code, out, err = run(argv + ["--json"], capsys)
        assert code == cli.EXIT_BAD_INPUT, (argv, out, err)
        assert json.loads(out)["message"].startswith("FASTATTN_TORCH_PATH='bogus': must be one of auto, native")


def test_a_bad_torch_path_fails_at_import_not_only_at_an_eager_cuda_call(tmp_path):
    # Calls on meta tensors (tracing, torch.compile) never decided the path, so they
    # ran whatever FASTATTN_TORCH_PATH said.
    pytest.importorskip("torch", reason="PyTorch is an optional extra")
    code = ("import torch\ntry:\n    import fastattn.torch as ft\n"
            "    q = torch.empty(1, 16, 2, 64, dtype=torch.bfloat16, device='meta')\n    ft.attention(q, q, q)\n"
            "except ValueError as e:\n    print(type(e).__name__, e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "FASTATTN_TORCH_PATH": "bogus",
                            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("InvalidArgumentError FASTATTN_TORCH_PATH='bogus': must be one of"), r.stdout


def test_a_zero_timeout_is_refused_not_silently_the_default():
    with pytest.raises(fastattn.InvalidArgumentError, match=r"^FASTATTN_REMOTE_TIMEOUT='0': must be > 0"):
        _env.get("FASTATTN_REMOTE_TIMEOUT", {"FASTATTN_REMOTE_TIMEOUT": "0"})


def test_sizes_take_units():
    assert store.settings_from_env({"FASTATTN_CACHE_MAX_BYTES": "500M"}).max_bytes == 500 << 20
    assert store.settings_from_env({"FASTATTN_CACHE_MAX_BYTES": "4GiB"}).max_bytes == 4 << 30
    assert store.settings_from_env({"FASTATTN_CACHE_MAX_BYTES": "1.5K"}).max_bytes == 1536
    assert store.settings_from_env({"FASTATTN_CACHE_MAX_BYTES": "none"}).max_bytes is None
    with pytest.raises(fastattn.InvalidArgumentError, match=r"^FASTATTN_CACHE_MAX_BYTES='-1': is negative"):
        store.settings_from_env({"FASTATTN_CACHE_MAX_BYTES": "-1"})
    for bad in ("1.5", "lots", "1e3", "5X"):
        with pytest.raises(fastattn.InvalidArgumentError, match=rf"^FASTATTN_CACHE_MAX_BYTES={bad!r}: must be a size"):
            store.settings_from_env({"FASTATTN_CACHE_MAX_BYTES": bad})


# -- one table: docs/ENVIRONMENT.md's, and every read ------------------------------------------------------


REGENERATE = "python -c 'from fastattn import env; print(env.markdown())'"


def _page_table() -> str:
    text = ENVIRONMENT.read_text()
    found = re.search(rf"<!-- generated: {re.escape(REGENERATE)} -->\n(.*?)\n<!-- end of generated table -->", text,
                      re.S)
    assert found, "docs/ENVIRONMENT.md lost its generated table of environment variables"
    return found.group(1)


def test_the_environment_page_table_is_the_parsers_table():
    assert _page_table() == _env.markdown(), f"regenerate it: {REGENERATE}"


def _quoted_names(path: pathlib.Path) -> set[str]:
    return set(re.findall(r"""["'](FASTATTN_[A-Z0-9_]*[A-Z0-9])["']""", path.read_text()))


def test_every_variable_named_in_the_code_is_in_the_table_and_back():
    files = [*(ROOT / "fastattn").rglob("*.py"), *(ROOT / "tests").rglob("*.py"), ROOT / "setup.py"]
    named = set().union(*(_quoted_names(p) for p in files))
    assert named - set(_env.VARIABLES) == set(), "declare them in fastattn/env.py"
    assert {v.name for v in _env.VARIABLES.values() if v.scope == "build"} == _quoted_names(ROOT / "setup.py")
    assert set(_env.VARIABLES) - named == set(), "variables nothing reads"


def _env_reads(path: pathlib.Path) -> list[str]:
    """Reads of a FASTATTN_* name (a constant, or a module constant holding one) that do
    not go through fastattn.env: environ.get(...), environ[...], getenv(...), on
    os.environ or a mapping named environ or env."""
    tree = ast.parse(path.read_text())
    consts = {t.id: n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)}

    def fastattn_name(node) -> bool:
        value = node.value if isinstance(node, ast.Constant) else consts.get(getattr(node, "id", None))
        return isinstance(value, str) and value.startswith("FASTATTN_")

    imported = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names}  # `from fastattn import env`: the parser itself, not a mapping

    def a_mapping(node) -> bool:
        text = ast.unparse(node)
        return text in ("os.environ", "environ", "env", "self.environ") and text not in imported

    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and n.args and fastattn_name(n.args[0]):
            f = n.func
            if (isinstance(f, ast.Attribute) and f.attr == "get" and a_mapping(f.value)) \
                    or ast.unparse(f) in ("os.getenv", "getenv"):
                found.append(ast.unparse(n))
        if isinstance(n, ast.Subscript) and fastattn_name(n.slice) and a_mapping(n.value) \
                and isinstance(n.ctx, ast.Load):
            found.append(ast.unparse(n))
    return found


def test_every_read_goes_through_the_parser():
    # fastattn, and the test suite's own support (test files save and restore values,
    # which is not reading them).
    reads = {str(p.relative_to(ROOT)): _env_reads(p)
             for p in [*(ROOT / "fastattn").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
             if p != ROOT / "fastattn" / "env.py" and not p.name.startswith("test_")}
    assert {p: r for p, r in reads.items() if r} == {}


# -- generated values ------------------------------------------------------------------------------

_RUNTIME = sorted(v.name for v in _env.VARIABLES.values() if v.scope == "runtime")
_words = st.sampled_from(["", " ", "0", "1", "2", "-1", "yes", "No", "ON", "off", "true", "auto", "NATIVE", "python",
                          "read-only", "OFF", "0.25", "1e400", "nan", "inf", "-0", "4G", "500m", "1.5G", "12 K", "x",
                          "redis://h", "redis://h:6379/0", "rediss://u:p@h:1/15", "unix:///tmp/r.sock?db=2",
                          "redis://h:70000/0", "redis://h/-1", "redis://[::1/0", "redis://h:6379/0#f", "REDIS://h/0",
                          "/tmp/x", "a:b", "\x00", "é"])


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.sampled_from(_RUNTIME), st.one_of(_words, st.text(max_size=12)))
def test_any_value_of_any_variable_parses_or_is_named(name, value):
    try:
        got = _env.get(name, {name: value})
    except fastattn.InvalidArgumentError as e:
        assert str(e).startswith(f"{name}=") or str(e) == f"{name} is set but empty", str(e)
        if _env.VARIABLES[name].kind != "secret" and "@" not in value:
            assert str(e).startswith(f"{name}={value!r}: ") or str(e) == f"{name} is set but empty", str(e)
        return
    kind = _env.VARIABLES[name].kind
    types = {"bool": bool, "choice": str, "seconds": float, "size": int, "count": int, "path": (str, type(None)),
             "text": str, "paths": tuple, "secret": (bytes, type(None)), "url": (str, type(None)),
             "classes": (str, tuple)}  # "auto", or shape_classes.Classes (a NamedTuple)
    assert isinstance(got, types[kind]), (name, value, got)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.dictionaries(st.sampled_from(_RUNTIME), _words, max_size=5))
def test_settings_from_any_environment_are_settings_or_named(environ):
    try:
        s = store.settings_from_env(environ)
    except fastattn.InvalidArgumentError as e:
        assert any(str(e).startswith(f"{n}=") or str(e).startswith(f"{n} ") for n in environ), str(e)
        return
    assert isinstance(s, store.CacheSettings)


_host = st.sampled_from(["h", "127.0.0.1", "[::1]", "cache.example", "", "h h", "[::1"])
_port = st.one_of(st.none(), st.integers(-5, 70000), st.sampled_from(["abc", "", "6379x"]))
_db = st.one_of(st.none(), st.integers(-2, 2**32), st.sampled_from(["abc", "", "1/2", " 3", "+1", "0x1"]))


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["redis", "rediss", "unix", "REDIS", "http", ""]), st.sampled_from(["", "u:p@", ":p@", "u@"]),
       _host, _port, _db, st.sampled_from(["", "?db=1", "?x=1", "#frag"]))
def test_generated_redis_urls_are_what_redis_py_makes_of_them_or_named(scheme, user, host, port, db, tail):
    redis = pytest.importorskip("redis")
    url = f"{scheme}://{user}{host}{'' if port is None else f':{port}'}{'' if db is None else f'/{db}'}{tail}"
    if scheme == "unix":
        url = f"unix://{user}/tmp/redis.sock{tail}"
    try:
        got = _env.get("FASTATTN_REMOTE_CACHE", {"FASTATTN_REMOTE_CACHE": url})
    except fastattn.InvalidArgumentError as e:
        assert str(e).startswith("FASTATTN_REMOTE_CACHE="), str(e)
        return
    kwargs = redis.connection.parse_url(got)  # what the client connects with: never its ValueError
    if scheme != "unix":
        assert 1 <= kwargs.get("port", 6379) <= 65535 and kwargs.get("host")
        assert kwargs.get("db", 0) == (int(db) if db not in (None, "") else 0)
    redis.Redis.from_url(got)  # makes a pool, connects nothing
