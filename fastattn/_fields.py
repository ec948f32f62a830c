"""The field registry of AttentionConfig: each field's kind, default, help and how it
shows, and the one table of validators every path to a config goes through.

AttentionConfig declares each field once, with `spec(kind, default, ...)`; the metadata
that call stores is what the rest of fastattn derives from, so that adding a field is
one edit: the canonical form's optional features, `fastattn probe`'s flags, the short
description in tables (`describe`), the kernel family `fastattn warm` schedules by
(`kernel_family`) and `fastattn matrix --features`.

A validator checks the type and range of one value on its own and returns it in
canonical type; what depends on other fields (a causal mask fixes the window's right
bound, ragged needs padding, ...) stays in AttentionConfig.__post_init__. Validators
are per kind, not per field, so every field of a kind accepts and refuses the same
classes of values: a number is never a string, a bool is never an int, a pair is
never a mapping. A name (a "choice", "dtype" or "layout" field: mask, alignment, bias,
layout, dtype and its aliases) is taken exactly as written, lowercase, as the CLI's
flags and fastattn.torch take it: "Causal" and "BF16" are refused, naming the spelling
that would be taken.

Every error message that echoes a user's value formats it with show() (bad() does),
which cannot fail: an integer past Python's str() limit is "an integer of N digits",
and long values are cut. read_json() and long_integer() turn what json and tomllib
raise for such an integer in text (a bare ValueError) into an InvalidArgumentError.
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
import re
import reprlib
import struct
import sys
from collections.abc import Mapping, Set
from typing import Any, Callable

from . import dtypes
from .errors import InvalidArgumentError

INT_LIMIT = 2**31  # cuDNN takes int64 dims, but its masks and windows are int32
_NO_OFF = object()  # a field that is always in the canonical form


@dataclasses.dataclass(frozen=True)
class Cxx:
    """How a field reaches the C++ core: its members of the struct Config. tools/gen_config.py
    generates from these entries the struct (csrc/config_gen.h, with an enum class per enum
    type), its Cython declaration and the conversion _c_config (fastattn/_core_config.pxi).

    type: each member's C++ type: "int64_t", "bool", "float", "int64_t[4]" (an array), or
      the name of an enum class ("DType", "Mask") made from the field's choices: value i is
      choices[i], named k + the choice in CamelCase ("fp8_e4m3": kFp8E4m3). Fields that share
      an enum have the same choices.
    default: each member's C++ initializer.
    names: the members (default: one, named as the field).
    value: a Python expression of the config `cfg` that gives the member's value, or with
      several names a sequence of theirs (default: the field's value; one that can be None,
      a feature that is off, reaches C++ as the member's default, which must be zero).
    note: why the members are what they are (the header's comment; default: help).
    after: the member these follow in the struct, where that is not the registry's order.
    """

    type: str
    default: str
    names: tuple[str, ...] = ()
    value: str = ""
    note: str = ""
    after: str | None = None


def spec(kind: str, default: Any = dataclasses.MISSING, *, help: str, cxx: Cxx, minimum: int = 0,
         choices: tuple = (), off: Any = _NO_OFF, follows: str | None = None,
         family: bool | Callable[[Any], Any] = False, describe: Callable[[Any], str | None] | None = None,
         feature: tuple[str, dict[str, Any], str] | None = None, score: Callable[[Any, Any], tuple] | None = None
         ) -> Any:
    """A dataclass field of AttentionConfig with its registry entry.

    kind: a key of VALIDATORS. default: none given means required; None means one
      that follows from other fields. help: one line, for `fastattn probe --help`.
    cxx: how the field reaches the C++ core's Config (Cxx): every field does.
    minimum: the least value of an "int" field. choices: the names a "choice",
      "dtype" or "layout" field takes.
    off: the value of a feature added after the first release when it is not used; the
      canonical form (and so every cache key) leaves the field out at that value.
    follows: with default None, the field whose value it takes when not given.
    family: whether the field selects cuDNN kernel variants (kernel_family): True for
      its value, or a function of the config for a coarser one.
    describe: the config's short tag for this field in tables, or None to show none.
    feature: ("name", the fields that turn it on, "what it means"): a column of
      `fastattn matrix --features`.
    score: for a field that modifies the attention scores (a score modifier in the
      graph), what it computes, as the reference (fastattn.verify) runs it:
      score(value, s) -> (the modified scores, their derivative in s), s the scaled
      scores (a float tensor), applied before the bias and the masks.
    """
    if kind not in VALIDATORS:
        raise ValueError(f"unknown field kind {kind!r}")  # a mistake in config.py, caught at import
    meta = {"kind": kind, "help": help, "minimum": minimum, "choices": tuple(choices), "off": off,
            "follows": follows, "family": family, "describe": describe, "feature": feature, "cxx": cxx,
            "score": score}
    return dataclasses.field(default=default, metadata=meta)


def is_required(field: dataclasses.Field) -> bool:
    return field.default is dataclasses.MISSING


def has_off(field: dataclasses.Field) -> bool:
    return field.metadata["off"] is not _NO_OFF


def bad(field: str, value: Any, why: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{field}={show(value)}: {why}")


# -- a user's value and text in messages -------------------------------------------------

SHOWN = 200  # the most characters of one value a message echoes


def _digits(n: int) -> int:
    """Decimal digits of abs(n), counted without str() (which refuses past Python's limit)."""
    n = abs(n)
    d = int(n.bit_length() * 0.30102999566398120) + 1  # log10(2): exact, or one too many
    return d - 1 if d > 1 and 10 ** (d - 1) > n else d


def int_text(n: int) -> str:
    """An integer as a message shows it: its digits, or "an integer of N digits"."""
    if n.bit_length() <= 128:  # at most 39 digits
        return str(n)
    return f"{'a negative' if n < 0 else 'an'} integer of {_digits(n)} digits"


class _Repr(reprlib.Repr):
    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 4
        self.maxtuple = self.maxlist = self.maxarray = self.maxdict = self.maxset = self.maxfrozenset = \
            self.maxdeque = 8
        self.maxstring = self.maxother = 120

    def repr_int(self, x: int, level: int) -> str:
        return int_text(x)

    def repr_dict(self, x: dict, level: int) -> str:  # in the user's order (reprlib sorts the keys)
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        items = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}" for k, v in list(x.items())[:self.maxdict]]
        return "{" + ", ".join(items + (["..."] if len(x) > self.maxdict else [])) + "}"


_repr = _Repr()


def show(value: Any) -> str:
    """A user's value as an error message echoes it: its repr, except that an integer
    too long to print (str() refuses past sys.get_int_max_str_digits(), 4300 digits) is
    "an integer of N digits", containers and strings are cut to a few items and
    characters, and a value whose repr raises is shown by its type. A message about a
    bad value must never fail itself, nor print megabytes."""
    try:
        text = _repr.repr(value)
    except Exception:  # reprlib catches a failing repr only below containers
        text = f"<{type(value).__name__}>"
    return text if len(text) <= SHOWN else text[:SHOWN - 3] + "..."


def json_kind(value: Any) -> str:
    """What a value parsed from JSON or TOML is, in those formats' words ("null", "a
    list"), for a message about a file: Python's type names (NoneType) are not the user's."""
    if value is None:
        return "null"
    for types, word in ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"),
                        (Mapping, "an object"), ((list, tuple), "a list")):
        if isinstance(value, types):
            return word
    return f"a {type(value).__name__}"  # (not from a parser: a caller of the API passed it)


def _int_limit() -> int:
    return sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 0


def long_integer(text: str | bytes) -> tuple[int | None, int | None, str]:
    """What a JSON or TOML parser's ValueError for an integer literal past Python's digit
    limit (json and tomllib raise a bare ValueError) means: (line, column, message), the
    place that of the first run of that many digits outside a string (best effort: None,
    None where none is found, e.g. in bytes that are not UTF-8)."""
    limit = _int_limit()
    why = f"Python reads at most {limit}"
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", "replace")
    if limit:  # (0: no limit, and then no such error)
        strings = r"""(?:"(?:[^"\\\n]|\\.)*"|'[^'\n]*'|#[^\n]*)"""  # skipped: strings, TOML comments
        for m in re.finditer(rf"{strings}|([0-9_]{{{limit + 1},}})", text):
            if m.group(1) is not None:
                line = text.count("\n", 0, m.start()) + 1
                column = m.start() - (text.rfind("\n", 0, m.start()) + 1) + 1
                digits = len(m.group(1).replace("_", ""))
                return line, column, f"an integer of {digits} digits: {why}"
    return None, None, f"an integer of more than {limit} digits: {why}"


# A byte order mark that editors (Notepad) put before UTF-8 text: not part of the text.
BOM = "\ufeff"


def utf8_problem(error: UnicodeDecodeError) -> str:
    """Where bytes stop being UTF-8, said without the codec's wording."""
    bad = error.object[error.start:error.start + 1]
    return f"byte 0x{bad.hex()} at offset {error.start} is not UTF-8"


def read_json(text: str | bytes, what: str = "config JSON") -> Any:
    """json.loads of a user's text (AttentionConfig.from_json); whatever it cannot read
    is an InvalidArgumentError that starts with `what`."""
    if not isinstance(text, (str, bytes, bytearray)):
        raise InvalidArgumentError(f"{what} must be text (a str, or UTF-8 bytes), not {show(text)}")
    try:
        if not isinstance(text, str):  # UTF-8 only (json.loads also guesses UTF-16 and UTF-32 from bytes)
            text = bytes(text).decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidArgumentError(f"{what} is not UTF-8 text: {utf8_problem(e)}") from None
    try:
        return json.loads(text.removeprefix(BOM))
    except json.JSONDecodeError as e:
        raise InvalidArgumentError(f"{what} is not valid JSON: {e}") from None
    except RecursionError:
        raise InvalidArgumentError(f"{what} is not valid JSON: nested too deeply") from None
    except ValueError:  # json's bare ValueError: an integer past Python's digit limit
        line, column, why = long_integer(text)
        raise InvalidArgumentError(f"{what}: {why}" + (f": line {line} column {column}" if line else "")) from None


# -- validators: (field name, value, the field's metadata) -> the canonical value ----------


def check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool):
        raise bad(name, value, "must be an integer, not a bool")
    try:
        v = operator.index(value)
    except TypeError:
        raise bad(name, value, "must be an integer") from None
    if v < minimum:
        raise bad(name, value, f"must be >= {minimum}")
    if v >= INT_LIMIT:
        raise bad(name, value, "must be < 2**31")
    return v


def derived(name: str, value: int, formula: str) -> int:
    """The default of a field that follows from others (`formula`, which names them: num_pages,
    max_tokens_*), held to the limit that a value given for it is held to."""
    if value >= INT_LIMIT:
        raise InvalidArgumentError(f"{name}={int_text(value)} (its default, {formula}): must be < 2**31, as a "
                                   f"given {name}; give {name}")
    return value


def check_extent(tensor: str, shape: tuple[int, ...], strides: tuple[int, ...] | None) -> None:
    """The elements a tensor spans (from the sizes, each < 2**31, and the layout's
    strides, None: contiguous), within the int64 that cuDNN and the C config's strides
    index it with: derived values, held to a limit as given ones are."""
    elements = 1 + sum((n - 1) * s for n, s in zip(shape, strides)) if strides else math.prod(shape)
    if elements >= 2**63:
        raise InvalidArgumentError(f"tensor {tensor} of shape {shape} (from batch, heads, seqlen and head_dim) spans "
                                   f"{int_text(elements)} elements: must be < 2**63, as cuDNN indexes it in int64")


def _int(name: str, value: Any, meta: Mapping[str, Any]) -> int:
    return check_int(name, value, meta["minimum"])


def _bool(name: str, value: Any, meta: Mapping[str, Any]) -> bool:
    if isinstance(value, bool):
        return value
    # numpy.bool_ and friends, but never ints or strings: "false" must not mean True.
    if type(value).__name__ in ("bool_", "bool8"):
        return bool(value)
    raise bad(name, value, "must be True or False")


def _not_a_name(name: str, value: Any, names, choices: tuple) -> InvalidArgumentError:
    """The error for a name not taken; one that differs from a name only in case says which."""
    hint = ""
    if isinstance(value, str) and value.lower() in names:
        hint = f" (names are lowercase, exactly as written: {value.lower()!r})"
    return bad(name, value, f"must be one of {choices}{hint}")


def _choice(name: str, value: Any, meta: Mapping[str, Any]) -> str:
    if not isinstance(value, str) or value not in meta["choices"]:
        raise _not_a_name(name, value, meta["choices"], meta["choices"])
    return value


# Every name taken for a dtype -> its name (fastattn.dtypes: the name, numpy's and
# str() of the torch dtype, and the aliases of its row).
_DTYPE_ALIASES = dtypes.ALIASES


def _dtype(name: str, value: Any, meta: Mapping[str, Any]) -> str:
    # str() also accepts torch.bfloat16 and the like without importing torch; a
    # container's str() is never an alias, so lists and mappings are refused too.
    dtype = None
    if isinstance(value, str) or not isinstance(value, (bytes, bytearray, Mapping, Set, list, tuple)):
        try:
            dtype = _DTYPE_ALIASES.get(str(value))
        except Exception:  # str() of an int past Python's digit limit, or a user's type: no dtype's name
            pass
    if dtype is None or (meta["choices"] and dtype not in meta["choices"]):
        raise _not_a_name(name, value, _DTYPE_ALIASES, meta["choices"])
    return dtype


def number(name: str, value: Any) -> float:
    """A real number: an int, a float or a numpy scalar; never a bool or a string (a
    string that looks like a number is a typo in a file more often than intended)."""
    if isinstance(value, (bool, str, bytes, bytearray)):
        raise bad(name, value, "must be a number")
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        raise bad(name, value, "must be a number") from None


def float32(value: float) -> float:
    """The value cuDNN will see: scales and probabilities reach the graph as float32."""
    return struct.unpack("f", struct.pack("f", value))[0]


FLOAT32_NORMAL = 2.0**-126  # float32's smallest normal number, 1.18e-38
FLOAT32_MAX = float32(3.4028234663852886e38)


def _nonzero_float32(name: str, value: Any, v: float) -> float:
    """A nonzero value of a float kind as the float32 cuDNN gets, which must mean what
    the value means: refused where float32 makes it 0 (1e-50: dropout=1e-50 was
    accepted, and no dropout built) or infinite, or a subnormal, which GPU kernels
    that flush subnormals to zero take for 0."""
    v32 = float32(v)
    if not FLOAT32_NORMAL <= abs(v32) <= FLOAT32_MAX:
        raise bad(name, value, f"is out of float32 range (cuDNN takes float32: a nonzero value must be from "
                               f"{FLOAT32_NORMAL:.3g} to {FLOAT32_MAX:.3g})")
    return v32


def _positive(name: str, value: Any, meta: Mapping[str, Any]) -> float:
    v = number(name, value)
    if not math.isfinite(v) or v <= 0.0:
        raise bad(name, value, "must be a finite number > 0")
    return _nonzero_float32(name, value, v)


def _probability(name: str, value: Any, meta: Mapping[str, Any]) -> float:
    p = number(name, value)
    if not 0.0 <= p < 1.0 or float32(p) >= 1.0:  # 0.99999999 is 1.0 as the float32 cuDNN gets
        raise bad(name, value, "must be in [0, 1)")
    return _nonzero_float32(name, value, p) if p else 0.0  # (-0.0 is 0.0)


def pair(name: str, value: Any, meta: Mapping[str, Any] | None = None) -> tuple[int, int]:
    """(left, right) bounds, each an int >= -1 (None or -1: unbounded); a list or a
    tuple, never a mapping, a set or a string (their items are not positions)."""
    if value is None:
        return (-1, -1)
    if isinstance(value, (str, bytes, bytearray, Mapping, Set)) or not hasattr(value, "__len__") \
            or not hasattr(value, "__iter__") or len(value) != 2:
        raise bad(name, value, "must be a pair [left, right] of integers; -1 is unbounded")
    left, right = value
    return (check_int(f"{name}[0] (left)", -1 if left is None else left, -1),
            check_int(f"{name}[1] (right)", -1 if right is None else right, -1))


def _layout(name: str, value: Any, meta: Mapping[str, Any]) -> Any:
    # The strides themselves are checked against the shapes, in AttentionConfig.
    if isinstance(value, str):
        if value not in meta["choices"]:
            hint = f" (names are lowercase, exactly as written: {value.lower()!r})" \
                if value.lower() in meta["choices"] else ""
            raise bad(name, value, f"must be one of {meta['choices']} or explicit strides{hint}")
        return value
    if isinstance(value, Mapping) or (isinstance(value, (list, tuple)) and len(value) == 4):
        return value
    raise bad(name, value, f"must be one of {meta['choices']} or explicit strides {{'q': (b, h, s, d), ...}}")


VALIDATORS: dict[str, Callable[[str, Any, Mapping[str, Any]], Any]] = {
    "int": _int, "bool": _bool, "choice": _choice, "dtype": _dtype, "positive": _positive,
    "probability": _probability, "pair": pair, "layout": _layout,
}


def check(kind: str, name: str, value: Any, **meta: Any) -> Any:
    """A value of a field's kind outside a config (fastattn.torch's arguments): the same
    validator, so the same classes of values pass."""
    return VALIDATORS[kind](name, value, {"minimum": 0, "choices": (), **meta})


def check_mapping(data: Any, fields) -> None:
    """What AttentionConfig.from_dict takes: a mapping whose keys are the names of
    `fields`, the required ones among them."""
    if not isinstance(data, Mapping):
        raise bad("config", data, "must be a mapping of field names to values")
    check_names(data, fields)
    missing = [f.name for f in fields if is_required(f) and f.name not in data]
    if missing:
        raise InvalidArgumentError(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required")


def check_names(data: Mapping[str, Any], fields, also: tuple[str, ...] = ()) -> None:
    """Every key of `data` names one of `fields` (or is one of `also`, a file's own
    keys such as "configs"); the first that does not is an InvalidArgumentError naming
    it, with the name it most resembles. Checked before what is missing: a misspelt
    field ("bätch") is the cause, the required one it stands for ("batch") only its
    effect."""
    names = [f.name for f in fields]
    for name in data:
        if name in names or name in also:
            continue
        if not isinstance(name, str):
            raise InvalidArgumentError(f"config key {show(name)}: field names are strings")
        import difflib

        close = difflib.get_close_matches(name, [*names, *also], n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        whose = "AttentionConfig" + (f" nor {', '.join(repr(a) for a in also)}" if also else "")
        shown = name if name.isidentifier() else show(name)
        raise bad(shown, data[name], f"is not a field of {whose} ({hint}fields: {', '.join(names)})")


def validate(field: dataclasses.Field, value: Any) -> Any:
    """One field's value, checked and canonical; None stays None where the default
    follows from other fields."""
    if value is None and field.default is None:
        return None
    if value is None and field.metadata["kind"] == "pair":
        return pair(field.name, value)
    return VALIDATORS[field.metadata["kind"]](field.name, value, field.metadata)


# -- what is derived from the registry --------------------------------------------------


def optional_features(fields) -> dict[str, Any]:
    """Fields added after the first release, with their off values."""
    return {f.name: f.metadata["off"] for f in fields if has_off(f)}


def describe_tags(fields, config) -> list[str]:
    """The short tags of a config's fields that show (in field order)."""
    tags = []
    for f in fields:
        fn = f.metadata["describe"]
        tag = fn(config) if fn else None
        if tag:
            tags.append(tag)
    return tags


def kernel_family(fields, config) -> tuple:
    out = []
    for f in fields:
        family = f.metadata["family"]
        if family is True:
            out.append(getattr(config, f.name))
        elif family:
            out.append(family(config))
    return tuple(out)


def score_modifiers(fields, config) -> list[tuple[Callable[[Any, Any], tuple], Any]]:
    """(score, the field's value) for each field of the config that modifies the scores
    and is on (not None and not its off value), in field order."""
    out = []
    for f in fields:
        value = getattr(config, f.name)
        if f.metadata["score"] is not None and value is not None and (not has_off(f) or value != f.metadata["off"]):
            out.append((f.metadata["score"], value))
    return out


def features(fields) -> dict[str, tuple[dict[str, Any], str]]:
    """`fastattn matrix --features`: name -> (the fields it sets, what it means)."""
    out: dict[str, tuple[dict[str, Any], str]] = {"dense": ({}, "no feature")}
    for f in fields:
        if f.metadata["feature"]:
            name, settings, meaning = f.metadata["feature"]
            out[name] = (dict(settings), meaning)
    return out
