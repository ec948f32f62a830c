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
