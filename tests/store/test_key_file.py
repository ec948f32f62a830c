"""FASTATTN_CACHE_HMAC_KEY_FILE: a small regular file of UTF-8 text, read with a bound
and never waited on. A FIFO, a device (/dev/zero), a folder, a missing or unreadable
file, an empty or whitespace-only one, one over signing.MAX_KEY_FILE_BYTES, or bytes
that are not UTF-8 are an InvalidArgumentError naming the variable and the path
(shown escaped): exit 2 from every command that reads the cache's settings.

What could hang or exhaust memory (a FIFO, /dev/zero) runs in a child process, with a
timeout and a memory limit; the generated cases run here, with an alarm as the guard.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastattn
from fastattn import cli, env as env_mod, store
from fastattn.store import signing

from helpers.paths import TESTS

VAR = "FASTATTN_CACHE_HMAC_KEY_FILE"
LIMIT = signing.MAX_KEY_FILE_BYTES


def _child_env(path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTATTN_")}
    root = os.path.dirname(os.path.dirname(fastattn.__file__))
    paths = [os.path.join(TESTS, "fake_site"), str(TESTS), root, os.environ.get("PYTHONPATH", "")]
    env.update(PYTHONPATH=os.pathsep.join(p for p in paths if p),
               FASTATTN_TEST_FAKE_CORE="1", FASTATTN_CACHE_DIR=os.environ["FASTATTN_CACHE_DIR"], **extra)
    env[VAR] = str(path)
    return env


def _limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def fastattn_command(argv, path, **extra) -> subprocess.CompletedProcess:
    """`fastattn <argv>` in a child with `path` as the key file, 2 GiB of address space
    and 60 s: a FIFO waited on, or /dev/zero read whole, fails the test, not the run."""
    try:
        return subprocess.run([sys.executable, "-m", "fastattn", *argv], env=_child_env(path, **extra),
                              capture_output=True, text=True, timeout=60, preexec_fn=_limit_memory)
    except subprocess.TimeoutExpired:
        pytest.fail(f"fastattn {' '.join(argv)} waited on {path}")


def _fifo(path):
    os.mkfifo(path)
    return path


NODES = {
    "fifo": _fifo,
    "dev_zero": lambda path: (os.symlink("/dev/zero", path), path)[1],
    "dev_zero_itself": lambda path: "/dev/zero",
    "folder": lambda path: (os.mkdir(path), path)[1],
}


@pytest.mark.parametrize("node", sorted(NODES))
@pytest.mark.parametrize("argv,remote", [(["info"], True), (["cache", "ls"], False), (["info"], False),
                                         (["cache", "export", "--all", "{out}"], False)])
def test_a_key_file_that_is_no_regular_file_is_exit_2_never_waited_on(tmp_path, node, argv, remote):
    path = NODES[node](tmp_path / "key\nfile")  # a name with a newline: shown escaped
    extra = {"FASTATTN_REMOTE_CACHE": "redis://127.0.0.1:1/0"} if remote else {}
    r = fastattn_command([a.format(out=tmp_path / "b.tgz") for a in argv], path, **extra)
    assert r.returncode == cli.EXIT_BAD_INPUT, r.stdout + r.stderr
    assert VAR in r.stderr and repr(str(path)) in r.stderr and "not a regular file" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "b.tgz").exists()


def load(path):
    return signing.load_secret({VAR: str(path)})


@pytest.mark.parametrize("content,why", [
    (b"", "the file is empty"),
    (b" \n\t \r\n", "only whitespace"),
    (b"k" * (LIMIT + 1), f"over {LIMIT} bytes"),
    (b"\xff\xfesecret", "not UTF-8"),
], ids=["empty", "whitespace", "too_large", "not_utf8"])
def test_a_key_file_whose_content_is_no_secret_is_refused(tmp_path, content, why):
    path = tmp_path / "key"
    path.write_bytes(content)
    with pytest.raises(fastattn.InvalidArgumentError, match=why) as e:
        load(path)
    assert str(e.value).startswith(f"{VAR}={str(path)!r}: ")


def test_a_key_file_of_gigabytes_is_refused_unread(tmp_path, monkeypatch):
    path = tmp_path / "key"
    with open(path, "wb") as f:
        f.truncate(8 << 30)  # sparse: nothing is written, and nothing may be read
    with pytest.raises(fastattn.InvalidArgumentError, match=f"over {LIMIT} bytes"):
        load(path)


def test_a_missing_or_unreadable_key_file_is_refused(tmp_path):
    with pytest.raises(fastattn.InvalidArgumentError, match=f"{VAR}=.*: cannot read it \\(No such file"):
        load(tmp_path / "missing")
    if os.geteuid() == 0:
        pytest.skip("root reads a file of mode 000")
    path = tmp_path / "key"
    path.write_text("secret")
    path.chmod(0)
    with pytest.raises(fastattn.InvalidArgumentError, match="cannot read it \\(Permission denied"):
        load(path)


def test_a_key_file_at_the_bound_is_read_stripped(tmp_path):
    path = tmp_path / "key"
    path.write_bytes(b"\n " + b"s" * (LIMIT - 4) + b"\n\n")
    assert load(path) == b"s" * (LIMIT - 4)


def test_the_readme_states_the_bound():
    assert f"at most {LIMIT} bytes" in env_mod.VARIABLES[VAR].help


class _Hung(Exception):
    pass


def _alarm(signum, frame):
    raise _Hung()


KINDS = ("file", "fifo", "folder", "missing", "dev_null", "link_to_file", "link_to_fifo")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(KINDS),
       content=st.one_of(st.binary(max_size=LIMIT + 8), st.text(max_size=64).map(lambda t: t.encode("utf-8", "surrogatepass")),
                         st.integers(LIMIT - 2, LIMIT + 2).map(lambda n: b"x" * n)))
def test_generated_key_files_give_their_secret_or_name_the_variable(tmp_path_factory, kind, content):
    folder = tmp_path_factory.mktemp("key")
    path = folder / "key"
    target = folder / "target"
    if kind in ("file", "link_to_file"):
        (target if kind == "link_to_file" else path).write_bytes(content)
    if kind in ("fifo", "link_to_fifo"):
        os.mkfifo(target if kind == "link_to_fifo" else path)
    if kind.startswith("link_to"):
        os.symlink(target, path)
    if kind == "folder":
        path.mkdir()
    if kind == "dev_null":
        path = "/dev/null"
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(10)
    try:
        secret = load(path)
        error = None
    except fastattn.InvalidArgumentError as e:
        secret, error = None, str(e)
    except _Hung:
        pytest.fail(f"{kind}: waited on")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    good = kind in ("file", "link_to_file") and len(content) <= LIMIT and text is not None and text.strip() != ""
    if good:
        assert secret == text.strip().encode("utf-8")
    else:
        assert error is not None and error.startswith(f"{VAR}={str(path)!r}: "), error
    # The same through the cache's settings, as every command reads them.
    if not good:
        with pytest.raises(fastattn.InvalidArgumentError, match=VAR):
            store.settings_from_env({VAR: str(path), "FASTATTN_CACHE_DIR": str(folder / "cache")})
