"""The cuDNN version fastattn accepts at run time: the oldest supported one is named,
and anything older (or not cuDNN 9) is a LibraryError that says what to do."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastattn
from fastattn import _loader


def test_the_oldest_supported_cudnn_is_9_19():
    assert _loader.version_text(_loader.MIN_CUDNN) == "9.19.0"


@pytest.mark.parametrize("version", [91900, 91901, 92801, 99999])
def test_supported_versions_pass(version):
    _loader.check_cudnn_version(version, "/lib/libcudnn.so.9")


@pytest.mark.parametrize("version, shown", [(91800, "9.18.0"), (91302, "9.13.2"), (90000, "9.0.0"),
                                            (8906, "8906"), (100100, "10.1.0")])
def test_older_or_other_major_versions_say_what_to_do(version, shown):
    with pytest.raises(fastattn.LibraryError) as e:
        _loader.check_cudnn_version(version, "/x/libcudnn.so.9")
    text = str(e.value)
    assert f"cuDNN {shown} at /x/libcudnn.so.9" in text
    assert "9.19.0 or newer" in text and "pip install 'nvidia-cudnn-cu13>=9.19.0,<10'" in text
    assert "FASTATTN_CUDNN_PATH" in text
    assert isinstance(e.value, OSError)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.integers(min_value=-(2**40), max_value=2**40))
def test_every_version_number_is_accepted_or_a_library_error(version):
    try:
        _loader.check_cudnn_version(version, "p")
    except fastattn.LibraryError:
        assert not (_loader.MIN_CUDNN <= version < 100000)
    else:
        assert _loader.MIN_CUDNN <= version < 100000


def test_a_first_load_reports_each_step_in_order(monkeypatch):
    # The profiles' breakdown of a first load (benchmarks/profile_*.py): every step is
    # reported, in the order it ran, also when the load fails (here: the driver is faked
    # missing, so cuDNN is never tried).
    monkeypatch.setattr(_loader, "_loaded", None)
    monkeypatch.setattr(_loader, "_load_one", lambda name, env, hint: (f"/x/{name}.so", None))
    monkeypatch.setattr(_loader, "_check_driver", lambda: "no libcuda.so.1 (faked)")
    monkeypatch.setattr(_loader, "_locate_cudnn_problem", list)
    steps = []
    with pytest.raises(fastattn.LibraryError, match="faked"):
        _loader.ensure_loaded(on_step=steps.append)
    assert steps == [f"load {name}" for name, _, _ in _loader._DEPENDENCIES] + ["check libcuda"]


def test_a_load_that_succeeds_reports_cudnn_and_its_initialization(monkeypatch):
    import os

    from fastattn import _core

    # ensure_loaded names the cudart it loaded for cudnn-frontend (setdefault): kept to
    # this test, so that a real load later in the process is not pointed at /x.
    monkeypatch.setenv("CUDNN_FRONTEND_CUDART_LIB_NAME", os.environ.get("CUDNN_FRONTEND_CUDART_LIB_NAME", "unset"))
    monkeypatch.setattr(_loader, "_loaded", None)
    monkeypatch.setattr(_loader, "_load_one", lambda name, env, hint: (f"/x/{name}.so", None))
    monkeypatch.setattr(_loader, "_check_driver", lambda: None)
    monkeypatch.setattr(_core, "init_cudnn", lambda path: 91900)
    steps = []
    libs = _loader.ensure_loaded(on_step=steps.append)
    assert libs.cudnn == "/x/cudnn.so" and libs.cudnn_version == 91900
    assert steps[-3:] == ["check libcuda", "load cudnn", "init_cudnn"]
    assert _loader.ensure_loaded(on_step=steps.append) is libs and len(steps) == len(_loader._DEPENDENCIES) + 3


# -- one cuDNN per process ------------------------------------------------------------------


def _maps(tmp_path, *paths):
    lines = ["7f0000000000-7f0000001000 r--p 00000000 00:00 0 [heap]"]
    lines += [f"7f{i:010x}-7f{i + 1:010x} r-xp 00000000 fd:01 {i} {p}" for i, p in enumerate(paths)]
    f = tmp_path / "maps"
    f.write_text("\n".join(lines) + "\n")
    return str(f)


def test_the_mapped_cudnn_files_are_read_from_the_process_maps(tmp_path):
    maps = _maps(tmp_path, "/site/nvidia/cudnn/lib/libcudnn.so.9", "/site/nvidia/cudnn/lib/libcudnn_graph.so.9",
                 "/site/nvidia/cudnn/lib/libcudnn.so.9", "/usr/lib/libc.so.6",
                 "/site/nvidia/cudnn/lib/libcudnn_engines_precompiled.so.9 (deleted)")
    files = _loader.mapped_cudnn(maps)
    assert files == ["/site/nvidia/cudnn/lib/libcudnn.so.9", "/site/nvidia/cudnn/lib/libcudnn_engines_precompiled.so.9",
                     "/site/nvidia/cudnn/lib/libcudnn_graph.so.9"]
    assert _loader.cudnn_copies_problem(files) is None
    assert _loader.mapped_cudnn(str(tmp_path / "absent")) == []


@pytest.mark.parametrize("files", [
    ["/a/libcudnn.so.9", "/b/libcudnn_graph.so.9"],           # sub-library from another cuDNN
    ["/a/libcudnn.so.9", "/b/libcudnn.so.9"],                 # two shims
    ["/a/libcudnn.so.9", "/a/libcudnn.so.9.19.0"],           # one library twice under two names
])
def test_two_cudnn_copies_in_one_process_are_named(files):
    problem = _loader.cudnn_copies_problem(files)
    assert problem and all(f in problem for f in files)


def test_a_cudnn_already_in_the_process_is_the_one_taken(monkeypatch):
    monkeypatch.setattr(_loader, "_already_loaded", lambda soname: "/torch/site/nvidia/cudnn/lib/libcudnn.so.9")
    monkeypatch.delenv("FASTATTN_CUDNN_PATH", raising=False)
    assert _loader._load_one(*_loader._CUDNN) == ("/torch/site/nvidia/cudnn/lib/libcudnn.so.9", None)
    assert _loader.cudnn_location()["chosen_by"].startswith("already loaded in this process")
    # Not for the other libraries: only cuDNN is asked about.
    monkeypatch.setattr(_loader, "_from_wheels", lambda name: f"/w/{name}")
    assert _loader._load_one(*_loader._DEPENDENCIES[0])[0] == "/w/cublasLt"


def test_an_override_other_than_the_cudnn_already_loaded_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(_loader, "_already_loaded", lambda soname: "/torch/lib/libcudnn.so.9")
    monkeypatch.setenv("FASTATTN_CUDNN_PATH", str(tmp_path / "libcudnn.so.9"))
    path, why = _loader._load_one(*_loader._CUDNN)
    assert path is None and "/torch/lib/libcudnn.so.9" in why and "one process can use one cuDNN" in why
    monkeypatch.setenv("FASTATTN_CUDNN_PATH", "/torch/lib/libcudnn.so.9")
    assert _loader._load_one(*_loader._CUDNN) == ("/torch/lib/libcudnn.so.9", None)


def test_nothing_loaded_means_no_held_cudnn():
    assert _loader._already_loaded("libfastattn-no-such-library.so.0") is None


def test_the_cudnn_in_process_report_names_versions_and_a_second_copy(monkeypatch):
    from fastattn import runtime

    monkeypatch.setattr(runtime, "libraries", dict)
    monkeypatch.setattr(runtime, "versions", lambda: {"cudnn_loaded": 92400})
    monkeypatch.setattr(_loader, "mapped_cudnn", lambda: ["/a/libcudnn.so.9", "/b/libcudnn_graph.so.9"])
    body = runtime.cudnn_in_process()
    assert body["fastattn"] == "9.24.0" and body["files"] == ["/a/libcudnn.so.9", "/b/libcudnn_graph.so.9"]
    assert "more than one cuDNN" in body["problem"]
