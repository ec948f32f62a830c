"""Files the command is named to write (`cache export BUNDLE`, `warm --report`, `matrix
--png`): only a new path or a regular file is ever replaced. A device node, a FIFO, a
socket or a symbolic link at the path is refused (exit 2, naming the flag and the
path) before any work, and again just before the rename that publishes the file, so
that one put there meanwhile is left as it is.

Every node here is made under tmp_path (a character device only where this process
may mknod: as root); nothing outside it is ever named.
"""

from __future__ import annotations

import json
import os
import socket
import stat

import pytest

import fastattn
from fastattn import cli
from fastattn import files
from helpers.cli import run

BASE = dict(batch=1, heads_q=8, head_dim_qk=64, mask="causal")


def _device(path, minor=3):
    try:  # a copy of /dev/null's node (minor 3; /dev/zero's: 5), in tmp_path
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, minor))
    except (PermissionError, OSError) as e:
        pytest.skip(f"cannot mknod here ({e})")


def _fifo(path):
    os.mkfifo(path)


def _socket(path):
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()


def _link(path):
    (path.parent / "target.txt").write_text("kept\n")
    os.symlink("target.txt", path)


def _dangling_link(path):
    os.symlink("nowhere.txt", path)


NODES = {"a character device": _device, "a FIFO": _fifo, "a socket": _socket, "a symbolic link": _link,
         "a dangling symbolic link": _dangling_link}


def _snapshot(path):
    st = os.lstat(path)
    return st.st_ino, stat.S_IFMT(st.st_mode)


def _unchanged(path, before):
    assert _snapshot(path) == before
    if os.path.islink(path) and os.path.exists(path):
        assert (path.parent / "target.txt").read_text() == "kept\n"


def _no_temp_files(folder):
    assert not [n for n in os.listdir(folder) if ".tmp-" in n]


@pytest.mark.parametrize("node", list(NODES))
@pytest.mark.parametrize("argv,flag", [
    (["cache", "export", "{path}", "--all", "--force"], "bundle"),
    (["cache", "export", "{path}", "--all"], "bundle"),
    (["warm", "--report", "{path}"], "--report"),
    (["matrix", "--head-dims", "64", "--png", "{path}"], "--png"),
])
def test_a_node_at_an_output_path_is_refused_first(tmp_path, capsys, cache_dir, no_work, node, argv, flag):
    path = tmp_path / "out"
    NODES[node](path)
    before = _snapshot(path)
    code, out, err = run([a.format(path=path) for a in argv], capsys)
    assert code == cli.EXIT_BAD_INPUT, err
    assert f"argument {flag}:" in err and str(path) in err and "not a regular file" in err, err
    _unchanged(path, before)
    _no_temp_files(tmp_path)


def test_a_regular_file_is_still_replaced(env, capsys):
    fastattn.plan({**BASE, "seqlen_q": 128})
    bundle = env / "b.tgz"
    bundle.write_text("old")
    code, out, err = run(["cache", "export", str(bundle), "--all", "--force"], capsys)
    assert code == cli.EXIT_OK and bundle.read_bytes()[:2] == b"\x1f\x8b"
    assert stat.S_IMODE(os.stat(bundle).st_mode) == 0o600


@pytest.mark.parametrize("node", list(NODES))
def test_a_node_put_there_while_the_bundle_is_written_is_left_alone(env, capsys, monkeypatch, node):
    fastattn.plan({**BASE, "seqlen_q": 128})
    path = env / "b.tgz"  # absent when the flag is checked
    real_fsync = os.fsync

    def fsync_then_race(fd):  # the temporary file is whole: then the node appears
        real_fsync(fd)
        NODES[node](path)

    monkeypatch.setattr(os, "fsync", fsync_then_race)
    code, out, err = run(["cache", "export", str(path), "--all", "--json"], capsys)
    monkeypatch.undo()
    body = json.loads(out)
    assert code == cli.EXIT_BAD_INPUT and str(path) in body["message"] and "not a regular file" in body["message"]
    assert not stat.S_ISREG(os.lstat(path).st_mode)
    _no_temp_files(env)


@pytest.mark.parametrize("node", list(NODES))
def test_write_file_replaces_only_regular_files(tmp_path, node):
    path = tmp_path / "f"
    NODES[node](path)
    before = _snapshot(path)
    with pytest.raises(files.NotRegularFileError) as e:
        files.write_file(str(path), b"data")
    assert str(path) in str(e.value) and e.value.strerror
    _unchanged(path, before)
    _no_temp_files(tmp_path)


@pytest.mark.parametrize("private,mode", [(True, 0o600), (False, 0o644)])
def test_write_file_writes_whole_files_with_their_mode(tmp_path, private, mode):
    old = os.umask(0o022)
    try:
        path = tmp_path / "f"
        files.write_file(str(path), b"one", private=private)
        files.write_file(str(path), b"two", private=private)  # a regular file: replaced
    finally:
        os.umask(old)
    assert path.read_bytes() == b"two" and stat.S_IMODE(os.stat(path).st_mode) == mode
    _no_temp_files(tmp_path)


@pytest.fixture
def written(monkeypatch):
    """The paths given to files.write_file, which still writes them."""
    paths = []
    real = files.write_file
    monkeypatch.setattr(files, "write_file", lambda path, data, **k: (paths.append(path), real(path, data, **k)))
    return paths


def test_warm_report_goes_through_write_file(fake_workers, capsys, written):
    report, f = fake_workers / "r.json", fake_workers / "w.json"
    f.write_text(json.dumps({"configs": [dict(BASE, seqlen_q=128)]}))
    code, _, _ = run(["warm", str(f), "--workers", "1", "--report", str(report), "--no-torch-ops"], capsys)
    assert code == cli.EXIT_OK and json.loads(report.read_text())["counts"]["built"] == 1
    assert written == [str(report)]


class _FakePyplot:
    """What _heatmap asks of matplotlib.pyplot, without matplotlib: savefig writes
    PNG-looking bytes to the file object it is given."""

    class _Any:
        def __getattr__(self, name):
            return lambda *a, **k: None

    def subplots(self, **kwargs):
        fig = self._Any()
        fig.savefig = lambda target, **k: target.write(b"\x89PNG fake")
        return fig, self._Any()

    def close(self, fig):
        pass


def test_matrix_png_goes_through_write_file(fake_workers, capsys, monkeypatch, written):
    import fake_core
    from fastattn import runtime
    from fastattn.cli import matrix

    monkeypatch.setattr(runtime, "_core", lambda: fake_core)  # --png asks this process for a GPU first
    runtime.clear()
    monkeypatch.setattr(matrix, "_check_matplotlib", lambda: None)
    monkeypatch.setattr(matrix, "_pyplot", _FakePyplot)
    png = fake_workers / "g.png"
    code, _, err = run(["matrix", "--head-dims", "64", "--masks", "causal", "--dtypes", "bf16", "--gqa", "1",
                        "--png", str(png)], capsys)
    assert code == cli.EXIT_OK, err
    assert png.read_bytes() == b"\x89PNG fake" and written == [str(png)]


# -- files the command reads: regular files only (a FIFO would block, /dev/zero never end) -------


def _zero_device(path):
    _device(path, minor=5)


def _link_to_fifo(path):
    os.mkfifo(path.parent / "fifo-target")
    os.symlink("fifo-target", path)


INPUTS = {"a character device": _zero_device, "a FIFO": _fifo, "a socket": _socket,
          "a link to a FIFO": _link_to_fifo, "a folder": os.mkdir}


def _fastattn(argv, tmp_path, timeout=60):
    """`fastattn <argv>` in a child process (a read that blocks fails the test at the
    timeout instead of hanging it), with a cache directory in tmp_path and no GPU."""
    import subprocess
    import sys

    env = {**os.environ, "FASTATTN_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(fastattn.__file__)),
                                          os.environ.get("PYTHONPATH", "")])}
    env.pop("FASTATTN_REMOTE_CACHE", None)
    try:
        return subprocess.run([sys.executable, "-m", "fastattn", *argv], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"fastattn {' '.join(argv)} still ran after {timeout} s (a blocked or endless read)")


@pytest.mark.parametrize("node", list(INPUTS))
@pytest.mark.parametrize("argv,flag", [
    (["cache", "import", "{path}", "--force"], "bundle"),
    (["cache", "import", "{path}"], "bundle"),
    (["probe", "--config", "{path}"], "--config"),
    (["warm", "{path}"], "file"),
])
def test_an_input_that_is_not_a_regular_file_is_refused(tmp_path, node, argv, flag):
    path = tmp_path / "in"
    INPUTS[node](path)
    r = _fastattn([a.format(path=path) for a in argv], tmp_path)
    assert r.returncode == cli.EXIT_BAD_INPUT, r.stdout + r.stderr
    assert f"argument {flag}:" in r.stderr and str(path) in r.stderr and "not a regular file" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "cache").exists()


def test_import_bundle_refuses_a_fifo_without_waiting_on_it(tmp_path):
    # The library's own check: what the path names when it is opened, not when the flag was read.
    os.mkfifo(tmp_path / "b.tgz")
    code = ("import sys\nfrom fastattn import store\nfrom fastattn.store import bundle\n"
            "try:\n    bundle.import_bundle(sys.argv[1], store.DiskStore(sys.argv[2]), environment=None, force=True)\n"
            "except ValueError as e:\n    print(e)\n")
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(fastattn.__file__)),
                                                        os.environ.get("PYTHONPATH", "")])}
    try:
        r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "b.tgz"), str(tmp_path / "c")], env=env,
                           capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("import_bundle waited on a FIFO")
    assert "a FIFO, not a regular file" in r.stdout and str(tmp_path / "b.tgz") in r.stdout, r.stdout + r.stderr


def test_a_bundle_over_the_size_limit_is_refused_unread(tmp_path, monkeypatch):
    from fastattn import store
    from fastattn.store import bundle

    path = tmp_path / "big.tgz"
    with open(path, "wb") as f:
        f.truncate(2 << 20)
    monkeypatch.setattr(bundle, "_MAX_BUNDLE", 1 << 20)
    monkeypatch.setattr(bundle.tarfile, "open", lambda *a, **k: pytest.fail("the bundle was read"))
    with pytest.raises(fastattn.InvalidArgumentError, match="over the"):
        bundle.import_bundle(str(path), store.DiskStore(str(tmp_path / "c")), environment=None, force=True)


def test_members_past_what_the_manifest_lists_are_refused_at_their_header(tmp_path, monkeypatch):
    import io
    import json
    import tarfile

    from fastattn import store
    from fastattn.store import bundle

    path = tmp_path / "many.tar"
    manifest = json.dumps({"format": bundle.BUNDLE_FORMAT, "entries": []}).encode()
    with tarfile.open(path, "w") as tar:
        info = tarfile.TarInfo("manifest.json")
        info.size = len(manifest)
        tar.addfile(info, io.BytesIO(manifest))
        for i in range(5):
            tar.addfile(tarfile.TarInfo(f"entries/{i:064x}.entry"), io.BytesIO(b""))
    with pytest.raises(fastattn.InvalidArgumentError, match=f"entries/{0:064x}.entry is not in the manifest"):
        bundle.import_bundle(str(path), store.DiskStore(str(tmp_path / "c")), environment=None, force=True,
                             trusted=True)


@pytest.mark.parametrize("name", ["x" * 300 + "/r.json", "file.txt/r.json", "x" * 300])
def test_an_output_path_that_cannot_be_looked_up_is_bad_input(tmp_path, capsys, cache_dir, no_work, name):
    (tmp_path / "file.txt").write_text("a file, not a folder\n")
    for argv in (["warm", "--report", str(tmp_path / name)], ["cache", "export", "--all", str(tmp_path / name)]):
        code, out, err = run(argv, capsys)
        assert code == cli.EXIT_BAD_INPUT and "argument" in err, err
    with pytest.raises(OSError):
        files.write_file(str(tmp_path / name), b"data")
