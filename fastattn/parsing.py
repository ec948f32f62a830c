"""How fastattn reads what a person types as a list or a number, in a flag or a
FASTATTN_* variable: one parser per kind, so that a kind means the same wherever it is
written (fastattn.env, fastattn.cli._common and fastattn.shape_classes build on these).

Each parser raises ValueError with the rule the text broke ("must be a duration: ...",
"is negative", "must be <= 1000000 (seconds)"), without the text or the name it was
given under: the caller says which flag or variable, and quotes the value in its own
way (argparse's "argument --x: 'value' ...", env's "NAME='value': ...").

Public, as fastattn.env is: the command (another package) reads its flags with it.
"""

from __future__ import annotations

import math
import re

__all__ = ["items", "integer", "real", "duration", "size"]

# Python's str.strip() also strips Unicode spaces (U+3000, U+00A0) that no shell or
# other program reading the same text treats as a separator.
SPACES = " \t\n\r\x0b\x0c"


def items(text: str) -> list[str]:
    """The items of a comma-separated list, each stripped of the spaces around it. An
    empty item, wherever it stands (`64,,128`, `,64`, `64,`, or nothing at all), is
    refused, naming its place: dropping it would read a list the user did not write."""
    out = [part.strip(SPACES) for part in text.split(",")]
    for i, item in enumerate(out, 1):
        if not item:
            raise ValueError("an empty list" if len(out) == 1 else f"item {i} is empty (of {len(out)} items)")
    return out


# -- numbers --------------------------------------------------------------------------------
#
# A number is ASCII decimal digits, an optional sign (a range check refuses a negative
# value where none is meaningful, saying so), and for a real number a decimal point and
# an exponent. int() and float() take more than a person types as a number (1_0,
# Arabic-Indic or fullwidth digits, inf, nan): not here. 0 is zero wherever it is
# written; a use where zero means nothing sensible refuses it itself.

_INTEGER = re.compile(r"[+-]?[0-9]+")
_REAL = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_DECIMAL = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)")
DIGITS = 1000  # more digits than any bound has: out of range without converting them
DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
SIZE_LIMIT = 2**63  # 8 EiB: what every size is below (a signed 64-bit file offset)

INTEGER_RULE = "an integer (ASCII digits 0-9, an optional sign)"
REAL_RULE = "a number (ASCII digits 0-9, a sign, a point, an exponent)"
DURATION_RULE = "a duration: a number with s, m, h, d or w (e.g. 90s, 12h, 30d); a bare number is seconds"
SIZE_RULE = "a size in bytes: an integer, or a number with K, M, G or T (powers of 1024; e.g. 500M, 1.5G)"


def _bounds(value, minimum, maximum, above=None, below=None, unit: str = "") -> None:
    if minimum is not None and value < minimum:
        raise ValueError("is negative" if minimum == 0 else f"must be >= {minimum:g}{unit}")
    if above is not None and not value > above:
        raise ValueError(f"must be > {above:g}{unit}")
    if maximum is not None and value > maximum:
        raise ValueError(f"must be <= {maximum:.0f}{unit}" if isinstance(maximum, float) else
                         f"must be <= {maximum}{unit}")
    if below is not None and not value < below:
        raise ValueError(f"must be < {below:g}{unit}")


def integer(text: str, minimum: int | None = None, maximum: int | None = None) -> int:
    """A count: an integer in ASCII digits within [minimum, maximum]."""
    t = text.strip(SPACES)
    if not _INTEGER.fullmatch(t):
        raise ValueError(f"must be {INTEGER_RULE}")
    if len(t) > DIGITS:  # past every bound, and int() refuses past 4300 digits
        value = -(10**DIGITS) if t[0] == "-" else 10**DIGITS
        _bounds(value, minimum, maximum)
        raise ValueError("is out of range")
    value = int(t)
    _bounds(value, minimum, maximum)
    return value


def real(text: str, minimum: float | None = None, maximum: float | None = None, *, above: float | None = None,
         below: float | None = None) -> float:
    """A real number, finite, within the bounds (above/below: exclusive)."""
    t = text.strip(SPACES)
    if not _REAL.fullmatch(t):
        raise ValueError(f"must be {REAL_RULE}")
    value = float(t)
    if not math.isfinite(value):  # 1e400
        raise ValueError("must be a finite number")
    _bounds(value, minimum, maximum, above, below)
    return value


def duration(text: str, maximum: float, *, above: float | None = None) -> float:
    """A duration in seconds: a number with a unit (s, m, h, d, w, in any case) or a bare
    number of seconds; at least 0 (above: more than it), at most `maximum` seconds."""
    t = text.strip(SPACES).lower()
    unit = t[-1] if t and t[-1] in DURATION_UNITS else ""
    number = t[:-1].rstrip(SPACES) if unit else t
    if not _REAL.fullmatch(number):
        raise ValueError(f"must be {DURATION_RULE}")
    value = float(number) * DURATION_UNITS.get(unit, 1)  # (9 x 400 digits: inf, over the maximum)
    _bounds(value, 0.0, float(maximum), above, unit=" (seconds)")
    return value


def size(text: str) -> int:
    """A size in bytes: an integer, or a decimal number with K, M, G or T (powers of
    1024; a B or iB after it allowed: 4G, 4GB, 4GiB), rounded down to a whole byte; at
    least 0, below 8 EiB, however many digits it is written with. No exponent: 1e3 is
    not how a size is written."""
    t = text.strip(SPACES).lower()
    if t.endswith("b"):
        t = t[:-1]
        if t.endswith("i") and len(t) > 1 and t[-2] in "kmgt":
            t = t[:-1]
    unit = t[-1] if t and t[-1] in "kmgt" else ""
    number = t[:-1].rstrip(SPACES) if unit else t
    if not (_DECIMAL if unit else _INTEGER).fullmatch(number):
        raise ValueError(f"must be {SIZE_RULE}")
    sign, digits = (number[0], number[1:]) if number[0] in "+-" else ("+", number)
    digits = digits.lstrip("0") or "0"
    if sign == "-" and digits.strip("0.") != "":
        raise ValueError("is negative")
    # Lengths first: int() refuses 4300 digits, and a float rounds 2**63 - 1 up to 2**63.
    if unit:
        if len(digits.split(".")[0]) > 20 or float(digits) * SIZE_UNITS[unit] >= SIZE_LIMIT:
            raise ValueError("must be below 8 EiB")
        return int(float(digits) * SIZE_UNITS[unit])
    if len(digits) > 19 or int(digits) >= SIZE_LIMIT:
        raise ValueError("must be below 8 EiB")
    return int(digits)
