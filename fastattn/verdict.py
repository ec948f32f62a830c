"""A plan's verification verdict: what running it once against a float32 reference
showed (fastattn.verify makes it; the cache entry stores it; `cache ls` shows it).

Pure Python and dependency-free: the store's entry decoder checks a stored verdict's
shape through `Verdict.from_dict`, so that a tampered or garbled verdict is a damaged
entry (a miss), never a crash or a plan served on a forged "passed".

The rule (one place): an output passes when it has no non-finite element where the
reference is finite and its largest absolute error beyond each element's rounding floor
(fastattn.verify.compare: twice the dtype's unit roundoff times the sum of the
magnitudes of the terms the element adds up; what rounding a 16-bit operand costs where
large terms cancel) is at most `tolerance` times the reference's scale (its largest
absolute value). TOLERANCE, by dtype, is that factor;
tests/attention/test_verify_gpu.py holds it at least twice what PyTorch's efficient
kernel achieves under the same measure, so that a correct plan never fails on rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from . import dtypes

__all__ = ["TOLERANCE", "Check", "Verdict", "VerdictError"]

# Largest absolute error allowed, relative to max |reference| of each output, by dtype:
# the tolerance column of fastattn.dtypes's table (why each value: there).
TOLERANCE = {d.name: d.tolerance for d in dtypes.ROWS if d.tolerance is not None}
STATUSES = ("passed", "failed", "skipped")
OUTPUTS = ("o", "d_q", "d_k", "d_v", "d_bias")
_TINY = 1e-30  # a scale of zero: only an exact zero passes


class VerdictError(ValueError):
    """A verdict dict of the wrong shape (the message says which part)."""


def _number(value: Any) -> bool:
    """A finite number >= 0 as a float holds it (an integer past 1.8e308 is not one:
    math.isfinite would raise OverflowError on it)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value)) and value >= 0
    except OverflowError:
        return False


def _count(value: Any) -> bool:
    """An integer in [0, 2**63): a cuDNN version, a count of elements."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


@dataclass(frozen=True)
class Check:
    """One output on one kind of data: kind ("random", "low_lse", "lengths"), output
    ("o", "d_q", "d_k", "d_v", "d_bias"), the largest absolute error against the
    reference where both are finite, the reference's scale (max |reference|), how many
    elements of the plan's output are non-finite where the reference is finite, and
    the largest error beyond each element's rounding floor (None: max_abs_error, no
    floor), which the rule judges."""

    kind: str
    output: str
    max_abs_error: float
    scale: float
    nonfinite: int
    excess: float | None = None

    def __post_init__(self) -> None:
        if self.excess is None:  # no floor: the whole error is judged
            object.__setattr__(self, "excess", self.max_abs_error)

    @property
    def judged(self) -> float:
        return self.excess

    def passed(self, tolerance: float) -> bool:
        return self.nonfinite == 0 and self.judged <= tolerance * max(self.scale, _TINY)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "output": self.output, "max_abs_error": self.max_abs_error, "scale": self.scale,
                "nonfinite": self.nonfinite, "excess": self.judged}

    def describe(self) -> str:
        rel = self.judged / max(self.scale, _TINY)
        bad = f", {self.nonfinite} non-finite" if self.nonfinite else ""
        return (f"{self.output} on {self.kind} data: max error {self.max_abs_error:.3g}, beyond rounding "
                f"{self.judged:.3g} ({rel:.3g} of scale){bad}")


@dataclass(frozen=True)
class Verdict:
    """status: "passed" (every check within tolerance), "failed" (some check not: the
    plan is refused and never served) or "skipped" (the verifier does not cover this
    config: `reason` says why; the plan serves as without --verify).
    cudnn_version: the cuDNN the plan ran on (as versions()'s cudnn_loaded).
    tolerance: TOLERANCE of the config's dtype, as applied.
    checks: one per (data kind, output), in the order run.
    seconds: what verification took."""

    status: str
    cudnn_version: int
    tolerance: float
    checks: tuple[Check, ...] = ()
    reason: str = ""
    seconds: float = 0.0

    @property
    def kinds(self) -> tuple[str, ...]:
        """The data kinds tried, in order."""
        return tuple(dict.fromkeys(c.kind for c in self.checks))

    @property
    def failures(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if not c.passed(self.tolerance))

    @classmethod
    def judge(cls, checks, cudnn_version: int, tolerance: float, seconds: float = 0.0) -> "Verdict":
        """The verdict the rule gives for `checks`."""
        checks = tuple(checks)
        v = cls("passed", cudnn_version, tolerance, checks, "", seconds)
        if v.failures:
            return cls("failed", cudnn_version, tolerance, checks, v.evidence(), seconds)
        return v

    def evidence(self) -> str:
        """The failing checks as one line (the refusal's reason)."""
        bad = self.failures
        return (f"failed verification (tolerance {self.tolerance:g} of scale, cuDNN {self.cudnn_version}): "
                + "; ".join(c.describe() for c in bad))

    def summary(self) -> str:
        """One short line: what `cache ls` and warm's table show."""
        if self.status == "skipped":
            return f"skipped ({self.reason})"
        worst = max((c.judged / max(c.scale, _TINY) for c in self.checks), default=0.0)
        bad = sum(c.nonfinite for c in self.checks)
        return (f"{self.status} ({'+'.join(self.kinds)}; worst {worst:.2g} of scale, tol {self.tolerance:g}"
                + (f", {bad} non-finite" if bad else "") + ")")

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "cudnn": self.cudnn_version, "tolerance": self.tolerance,
                "kinds": list(self.kinds), "checks": [c.to_dict() for c in self.checks], "reason": self.reason,
                "seconds": self.seconds}

    @classmethod
    def from_dict(cls, data: Any) -> "Verdict":
        """The verdict a stored dict holds; VerdictError unless it has exactly the
        shape to_dict gives and its status is the one its checks give (a stored
        "passed" over failing numbers is damage, not a verdict)."""
        if not isinstance(data, dict) or set(data) != {"status", "cudnn", "tolerance", "kinds", "checks", "reason",
                                                        "seconds"}:
            raise VerdictError("verdict: not an object with its fields")
        status, cudnn, tol, checks = data["status"], data["cudnn"], data["tolerance"], data["checks"]
        if status not in STATUSES:
            raise VerdictError(f"verdict: status {status!r}")
        if not _count(cudnn):
            raise VerdictError("verdict: cudnn")
        if not (_number(tol) and 0 < tol < 1) or not _number(data["seconds"]):
            raise VerdictError("verdict: tolerance or seconds")
        if not isinstance(data["reason"], str) or not isinstance(checks, list):
            raise VerdictError("verdict: reason or checks")
        out = []
        for c in checks:
            if not (isinstance(c, dict) and set(c) == {"kind", "output", "max_abs_error", "scale", "nonfinite", "excess"}
                    and isinstance(c["kind"], str) and c["output"] in OUTPUTS and _number(c["max_abs_error"])
                    and _number(c["scale"]) and _number(c["excess"]) and c["excess"] <= c["max_abs_error"]
                    and _count(c["nonfinite"])):
                raise VerdictError("verdict: a check")
            out.append(Check(c["kind"], c["output"], float(c["max_abs_error"]), float(c["scale"]), c["nonfinite"],
                             float(c["excess"])))
        v = cls(status, cudnn, float(tol), tuple(out), data["reason"], float(data["seconds"]))
        if data["kinds"] != list(v.kinds):
            raise VerdictError("verdict: kinds do not match its checks")
        if status == "skipped":
            if out or not v.reason:
                raise VerdictError("verdict: a skip carries no checks and says why")
        elif not out or (status == "failed") != bool(v.failures):
            raise VerdictError(f"verdict: status {status!r} is not what its checks give")
        return v


def parse(data: Any) -> Verdict | None:
    """A stored verdict, or None where the entry holds none (None); VerdictError
    for a malformed one."""
    return None if data is None else Verdict.from_dict(data)


def is_valid(data: Any) -> bool:
    """What the entry decoder asks of meta["verdict"]."""
    try:
        Verdict.from_dict(data)
    except VerdictError:
        return False
    return True
