"""The cuDNN version check at load, on the GPU machine: the loader refuses a cuDNN older
than the oldest supported one (test_loader.py checks the rule itself without a GPU)."""

import pytest

import fastattn
from fastattn import _loader


def test_an_old_cudnn_at_load_is_a_library_error(monkeypatch):
    from fastattn import _core

    _loader.ensure_loaded()
    monkeypatch.setattr(_loader, "_loaded", None)
    monkeypatch.setattr(_core, "init_cudnn", lambda path: 91300)
    with pytest.raises(fastattn.LibraryError, match="cuDNN 9.13.0 at .* is not supported"):
        _loader.ensure_loaded()
