"""The one table of the element types fastattn names, and every spelling of them derived.

A row per name that AttentionConfig uses (its dtype choices and tensor_dtype's answers,
float32, int32, int64), plus uint8 (a workspace's bytes). Everything else that names a
dtype reads this table: config.DTYPES and FP8_DTYPES (and through them the C++ DType
enum, which tools/gen_config.py writes), the names AttentionConfig takes for a dtype
(_fields), the numpy / ml_dtypes names and item sizes and CUDA Array Interface type
strings of arrays (_arrays), the torch dtypes of fastattn.torch and fastattn.verify, the
verification's unit roundoff and tolerance, the FP8 types' largest values, and the CLI's
dtype flags. A new dtype is a row here.

torch is never imported here (fastattn imports without it): a row names its torch dtype
by attribute, which torch_dtypes() resolves with the torch module its caller imported.
"""

from __future__ import annotations

from typing import Any, Iterable, NamedTuple

__all__ = ["DType", "ROWS", "BY_NAME", "DTYPES", "FP8_DTYPES", "SIXTEEN_BIT", "VERIFIED", "ITEMSIZE", "ALIASES",
           "torch_dtypes"]


class DType(NamedTuple):
    name: str  # fastattn's name: AttentionConfig's dtype, tensor_dtype's answer
    itemsize: int  # bytes per element
    numpy: str  # numpy's name (ml_dtypes' for bfloat16 and FP8), as cuda.core reports an array's dtype
    torch: str  # the attribute of the torch module
    attention: bool = False  # a dtype of q, k, v (AttentionConfig.dtype's choices)
    fp8: bool = False  # cuDNN's FP8 graphs, with per-tensor scales
    aliases: tuple[str, ...] = ()  # names AttentionConfig also takes, besides numpy's and str() of the torch dtype
    ml_dtypes: bool = False  # numpy has it only through ml_dtypes (cuda.core refuses to name it)
    typestr: str | None = None  # the CUDA Array Interface's type string (None: it has none)
    # fastattn.verify's measure, for the dtypes it checks: the unit roundoff 2^-p, p the
    # bits of precision (bf16 8, fp16 11), and the tolerance (fastattn.verdict.TOLERANCE):
    # the largest absolute error allowed, relative to max |reference| of each output. bf16
    # keeps 8 bits of mantissa (a half ulp is 2^-9 of the value), fp16 11; the gradients add
    # the error of summing s_q or s_kv products. Measured against the efficient kernel on
    # the device by tests/attention/test_verify_gpu.py (which fails if a tolerance here is
    # stricter than twice its error).
    unit_roundoff: float | None = None
    tolerance: float | None = None
    fp8_max: float | None = None  # the largest finite value of an FP8 type


ROWS = (
    DType("fp16", 2, "float16", "float16", attention=True, aliases=("half", "torch.half"), typestr="<f2",
          unit_roundoff=2.0**-11, tolerance=1.5e-2),
    DType("bf16", 2, "bfloat16", "bfloat16", attention=True, ml_dtypes=True, unit_roundoff=2.0**-8,
          tolerance=6.25e-2),
    # FP8: OCP's names (e4m3, e5m2) besides the torch / numpy (ml_dtypes) names of the same types.
    DType("fp8_e4m3", 1, "float8_e4m3fn", "float8_e4m3fn", attention=True, fp8=True, aliases=("e4m3",),
          ml_dtypes=True, fp8_max=448.0),
    DType("fp8_e5m2", 1, "float8_e5m2", "float8_e5m2", attention=True, fp8=True, aliases=("e5m2",), ml_dtypes=True,
          fp8_max=57344.0),
    DType("float32", 4, "float32", "float32", typestr="<f4"),
    DType("int32", 4, "int32", "int32", typestr="<i4"),
    DType("int64", 8, "int64", "int64", typestr="<i8"),
    DType("uint8", 1, "uint8", "uint8", typestr="|u1"),
)

BY_NAME = {d.name: d for d in ROWS}
# AttentionConfig's dtypes (q, k, v), in the C++ DType enum's order; FP8's; the 16-bit ones
# (what fastattn.torch.attention takes); the ones fastattn.verify checks.
DTYPES = tuple(d.name for d in ROWS if d.attention)
FP8_DTYPES = tuple(d.name for d in ROWS if d.attention and d.fp8)
SIXTEEN_BIT = tuple(d.name for d in ROWS if d.attention and not d.fp8)
VERIFIED = tuple(d.name for d in ROWS if d.tolerance is not None)
ITEMSIZE = {d.name: d.itemsize for d in ROWS}
# Every name AttentionConfig takes for a dtype (its own, numpy's, str() of the torch
# dtype, the aliases) -> its name.
ALIASES = {alias: d.name for d in ROWS if d.attention for alias in (d.name, d.numpy, f"torch.{d.torch}", *d.aliases)}


def torch_dtypes(torch: Any, names: Iterable[str]) -> dict:
    """{torch dtype: name} of `names` (in their order), `torch` the torch module."""
    return {getattr(torch, BY_NAME[n].torch): n for n in names}
