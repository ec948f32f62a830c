"""Shape classes: one plan per class of sequence lengths, so that a new length inside a
known class builds and loads nothing.

A class is a range of lengths (lo, hi]; its plan is declared for hi and takes each call's
lengths at run time: cuDNN's shape override where the loaded cuDNN has it (>= 9.21), else
its ragged (THD) graph with lengths and offsets from device arrays (fastattn.torch's
_shape_classes says which serves what). Length 1
(a decode step's query) is always a class of its own: a q = 1 call never runs a graph
declared for more rows.

The choice (`shape_classes=` of fastattn.torch.attention, or FASTATTN_SHAPE_CLASSES):
- "off": exact plans, one per shape (today's behaviour);
- explicit boundaries, e.g. (256, 1024, 4096) or "256,1024,4096": the classes (1, 256],
  (256, 1024], (1024, 4096]; a longer length gets its exact plan;
- "auto": the classes that benchmarks/bench_shape_classes.py measured on this GPU and
  cuDNN version (fastattn/_measured/shape_classes.json) as costing at most TOLERANCE
  more kernel time than exact plans; every other length an exact plan. Where no
  measurement exists for the loaded GPU and cuDNN, "auto" is "off": a class plan's
  kernel can be slower than the exact shape's (cudnn-frontend#1087 saw 2.0-2.3x), and
  fastattn does not guess.

Pure Python, no torch: the CLI (fastattn warm --seqlens) and env.py read it too.
"""

from __future__ import annotations

import os
import re
from typing import Any, NamedTuple

from . import parsing
from ._fields import show
from .errors import InvalidArgumentError

__all__ = ["Classes", "parse", "class_of", "measured", "parse_range", "classes_in_range", "class_config",
           "CANDIDATES", "TOLERANCE", "PATH", "FORMAT", "OVERRIDE_MAX"]

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_measured", "shape_classes.json")
FORMAT = 1
# The class upper bounds the benchmark measures (and "auto" can choose among): powers of
# two, each class the lengths above the one before.
CANDIDATES = tuple(1 << i for i in range(6, 16))  # 64 ... 32768
# A class is kept where its plan's kernel costs at most this much more than the exact
# plan's, at every measured length in it (the "a few percent").
TOLERANCE = 0.05
_MAX = 2**31 - 1  # cuDNN's lengths and offsets are int32
# The longest class (its upper bound, in rows) whose inference calls without per-sequence
# lengths take the shape-override plan where the loaded cuDNN has one (9.21 or newer, less the
# registry's refusals); longer classes, every other call and a class whose override plan cuDNN
# refuses take the ragged plan. The bound is where the override stops paying: on an H100 with
# cuDNN 9.28.1 (docs/BENCHMARKS.md, "Shape classes against exact plans"), prefill on override
# plans ran 0.90-1.20x the exact plan's kernel time in classes up to 1024 rows against the
# ragged plans' 1.23-1.47x, and above it 1.59-2.32x (the engine cuDNN picks for the declared
# length) against 1.08-1.15x. 0: never the override.
OVERRIDE_MAX = 1024


class Classes(NamedTuple):
    """Classes as ranges: lengths in (lo, hi] are served by the plan declared for hi.
    Sorted, disjoint; lengths in no range get exact plans."""

    ranges: tuple[tuple[int, int], ...]

    def __bool__(self) -> bool:
        return bool(self.ranges)

    def upper(self, n: int) -> int | None:
        """The class plan's declared length for a call of length n, or None (exact)."""
        if n == 1:
            return 1  # a decode step's query: its own class (see the module's docstring)
        for lo, hi in self.ranges:
            if lo < n <= hi:
                return hi
        return None


OFF = Classes(())


def _bad(name: str, value: Any, why: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{name}={show(value)}: {why}")


def boundaries(values, name: str = "shape_classes") -> Classes:
    """Explicit class upper bounds (ascending ints, 2 <= b < 2**31) as Classes."""
    try:
        bs = list(values)
    except TypeError:
        raise _bad(name, values, 'expected "auto", "off" or ascending ints (e.g. (256, 1024, 4096))') from None
    if not bs:
        raise _bad(name, values, "no boundaries: pass \"off\" for exact plans")
    for b in bs:
        if isinstance(b, bool) or not isinstance(b, int) or not 2 <= b <= _MAX:
            raise _bad(name, values, f"boundary {show(b)} is not an int in 2..{_MAX}")
    if any(a >= b for a, b in zip(bs, bs[1:])):
        raise _bad(name, values, "boundaries must be strictly ascending")
    return Classes(tuple(zip([1, *bs[:-1]], bs)))


def parse(value, name: str = "shape_classes") -> str | Classes:
    """A user's choice: "auto", "off" (either case, surrounding spaces allowed), a
    comma-separated string of boundaries, or a sequence of ints. Returns "auto" or
    Classes (OFF for "off"). Raises InvalidArgumentError naming `name`."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("auto", "off"):
            return "auto" if text == "auto" else OFF
        expected = 'expected "auto", "off" or comma-separated lengths (e.g. "256,1024,4096")'
        try:
            parts = parsing.items(value)
        except ValueError as e:
            raise _bad(name, value, f"{e}; {expected}") from None
        # ASCII digits: int() also takes other scripts' (١٢).
        if not all(re.fullmatch(r"[0-9]+", p) for p in parts):
            raise _bad(name, value, expected)
        parts = [p.lstrip("0") or "0" for p in parts]
        for p in parts:
            if len(p) > 10:  # out of range, and int() raises past 4300 digits (so no leading zeros)
                raise _bad(name, value, f"a boundary of {len(p)} digits is not an int in 2..{_MAX}")
        return boundaries([int(p) for p in parts], name)
    if isinstance(value, Classes):
        return value
    return boundaries(value, name)


def class_of(n: int, classes: Classes) -> int | None:
    """Classes.upper as a function: the declared length serving n, or None (exact)."""
    return classes.upper(n)


def class_config(*, batch: int, heads_q: int, heads_kv: int, head_dim_qk: int, head_dim_v: int, dtype: str,
                 upper_q: int, upper_kv: int, override: bool = False, **fields):
    """The one description of a class plan, declared for the class's lengths, with the
    call's other AttentionConfig fields (mask, window, ...): the ragged (THD) bshd config,
    or with override the dense bshd one built with cuDNN's shape override (cuDNN >= 9.21).
    fastattn.torch's class-served calls (_shape_classes.plan_for) and `fastattn warm --seqlens`
    both make it here, so that warm builds the plans calls ask for."""
    from .config import AttentionConfig

    kind = dict(shape_override=True) if override else dict(padding=True, ragged=True)
    return AttentionConfig(batch=batch, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=upper_q, seqlen_kv=upper_kv,
                           head_dim_qk=head_dim_qk, head_dim_v=head_dim_v, dtype=dtype, layout="bshd", **kind,
                           **fields)


# -- "auto": the measured file ---------------------------------------------------------------

def _ratio(m: Any, direction: str) -> float | None:
    c, e = m.get(f"{direction}_class_us"), m.get(f"{direction}_exact_us")
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in (c, e)):
        return None
    return c / e


def measured(gpu: str, cudnn: int, path: str | None = None, training: bool = False) -> Classes | None:
    """The classes the recorded benchmark kept for this GPU (its name, as
    torch.cuda.get_device_name gives it) and cuDNN version (cudnnGetVersion's number),
    or None where nothing was recorded for them (the file missing, damaged, or without a
    row for this GPU and cuDNN). A class is kept only when every measured length in it
    ran within TOLERANCE of its exact plan (forward; and backward, for training calls)
    and it was measured at all; a damaged measurement drops its class."""
    from .perf_notes import read_measured  # (here: env.py imports this module, perf_notes imports config)

    data = read_measured(path or PATH, FORMAT)
    if data is None:
        return None
    for row in data["rows"]:
        if not isinstance(row, dict) or row.get("gpu") != gpu or row.get("cudnn") != cudnn:
            continue
        kept = []
        for c in row.get("classes") or ():
            try:
                lo, hi, lengths = int(c["lo"]), int(c["hi"]), c["lengths"]
                if not (1 <= lo < hi <= _MAX) or not lengths:
                    continue
                ok = True
                for m in lengths:
                    for direction in ("forward", "backward") if training else ("forward",):
                        r = _ratio(m, direction)
                        ok = ok and r is not None and r <= 1.0 + TOLERANCE
                if ok:
                    kept.append((lo, hi))
            except (KeyError, TypeError, ValueError):
                continue  # a damaged class: not kept
        kept.sort()
        if any(a[1] > b[0] for a, b in zip(kept, kept[1:])):
            return None  # overlapping classes: not a file the benchmark wrote
        return Classes(tuple(kept))
    return None


# -- ranges of lengths (fastattn warm --seqlens) ----------------------------------------------

def parse_range(text: str, name: str = "--seqlens") -> tuple[int, int]:
    """"LO..HI" (inclusive, 1 <= LO <= HI < 2**31) or a single length "N"."""
    m = re.fullmatch(r"\s*([0-9]+)\s*(?:\.\.\s*([0-9]+)\s*)?", text or "")  # ASCII digits, as parse()
    if not m:
        raise _bad(name, text, "expected LO..HI (e.g. 1..32768) or one length")
    digits = [g.lstrip("0") or "0" for g in m.groups() if g is not None]
    if max(len(d) for d in digits) > 10:  # before int(), which raises past 4300 digits
        raise _bad(name, text, f"expected 1 <= LO <= HI <= {_MAX}")
    lo, hi = int(digits[0]), int(digits[-1])
    if not 1 <= lo <= hi <= _MAX:
        raise _bad(name, text, f"expected 1 <= LO <= HI <= {_MAX}")
    return lo, hi


def classes_in_range(lo: int, hi: int, classes: Classes) -> tuple[list[int], list[tuple[int, int]]]:
    """The class plans' declared lengths that serve every length in [lo, hi] (ascending),
    and the sub-ranges no class covers (those lengths need exact plans, one each)."""
    uppers, uncovered = [], []
    n = lo
    if n == 1:
        uppers.append(1)
        n = 2
    for c_lo, c_hi in classes.ranges:
        if c_hi < n or n > hi:
            continue
        if c_lo >= n:  # a gap before this class
            if c_lo >= hi:
                break
            uncovered.append((n, c_lo))
            n = c_lo + 1
        uppers.append(c_hi)
        n = c_hi + 1
    if n <= hi:
        uncovered.append((n, hi))
    return uppers, uncovered
