"""Config files: lists of AttentionConfigs and sweeps over their fields, in JSON or TOML.

A file holds {"configs": [entry, ...]} (TOML: [[configs]] tables), a list of entries,
an entry a line (JSON Lines, as FASTATTN_RECORD writes them: fastattn._record),
or one entry's fields at the top level (what `fastattn probe --config` reads is the
same: one reader for both commands). Each entry maps AttentionConfig fields to values;
a field may also be swept:

  a list          [1, 8]                           every value in turn
  a range         {"from": 256, "to": 4096, "step": 256}     inclusive
  a doubling      {"from": 512, "to": 8192, "times": 2}      512, 1024, ... 8192

and the entry stands for every combination (the cartesian product). `window` is a
pair, so a sweep over windows is a list of pairs. Errors name the file, the entry
(and its line in JSON files) and the field.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
from typing import Any, Mapping

from . import _fields, files
from .config import FIELDS, AttentionConfig
from .errors import InvalidArgumentError

__all__ = ["load_configs", "read_entries", "entries_in_text", "expand_entry", "builtin_configs", "describe_config",
           "MAX_CONFIGS"]

MAX_CONFIGS = 100_000  # a sweep that expands past this is almost certainly a typo
# A config file is read whole, so its size is bounded before it is read: MAX_CONFIGS
# configs as FASTATTN_RECORD writes them (~400 bytes a line) take ~40 MB; 256 MiB leaves
# room for indented JSON and comments.
MAX_FILE_BYTES = 256 << 20


def _range(where: str, spec: Mapping[str, Any]) -> list[int]:
    keys = set(spec)
    if not ({"from", "to"} <= keys and keys <= {"from", "to", "step", "times"} and len(keys & {"step", "times"}) <= 1):
        raise InvalidArgumentError(f"{where}={_fields.show(dict(spec))}: a range is {{from, to, step}} or {{from, to, times}}")
    start, stop = spec["from"], spec["to"]
    step, times = spec.get("step"), spec.get("times")
    for name, v in (("from", start), ("to", stop), ("step", step), ("times", times)):
        if (v is not None or name in ("from", "to")) and (isinstance(v, bool) or not isinstance(v, int)):
            raise InvalidArgumentError(f"{where}.{name}={_fields.show(v)}: must be an integer")
    if start > stop:
        raise InvalidArgumentError(f"{where}: from={_fields.show(start)} is greater than to={_fields.show(stop)}")
    if times is not None:
        if times < 2 or start < 1:
            raise InvalidArgumentError(f"{where}: times must be >= 2 and from >= 1")
        out, v = [], start
        while v <= stop:
            out.append(v)
            v *= times
        return out
    step = 1 if step is None else step
    if step < 1:
        raise InvalidArgumentError(f"{where}.step={_fields.show(step)}: must be >= 1")
    if (stop - start) // step + 1 > MAX_CONFIGS:
        raise InvalidArgumentError(f"{where}: the range has more than {MAX_CONFIGS} values")
    return list(range(start, stop + 1, step))


def _values(field: str, value: Any, where: str) -> list[Any]:
    """The values one field of an entry sweeps over."""
    if field == "window":  # a pair, or a list of pairs
        if isinstance(value, list) and value and all(isinstance(w, (list, tuple)) for w in value):
            return [tuple(w) for w in value]
        return [tuple(value) if isinstance(value, list) else value]
    if field == "layout":  # a name or explicit strides, or a list of those
        if isinstance(value, list) and all(isinstance(v, (str, Mapping)) for v in value):
            return value
        return [value]
    if isinstance(value, Mapping):
        return _range(f"{where}.{field}", value)
    if isinstance(value, list):
        return value
    return [value]


def _axes(entry: Any, where: str) -> list[tuple[str, list[Any]]]:
    """The fields one entry sweeps and the values of each, its sweeps' shapes checked
    (a range, an empty list); its values are checked by expanding it (_expand)."""
    if not isinstance(entry, Mapping):
        raise InvalidArgumentError(f"{where}: must be a table/object of AttentionConfig fields, got {_fields.show(entry)}")
    axes: list[tuple[str, list[Any]]] = []
    for field, value in entry.items():
        values = _values(field, value, where)
        if not values:
            raise InvalidArgumentError(f"{where}.{field}: an empty list sweeps nothing")
        axes.append((field, values))
    return axes


def _count(axes: list[tuple[str, list[Any]]], where: str) -> int:
    """How many configs an entry's axes stand for (the product of their lengths),
    counted without making any; past MAX_CONFIGS, refused."""
    total = 1
    for _, values in axes:
        total *= len(values)
    if total > MAX_CONFIGS:
        raise InvalidArgumentError(f"{where}: expands to {total} configs (more than {MAX_CONFIGS})")
    return total


def _expand(axes: list[tuple[str, list[Any]]], where: str) -> list[AttentionConfig]:
    out = []
    names = [name for name, _ in axes]
    for combo in itertools.product(*(values for _, values in axes)):
        try:
            out.append(AttentionConfig.from_dict(dict(zip(names, combo))))
        except InvalidArgumentError as e:
            raise InvalidArgumentError(f"{where}: {e}") from None
    return out


def expand_entry(entry: Mapping[str, Any], where: str = "entry") -> list[AttentionConfig]:
    """Every config one entry stands for, validated."""
    axes = _axes(entry, where)
    _count(axes, where)
    return _expand(axes, where)


def _json_entry_lines(text: str, count: int) -> list[int | None]:
    """Best effort: the line where each entry of "configs" starts, for error messages."""
    lines: list[int | None] = []
    decoder = json.JSONDecoder()
    at = text.find("[", text.find('"configs"'))
    if at < 0:
        return [None] * count
    pos, line, counted = at + 1, 1, 0
    for _ in range(count):
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        # Each character is counted once, from where the last entry's count stopped:
        # counting from the start for each entry made a file of n entries n**2 work.
        line += text.count("\n", counted, pos)
        counted = pos
        lines.append(line)
        try:
            _, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            lines.extend([None] * (count - len(lines)))
            break
    return lines


def _parse(path: str) -> tuple[Any, list[int | None] | None]:
    """A file's data: TOML when it is named .toml, JSON when named .json, JSON Lines when
    named .jsonl, else whichever of them it parses as (the error says JSON's and TOML's,
    when neither)."""
    try:
        raw = files.read_regular(path, MAX_FILE_BYTES)
    except OSError as e:
        raise InvalidArgumentError(f"{files.shown(path)}: {e.strerror}") from None
    except ValueError:  # a NUL in the name: from the API only (argv and the environment cannot hold one)
        raise InvalidArgumentError(f"{_fields.show(path)}: not a file name (it holds a NUL character)") from None
    try:
        text = raw.decode("utf-8").removeprefix(_fields.BOM)  # (a mark editors put first, not text)
    except UnicodeDecodeError as e:
        raise InvalidArgumentError(f"{files.shown(path)}: not UTF-8 text: {_fields.utf8_problem(e)}") from None
    if path.endswith(".toml"):
        return _toml(text, path), None
    if path.endswith(".jsonl"):
        return _json_lines(text, path)
    try:
        return _json(text, path)
    except InvalidArgumentError as json_error:
        if path.endswith(".json"):
            raise
        if _looks_like_json_lines(text):
            return _json_lines(text, path)
        try:
            return _toml(text, path), None
        except InvalidArgumentError as toml_error:
            raise InvalidArgumentError(f"{json_error} (read as JSON); {toml_error} (read as TOML)") from None


def _toml(text: str, path: str) -> Any:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        # "(at line 2, column 5)" or "(at end of document)" ends tomllib's message: put
        # the place where JSON's errors have it.
        msg, where = str(e), files.shown(path)
        m = re.search(r"\s*\(at line (\d+), column (\d+)\)$", msg)
        if m:
            msg, where = msg[:m.start()], f"{files.shown(path)}:{m[1]}:{m[2]}"
        elif msg.endswith("(at end of document)"):
            msg, where = msg[:-len("(at end of document)")].rstrip(), f"{files.shown(path)}:{text.count(chr(10)) + 1}"
        raise InvalidArgumentError(f"{where}: not valid TOML: {msg}") from None
    except ValueError:  # tomllib's bare ValueError: an integer past Python's digit limit
        raise _too_long(path, text, "TOML") from None
    except RecursionError:
        raise InvalidArgumentError(f"{files.shown(path)}: not valid TOML: nested too deeply") from None


def _json(text: str, path: str) -> tuple[Any, list[int | None]]:
    try:
        data = json.loads(text.removeprefix(_fields.BOM))
    except json.JSONDecodeError as e:
        raise InvalidArgumentError(f"{files.shown(path)}:{e.lineno}:{e.colno}: not valid JSON: {e.msg}") from None
    except ValueError:  # json's bare ValueError: an integer past Python's digit limit
        raise _too_long(path, text, "JSON") from None
    except RecursionError:
        raise InvalidArgumentError(f"{files.shown(path)}: not valid JSON: nested too deeply") from None
    count = len(data.get("configs", [])) if isinstance(data, dict) and isinstance(data.get("configs"), list) else 0
    return data, _json_entry_lines(text, count)


def _too_long(path: str, text: str, what: str, first_line: int = 1) -> InvalidArgumentError:
    """The error for an integer literal past Python's digit limit, at its place."""
    line, column, why = _fields.long_integer(text)
    where = f"{files.shown(path)}:{line + first_line - 1}:{column}" if line else files.shown(path)
    return InvalidArgumentError(f"{where}: not valid {what}: {why}")


def _looks_like_json_lines(text: str) -> bool:
    """Every line that is not blank opens a JSON object, and there are two or more:
    what FASTATTN_RECORD writes (fastattn._record), under any name."""
    lines = [line for line in text.splitlines() if line.strip()]
    return len(lines) > 1 and all(line.lstrip().startswith("{") for line in lines)


def _json_lines(text: str, path: str) -> tuple[list[Any], list[int | None]]:
    """JSON Lines: a JSON object (an entry) on each line that is not blank."""
    entries: list[Any] = []
    lines: list[int | None] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            raise InvalidArgumentError(f"{files.shown(path)}:{number}:{e.colno}: not valid JSON: {e.msg}") from None
        except ValueError:  # an integer past Python's digit limit
            raise _too_long(path, line, "JSON", number) from None
        except RecursionError:
            raise InvalidArgumentError(f"{files.shown(path)}:{number}: not valid JSON: nested too deeply") from None
        if not isinstance(entry, dict):
            raise InvalidArgumentError(f"{files.shown(path)}:{number}: each line must be an object of AttentionConfig fields, "
                                       f"not {_fields.json_kind(entry)}")
        entries.append(entry)
        lines.append(number)
    return entries, lines


_FIELD_NAMES = frozenset(f.name for f in FIELDS)


def _entries(data: Any, path: str) -> list[Any]:
    """The entries of a parsed document: its "configs" list, the list itself, or the
    document as one entry when its keys are AttentionConfig fields."""
    if isinstance(data, list):
        return data
    if isinstance(data, dict) and "configs" in data:
        if not isinstance(data["configs"], list):
            raise InvalidArgumentError(f"{files.shown(path)}: \"configs\" must be a list (TOML: [[configs]] tables)")
        unknown = sorted(set(data) - {"configs"})
        if unknown:
            raise InvalidArgumentError(f"{files.shown(path)}: unknown top-level key {_fields.show(unknown[0])}")
        return data["configs"]
    if not isinstance(data, dict):
        raise InvalidArgumentError(f"{files.shown(path)}: must be an object of AttentionConfig fields, or a \"configs\" list of "
                                   f"them, not {_fields.json_kind(data)}")
    if not data or set(data) & _FIELD_NAMES:
        return [data]  # one config's fields (unknown ones are named by expand_entry)
    try:  # no key is a field: the first is named, as a field of the config or the file's "configs"
        _fields.check_names(data, FIELDS, also=("configs",))
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"{files.shown(path)}: {e}; a file holds a top-level \"configs\" list (TOML: [[configs]] "
                                   "tables), or one config's fields") from None
    raise AssertionError("unreachable: a key that is no field was found above")  # pragma: no cover


def read_entries(path: str) -> tuple[list[Any], list[str]]:
    """The entries a JSON or TOML config file holds, not yet expanded, and where each
    is ("file:line: configs[i]" in error messages)."""
    data, lines = _parse(path)
    entries = _entries(data, path)
    if isinstance(data, dict) and "configs" not in data:  # one config's fields: the file is the place
        return entries, [files.shown(path)]
    where = []
    for i in range(len(entries)):
        line = lines[i] if lines and i < len(lines) else None
        where.append(f"{files.shown(path)}:{line}: configs[{i}]" if line else f"{files.shown(path)}: configs[{i}]")
    return entries, where


def entries_in_text(text: str, name: str) -> tuple[list[Any], list[str]]:
    """read_entries for JSON given as text (`fastattn probe --config '{...}'`); `name`
    stands for the file in messages."""
    data, _ = _json(text, name)
    entries = _entries(data, name)
    if isinstance(data, dict) and "configs" not in data:
        return entries, [name]
    return entries, [f"{name}: configs[{i}]" for i in range(len(entries))]


def load_configs(path: str) -> list[AttentionConfig]:
    """The configs a JSON (.json) or TOML (.toml) file describes, sweeps expanded,
    duplicates dropped, in file order. A file that describes more than MAX_CONFIGS
    (counted before any is made, duplicates included) is refused before any is made."""
    entries, where = read_entries(path)
    axes, total = [], 0
    for entry, at in zip(entries, where):
        axes.append(_axes(entry, at))
        total += _count(axes[-1], at)
        if total > MAX_CONFIGS:
            raise InvalidArgumentError(f"{files.shown(path)}: describes more than {MAX_CONFIGS} configs (counted up to {at}, "
                                       "duplicates included): split it into files of fewer")
    out: dict[AttentionConfig, None] = {}
    for entry_axes, at in zip(axes, where):
        for cfg in _expand(entry_axes, at):
            out.setdefault(cfg, None)
    return list(out)


# Attention shapes of widely used open models: (name, heads_q, heads_kv, head_dim_qk, head_dim_v).
BUILTIN_MODELS = (
    ("llama-3-8b / mistral-7b / mixtral-8x7b", 32, 8, 128, 128),
    ("llama-3-70b / qwen2.5-72b", 64, 8, 128, 128),
    ("qwen2.5-7b", 28, 4, 128, 128),
    ("qwen2.5-32b", 40, 8, 128, 128),
    ("gemma-2-9b", 16, 8, 256, 256),
    ("phi-3-mini", 32, 32, 96, 96),
    ("gpt-2 / bert-base", 12, 12, 64, 64),
    ("deepseek-v2-lite (mla, no rope split)", 16, 16, 192, 128),
)
BUILTIN_SEQLENS = (512, 1024, 2048, 4096, 8192)
# FP8 (e4m3 in and out) rows: the two most deployed shapes above, which FP8 inference
# servers and FP8 training runs use; cuDNN's FP8 kernels are a kernel family of their own.
BUILTIN_FP8_MODELS = BUILTIN_MODELS[:2]


def builtin_configs() -> list[AttentionConfig]:
    """The set `fastattn warm` uses with no file: causal bf16 prefill (batch 1) of the
    models above over typical sequence lengths, inference and training; then the same
    in fp8_e4m3 for BUILTIN_FP8_MODELS."""
    out = []
    rows = [(m, "bf16") for m in BUILTIN_MODELS] + [(m, "fp8_e4m3") for m in BUILTIN_FP8_MODELS]
    for (_, hq, hkv, dqk, dv), dtype in rows:
        for s, training in itertools.product(BUILTIN_SEQLENS, (False, True)):
            out.append(AttentionConfig(batch=1, heads_q=hq, heads_kv=hkv, seqlen_q=s, head_dim_qk=dqk, head_dim_v=dv,
                                       dtype=dtype, mask="causal", training=training))
    return out


def describe_config(cfg: AttentionConfig) -> str:
    """One short line for tables and progress: the sizes, then each field's tag (the
    field registry's `describe`, in field order)."""
    heads = f"{cfg.heads_q}/{cfg.heads_kv}h" if cfg.heads_kv != cfg.heads_q else f"{cfg.heads_q}h"
    dims = f"d{cfg.head_dim_qk}" + (f"/{cfg.head_dim_v}" if cfg.head_dim_v != cfg.head_dim_qk else "")
    seq = f"s{cfg.seqlen_q}" + (f"/{cfg.seqlen_kv}" if cfg.seqlen_kv != cfg.seqlen_q else "")
    return f"b{cfg.batch} {heads} {seq} {dims} " + " ".join(_fields.describe_tags(FIELDS, cfg))
