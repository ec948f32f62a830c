"""The README's examples and docs/API.md's (CuPy, JAX) without a GPU: they compile and their
arrays are checked (host arrays refused). test_readme_gpu.py runs them as written, where their
framework is installed."""

import re
from types import SimpleNamespace

import pytest

from helpers.paths import DOCS, README

API = DOCS / "API.md"  # the raw API's page: the examples for other frameworks


def _python_blocks(page=README):
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


def _block(framework: str) -> str:
    """docs/API.md's example whose first line is the comment `# <framework>`."""
    found = [b for b in _python_blocks(API) if b.startswith(f"# {framework}\n")]
    assert len(found) == 1, f"docs/API.md has {len(found)} examples headed '# {framework}'"
    return found[0]


def test_readme_has_an_example():
    assert _python_blocks(), "README lost its example"


@pytest.mark.parametrize("framework", ["CuPy", "JAX"])
def test_readme_framework_examples_compile(framework):
    compile(_block(framework), f"{API}:{framework}", "exec")


def test_readme_examples_compile():
    for i, block in enumerate(_python_blocks()):
        compile(block, f"{README}:{i}", "exec")


def test_cuda_core_reads_arrays_without_a_gpu():
    """What the examples rely on without a GPU: cuda.core imports and reads a DLPack
    array, and fastattn refuses it as host memory, naming the tensor."""
    import numpy as np
    from cuda.core import Device, Stream  # noqa: F401 (the examples' imports)
    from cuda.core.utils import StridedMemoryView

    from fastattn import AttentionConfig, InvalidArgumentError, _arrays

    cfg = AttentionConfig(batch=2, heads_q=16, seqlen_q=64, head_dim_qk=128, dtype="fp16", layout="bshd")
    q = np.zeros((2, 64, 16, 128), np.float16)
    assert StridedMemoryView.from_dlpack(q, stream_ptr=-1).shape == q.shape
    plan = SimpleNamespace(config=cfg, device=0, _layouts={})
    with pytest.raises(InvalidArgumentError, match=r"^q: device memory needed, got host memory \(numpy.ndarray\)"):
        _arrays.address(plan, "q", q)


def test_jax_arrays_are_read_without_a_gpu():
    jnp = pytest.importorskip("jax.numpy", reason="jax is not installed")
    from fastattn import AttentionConfig, InvalidArgumentError, _arrays

    cfg = AttentionConfig(batch=2, heads_q=16, seqlen_q=64, head_dim_qk=128, dtype="bf16", layout="bshd")
    q = jnp.zeros((2, 64, 16, 128), jnp.bfloat16)
    if q.devices().pop().platform != "cpu":
        pytest.skip("jax on a GPU: the GPU test runs the example")
    with pytest.raises(InvalidArgumentError, match=r"^q: device memory needed, got host memory \(jax"):
        _arrays.address(SimpleNamespace(config=cfg, device=0, _layouts={}), "q", q)
