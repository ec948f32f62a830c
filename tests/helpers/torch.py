"""What the fastattn.torch GPU tests share (helpers.gpu stays free of PyTorch)."""

import contextlib
import threading

import numpy as np
import torch
from hypothesis import strategies as st

import fastattn.torch
from fastattn.torch import _native


# What the op library publishes to the entry points (fastattn/torch/_native.py): with all of
# them None, every call takes the Python body, as on a machine without the op library.
NATIVE_ENTRIES = ("DENSE", "VARLEN", "PAGED", "CALL", "CALL_VARLEN")
# The same for a child process's script (a subprocess has no monkeypatch).
PYTHON_PATH_CODE = f"from fastattn.torch import _native; [setattr(_native, n, None) for n in {NATIVE_ENTRIES!r}]"


@contextlib.contextmanager
def deterministic(warn_only: bool):
    """torch.use_deterministic_algorithms(True, warn_only=...) inside, as it was after."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def take_python_path(monkeypatch) -> None:
    """Makes this process's entry points take the Python path until the test ends. An
    entry _native no longer has fails here (monkeypatch.setattr raises), not silently."""
    for name in NATIVE_ENTRIES:
        monkeypatch.setattr(_native, name, None)


class Block(torch.nn.Module):
    """A small attention block: qkv projection, fastattn.torch.attention (causal), output
    projection; what torch.compile tests trace."""

    def __init__(self, dim=256, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        return self.out(fastattn.torch.attention(q, k, v, causal=True).reshape(b, s, d))


def on_path(which: str, monkeypatch):
    """fastattn.torch's entry points on the op library ("native": it must load on the GPU
    machine) or on the Python path ("python"); the op library."""
    lib = _native.library()
    assert lib is not None, _native.status()
    if which == "python":
        take_python_path(monkeypatch)
    else:
        _native._publish_ops()
    return lib


@contextlib.contextmanager
def sdpa_mode_on(which: str, monkeypatch):
    """The SDPA mode on, with the op library's C++ kernels ("native") or the Python ones, its
    routes cleared first; off after."""
    from fastattn.torch import _sdpa_mode

    lib = on_path(which, monkeypatch)
    lib.clear()
    _sdpa_mode._routes.clear()
    fastattn.torch.enable_sdpa()
    assert (_sdpa_mode._state.library is lib) == (which == "native")
    try:
        yield
    finally:
        fastattn.torch.disable_sdpa()


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many units in the last place of a's dtype each element of a lies from b's,
    the unit taken at the larger of the two magnitudes (NaN where either is NaN): what a
    kernel that is not bitwise repeatable promises (fastattn.torch.attention_paged, 1)."""
    x, y = a.float(), b.float()
    finfo = torch.finfo(a.dtype)
    big = torch.maximum(x.abs(), y.abs()).clamp_min(finfo.tiny)
    return (x - y).abs() / (finfo.eps * torch.exp2(torch.floor(torch.log2(big))))


def in_threads(n, fn):
    """fn(i) in n threads released together (a barrier), each then draining its current
    stream (where there is CUDA); their results by i. Raises the first exception a
    thread raised."""
    barrier = threading.Barrier(n)
    results, errors = {}, []

    def worker(i):
        try:
            barrier.wait()
            results[i] = fn(i)
            if torch.cuda.is_available():
                torch.cuda.current_stream().synchronize()
        except BaseException as e:  # noqa: BLE001 - raised below, in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def assert_options_mean_the_same(kw, causal, bottom_right, deterministic, alibi, left, right, scale):
    """What a C entry's reader (fastattn/torch/csrc/readers.h, through the tests' `readers`
    extension) read from the keyword arguments `kw` is what the Python body makes of them."""
    from fastattn import _fields
    from fastattn.torch import _plans

    assert (left, right, scale) == _plans.options(kw["causal"], kw["causal_bottom_right"], kw["window"], kw["scale"],
                                                  kw["deterministic"], kw["alibi"])
    assert bottom_right == _plans.bottom_right(kw["alignment"], kw["causal_bottom_right"])
    assert causal == bool(kw["causal"] or kw["causal_bottom_right"])
    assert (deterministic, alibi) == (kw["deterministic"], kw["alibi"])
    assert _fields.check("probability", "dropout_p", kw["dropout_p"]) == 0.0
    assert kw["return_lse"] is False


# softcap values an entry point's C entry must take as its Python body does, or hand back.
SOFTCAPS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2, 2),
                     st.sampled_from([0.0, -0.0, 30.0, 1e-50, 1e39, "30", None, True, np.float32(30.0)]))


def assert_softcap_means_the_same(given, got):
    """What a C entry runs with is what _options.positive_or_zero makes of the argument."""
    from fastattn.torch import _options

    assert got == _options.positive_or_zero("softcap", given)


def rotary_reference(x, cos, sin, positions, interleaved):
    """FlashAttention's rotary embedding in float64, written as complex multiplication
    (independent of fastattn.flash's real arithmetic): x (b, s, h, d); cos, sin
    (seqlen_ro, rotary_dim / 2); positions (b, s), each row's; a position past the table
    is not rotated. Each pair (x0, x1) (interleaved: features 2i, 2i + 1; else i and
    i + rotary_dim / 2) is x0 + i x1 times cos + i sin; the features past rotary_dim pass."""
    half = cos.shape[1]
    r = 2 * half
    pairs = x[..., :r].reshape(*x.shape[:3], half, 2) if interleaved else \
        torch.stack((x[..., :half], x[..., half:r]), -1)
    z = torch.view_as_complex(pairs.double().contiguous())
    positions = torch.as_tensor(positions, device=x.device)
    inside = positions < cos.shape[0]
    p = positions.clamp(max=cos.shape[0] - 1).long()
    w = torch.complex(cos.double()[p], sin.double()[p])
    w = torch.where(inside[..., None], w, torch.ones_like(w))[:, :, None, :]
    rotated = torch.view_as_real(z * w)
    rotated = rotated.reshape(*x.shape[:3], r) if interleaved else torch.cat((rotated[..., 0], rotated[..., 1]), -1)
    return torch.cat((rotated, x[..., r:].double()), -1)
