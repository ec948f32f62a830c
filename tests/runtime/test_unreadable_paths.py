"""User paths that cannot be looked up: a FASTATTN_CACHE_DIR or FASTATTN_TORCH_OPS_DIR
with a component past the file system's name limit (255 bytes: Path.exists() raises
ENAMETOOLONG, where os.path.exists() says False), or under a file (ENOTDIR). Where the
op library would be is reported as unreadable, with the reason, as `fastattn cache ls`
reports a cache directory; nothing raises the OSError (it was exit 5 from `fastattn
info`, and the raw OSError from fastattn.torch.backend_info())."""

from __future__ import annotations

import pytest

from fastattn import _opslib, config_files
from fastattn.errors import InvalidArgumentError

LONG = "y" * 300  # one component past NAME_MAX


@pytest.fixture
def bad_dirs(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    return {"too long": (tmp_path / LONG / "ops", "cannot be read (File name too long)"),
            "under a file": (tmp_path / "file" / "ops", "cannot be read (Not a directory)")}


def test_a_library_path_that_cannot_be_looked_up_does_not_exist(bad_dirs, tmp_path):
    for root, why in bad_dirs.values():
        path = _opslib.library_path("tag", root)
        assert isinstance(path, _opslib.LibraryPath) and path.exists() is False
        assert _opslib.problem(path) == why
        assert isinstance(path.parent / "x", _opslib.LibraryPath)
    missing = _opslib.library_path("tag", tmp_path / "missing")
    assert missing.exists() is False and _opslib.problem(missing) is None
    there = _opslib.LibraryPath(tmp_path / "file")
    assert there.exists() is True and _opslib.problem(there) is None


@pytest.mark.parametrize("variable", ["FASTATTN_TORCH_OPS_DIR", "FASTATTN_CACHE_DIR"])
def test_find_built_says_not_built(bad_dirs, monkeypatch, variable):
    monkeypatch.setattr(_opslib, "torch_version", lambda: "2.0.0")  # (whether or not torch is installed)
    for root, _ in bad_dirs.values():
        monkeypatch.setenv(variable, str(root))
        assert _opslib.find_built() is None


@pytest.fixture
def undecided(monkeypatch):
    """fastattn.torch's path not decided in this process (restored after: the session's
    op library, when a test loaded it, stays loaded)."""
    pytest.importorskip("torch", reason="PyTorch is an optional extra")
    from fastattn.torch import _native

    monkeypatch.setattr(_native, "_state", {})
    return _native


@pytest.mark.parametrize("variable", ["FASTATTN_TORCH_OPS_DIR", "FASTATTN_CACHE_DIR"])
@pytest.mark.parametrize("mode,path", [("auto", "python"), ("native", "none")])
def test_describe_and_backend_info_report_the_directory(undecided, bad_dirs, monkeypatch, variable, mode, path):
    import fastattn.torch

    monkeypatch.setenv("FASTATTN_TORCH_PATH", mode)
    for root, why in bad_dirs.values():
        monkeypatch.setenv(variable, str(root))
        described = undecided.describe()
        assert described["path"] == path and described["reason"].endswith(why), described
        assert described["reason"].startswith(f"FASTATTN_TORCH_PATH={mode}; the op library's directory ")
        info = fastattn.torch.backend_info()
        assert info["built"] is False and info["reason"] == described["reason"] and info["build_error"] is None
        built = fastattn.torch.backend_info(build=True)  # the compiler is never reached: mkdir fails
        assert built["build_error"].startswith(("OSError", "NotADirectoryError")), built


def test_the_python_path_is_taken_in_auto_mode(undecided, bad_dirs, monkeypatch):
    monkeypatch.setenv("FASTATTN_TORCH_PATH", "auto")
    monkeypatch.setenv("FASTATTN_TORCH_OPS_DIR", str(bad_dirs["too long"][0]))
    assert undecided.library() is None and undecided.status()["path"] == "python"


def test_a_config_file_name_that_cannot_be_opened_is_invalid_argument(tmp_path):
    for path, why in ((tmp_path / LONG / "w.json", "File name too long"), (tmp_path / LONG, "File name too long"),
                      ("w\0.json", r"not a file name \(it holds a NUL character\)")):
        with pytest.raises(InvalidArgumentError, match=why):
            config_files.load_configs(str(path))
