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


def test_the_process_holds_one_cudnn_which_torch_and_fastattn_share():
    """After PyTorch's cuDNN attention and fastattn's have both run (each loading the
    sub-libraries it needs), every cuDNN file mapped into the process lies in one
    directory, and PyTorch and fastattn report the same version: a run on a cuDNN brought
    to the machine (tools/other_cudnn.sh) tests that one alone."""
    torch = pytest.importorskip("torch")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fastattn.torch import attention

    q = torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    attention(q, q, q, layout="bhsd")
    torch.cuda.synchronize()
    files = _loader.mapped_cudnn()
    assert any(f.endswith("libcudnn.so.9") for f in files) and _loader.cudnn_copies_problem(files) is None, files
    loaded = _loader.ensure_loaded()
    assert loaded.cudnn in files, (loaded.cudnn, files)
    assert int(torch.backends.cudnn.version()) == loaded.cudnn_version
