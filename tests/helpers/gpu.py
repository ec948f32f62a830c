"""Device buffers (through cuda-python) and a float64 attention reference (numpy).

No PyTorch: the core's GPU tests need only fastattn's own dependencies.
"""

from __future__ import annotations

import numpy as np

from fastattn.config import AttentionConfig


def _check(result):
    err = result[0]
    if int(err) != 0:
        from cuda.bindings import runtime as rt

        raise RuntimeError(f"CUDA error {err}: {rt.cudaGetErrorString(err)[1].decode()}")
    return result[1] if len(result) == 2 else result[1:]


def synchronize():
    from cuda.bindings import runtime as rt

    _check(rt.cudaDeviceSynchronize())


class DeviceBuffer:
    """A cudaMalloc'd buffer of `nbytes`, freed on close/GC."""

    def __init__(self, nbytes: int):
        from cuda.bindings import runtime as rt

        self.nbytes = max(int(nbytes), 1)
        self.ptr = int(_check(rt.cudaMalloc(self.nbytes)))

    def poison(self):
        """0xFF bytes: NaN in fp16, bf16 and fp32, so an unwritten element shows."""
        from cuda.bindings import runtime as rt

        _check(rt.cudaMemset(self.ptr, 0xFF, self.nbytes))

    def upload(self, raw: np.ndarray):
        from cuda.bindings import runtime as rt

        raw = np.ascontiguousarray(raw)
        assert raw.nbytes <= self.nbytes
        _check(rt.cudaMemcpy(self.ptr, raw.ctypes.data, raw.nbytes, rt.cudaMemcpyKind.cudaMemcpyHostToDevice))

    def download(self, dtype, count: int) -> np.ndarray:
        from cuda.bindings import runtime as rt

        out = np.empty(count, dtype=dtype)
        _check(rt.cudaMemcpy(out.ctypes.data, self.ptr, out.nbytes, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost))
        return out

    def close(self):
        if self.ptr:
            from cuda.bindings import runtime as rt

            rt.cudaFree(self.ptr)
            self.ptr = 0

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# -- 16-bit formats as raw uint16 -----------------------------------------------------


def to_raw(x: np.ndarray, dtype: str) -> np.ndarray:
    """float values -> uint16 bit patterns of fp16 or bf16 (round to nearest even)."""
    if dtype == "fp16":
        return x.astype(np.float16).view(np.uint16)
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def from_raw(raw: np.ndarray, dtype: str) -> np.ndarray:
    """uint16 bit patterns of fp16 or bf16 -> float64."""
    if dtype == "fp16":
        return raw.view(np.float16).astype(np.float64)
    return (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def quantize(x: np.ndarray, dtype: str) -> np.ndarray:
    return from_raw(to_raw(x, dtype), dtype)


# -- tensors laid out by the config's strides --------------------------------------------


class Tensor:
    """A device buffer holding one of the config's tensors at its strides."""

    def __init__(self, cfg: AttentionConfig, name: str):
        self.cfg, self.name = cfg, name
        self.shape = cfg.shape(name)
        self.strides = cfg.strides(name)
        self.is_stats = AttentionConfig.tensor_dtype(name) == "float32"  # stats, sink, d_sink
        self.np_dtype = np.float32 if self.is_stats else np.uint16
        self.count = cfg.storage_elements(name)
        self.buf = DeviceBuffer(self.count * np.dtype(self.np_dtype).itemsize)
        self.buf.poison()

    @property
    def ptr(self) -> int:
        return self.buf.ptr

    def _view(self, flat: np.ndarray) -> np.ndarray:
        item = flat.itemsize
        return np.lib.stride_tricks.as_strided(flat, self.shape, tuple(s * item for s in self.strides))

    def write(self, values: np.ndarray):
        """Writes logical (b, h, s, d) values; bytes outside the tensor stay poisoned."""
        flat = np.full(self.count, 0xFFFF, dtype=np.uint16) if not self.is_stats else np.full(
            self.count, np.nan, dtype=np.float32)
        view = self._view(flat)
        view[...] = values.astype(np.float32) if self.is_stats else to_raw(values, self.cfg.dtype)
        self.buf.upload(flat)

    def read(self) -> np.ndarray:
        """Logical (b, h, s, d) values as float64."""
        flat = self.buf.download(self.np_dtype, self.count)
        view = self._view(flat).copy()
        return view.astype(np.float64) if self.is_stats else from_raw(view, self.cfg.dtype)

    def raw(self) -> bytes:
        return self._view(self.buf.download(self.np_dtype, self.count)).copy().tobytes()


# -- the float64 reference -------------------------------------------------------------


def allowed(cfg: AttentionConfig) -> np.ndarray:
    """(seqlen_q, seqlen_kv) bool: which keys each query sees."""
    i = np.arange(cfg.seqlen_q)[:, None]
    j = np.arange(cfg.seqlen_kv)[None, :]
    bottom_right = cfg.mask == "causal_bottom_right" or cfg.alignment == "bottom_right"
    shift = cfg.seqlen_kv - cfg.seqlen_q if bottom_right else 0
    ok = np.ones((cfg.seqlen_q, cfg.seqlen_kv), dtype=bool)
    left, right = cfg.window
    if cfg.mask != "none":
        right = 0
    if right >= 0:
        ok &= j <= i + shift + right
    if left >= 0:
        ok &= j >= i + shift - left
    return ok


def fa_allowed(sq: int, sk: int, causal: bool, window: tuple[int, int], seqlen_k: int | None = None) -> np.ndarray:
    """(sq, sk) bool: the keys each query sees in FlashAttention 2, from its docstring
    (query i attends to keys in [i + sk - sq - left, i + sk - sq + right]; causal: right
    = 0), after flash_api.cpp's normalization (a bound >= seqlen_k, the call's longest key
    length, is unbounded)."""
    seqlen_k = sk if seqlen_k is None else seqlen_k
    left, right = window
    if causal:
        right = 0
    left = -1 if left >= seqlen_k else left
    right = -1 if right >= seqlen_k else right
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    ok = np.ones((sq, sk), dtype=bool)
    if right >= 0:
        ok &= j <= i + sk - sq + right
    if left >= 0:
        ok &= j >= i + sk - sq - left
    return ok


def alibi_slopes(heads: int) -> np.ndarray:
    """cuDNN's ALiBi slopes for `heads` query heads (cudnn-frontend's get_alibi_slope,
    in float32 as it computes them): the ALiBi paper's, interleaved for head counts
    that are not powers of two."""
    n = 1 << int(np.log2(heads))
    base = [i + 1.0 for i in range(n)] + [(2 * j + 1) * 0.5 for j in range(heads - n)]
    return np.array([np.power(np.float32(2.0), np.float32(-8.0 * x) / np.float32(n)) for x in base], dtype=np.float64)


def reference(cfg: AttentionConfig, q, k, v, d_o=None):
    """Float64 attention: returns (o, stats, (d_q, d_k, d_v) or None)."""
    r = reference_full(cfg, q, k, v, d_o)
    return r["o"], r["stats"], ((r["d_q"], r["d_k"], r["d_v"]) if d_o is not None else None)


def reference_full(cfg: AttentionConfig, q, k, v, d_o=None, *, bias=None, sink=None, keep=None) -> dict:
    """Float64 attention with the features: bias (broadcastable to (b, hq, sq, skv),
    added after scaling), sink ((hq,) logits in every softmax denominator), keep (the
    dropout mask as 0/1, (b, hq, sq, skv), kept weights scaled by 1 / (1 - dropout)).
    Returns o and stats, and with d_o also d_q, d_k, d_v, d_bias (summed to bias's
    shape) and d_sink ((hq,))."""
    group = cfg.heads_q // cfg.heads_kv
    k_full = np.repeat(k, group, axis=1)
    v_full = np.repeat(v, group, axis=1)
    mask = allowed(cfg)
    s = cfg.scale * np.einsum("bhqd,bhkd->bhqk", q, k_full)
    if cfg.alibi:  # after the scale, before the mask, as cuDNN's graph adds it
        rel_pos = np.arange(cfg.seqlen_kv)[None, :] - np.arange(cfg.seqlen_q)[:, None]
        s = s + alibi_slopes(cfg.heads_q)[None, :, None, None] * rel_pos[None, None]
    if bias is not None:
        s = s + bias
    s = np.where(mask, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    if sink is not None:
        m = np.maximum(m, sink[None, :, None, None])
    m = np.where(np.isfinite(m), m, 0.0)  # a row that sees no key (a bottom-right diagonal): p = 0, o = 0
    e = np.exp(s - m)
    l = e.sum(axis=-1, keepdims=True)
    if sink is not None:
        l = l + np.exp(sink[None, :, None, None] - m)
    p = e / np.where(l > 0, l, 1.0)
    drop = p if keep is None else p * keep / (1.0 - cfg.dropout)
    o = np.einsum("bhqk,bhkd->bhqd", drop, v_full)
    with np.errstate(divide="ignore"):
        out = {"o": o, "stats": m + np.log(l)}  # -inf where a row sees no key
    if d_o is None:
        return out
    dv_full = np.einsum("bhqk,bhqd->bhkd", drop, d_o)
    dp = np.einsum("bhqd,bhkd->bhqk", d_o, v_full)
    if keep is not None:
        dp = dp * keep / (1.0 - cfg.dropout)
    delta = (d_o * o).sum(axis=-1, keepdims=True)
    ds = p * (dp - delta)
    out["d_q"] = cfg.scale * np.einsum("bhqk,bhkd->bhqd", ds, k_full)
    dk_full = cfg.scale * np.einsum("bhqk,bhqd->bhkd", ds, q)
    b, _, skv, _ = k.shape
    out["d_k"] = dk_full.reshape(b, cfg.heads_kv, group, skv, cfg.head_dim_qk).sum(axis=2)
    out["d_v"] = dv_full.reshape(b, cfg.heads_kv, group, skv, cfg.head_dim_v).sum(axis=2)
    if bias is not None:
        axes = tuple(i for i in (0, 1, 2) if bias.shape[i] == 1)  # a one-row bias sums over the queries
        out["d_bias"] = ds.sum(axis=axes, keepdims=True)
    if sink is not None:  # d stats / d sink = p_sink; o depends on it through 1 / l
        p_sink = np.exp(sink[None, :, None, None] - m) / l
        out["d_sink"] = -(p_sink * delta).sum(axis=(0, 2, 3))
    return out


def rel_error(out: np.ndarray, ref: np.ndarray) -> float:
    """||out - ref|| / ||ref||; NaN anywhere (an unwritten element) gives inf."""
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def random_inputs(cfg: AttentionConfig, rng: np.random.Generator, backward: bool):
    """Fresh random q, k, v (and d_o), rounded to the config's dtype."""
    q = quantize(rng.standard_normal(cfg.shape("q")), cfg.dtype)
    k = quantize(rng.standard_normal(cfg.shape("k")), cfg.dtype)
    v = quantize(rng.standard_normal(cfg.shape("v")), cfg.dtype)
    d_o = quantize(rng.standard_normal(cfg.shape("o")), cfg.dtype) if backward else None
    return q, k, v, d_o


def softcap_with_lengths_refused(device: int = 0) -> str | None:
    """The known cuDNN gap (fastattn.defects.GAPS) that refuses softcap with per-sequence
    lengths on the loaded cuDNN and this GPU, by name, or None where those graphs build:
    a test of such a call asserts the refusal that names it there, its numbers elsewhere."""
    from fastattn import _core, _loader, defects

    _loader.ensure_loaded()
    probe = AttentionConfig(batch=1, heads_q=1, seqlen_q=2, head_dim_qk=64, softcap=1.0, padding=True)
    notes = defects.refusal_notes(probe, _core.versions()[0], tuple(_core.get_device_info(device)["compute_capability"]))
    return notes[0].split(":", 1)[0].removeprefix("known cuDNN gap ") if notes else None
