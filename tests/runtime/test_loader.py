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
