"""Warm files are user input: generated files, JSON or TOML, named or not, give configs
or an InvalidArgumentError naming the file, never another exception."""

from __future__ import annotations

import json
import os
import tempfile

from hypothesis import given, settings
from hypothesis import strategies as st

from fastattn import config_files
from fastattn.config import FIELDS, AttentionConfig
from fastattn.errors import InvalidArgumentError

_scalars = st.none() | st.booleans() | st.integers(-3, 300) | st.floats(allow_nan=True) | st.sampled_from(
    ["bf16", "causal", "1hss", "bshd", "", "0.1"])
_values = st.one_of(
    _scalars, st.lists(_scalars, max_size=3),
    st.fixed_dictionaries({"from": st.integers(-2, 300), "to": st.integers(-2, 4096)},
                          optional={"step": st.integers(-1, 512), "times": st.integers(-1, 4), "by": st.just(1)}),
    st.dictionaries(st.text(max_size=4), _scalars, max_size=2))
_entry = st.dictionaries(st.sampled_from([f.name for f in FIELDS] + ["seq_len"]), _values, max_size=6).map(
    lambda e: {"batch": 1, "heads_q": 8, "seqlen_q": 64, "head_dim_qk": 64, **e})
_document = st.one_of(
    st.fixed_dictionaries({"configs": st.lists(_entry, max_size=3)}),
    st.lists(_entry, max_size=2),
    st.dictionaries(st.sampled_from(["configs", "other"]), _values, max_size=2))


def _toml(doc) -> str | None:
    """A TOML rendering of the document when there is a simple one (else None)."""
    if not isinstance(doc, dict) or set(doc) != {"configs"} or not isinstance(doc["configs"], list) \
            or not doc["configs"]:
        return None
    lines = []
    for entry in doc["configs"]:
        lines.append("[[configs]]")
        for k, v in entry.items():
            if v is None or (isinstance(v, float) and v != v) or isinstance(v, dict) and any(
                    not isinstance(x, (int, str)) for x in v.values()):
                return None
            if isinstance(v, list) and any(x is None or (isinstance(x, float) and x != x) for x in v):
                return None
            lines.append(f"{k} = {json.dumps(v).replace(': ', ' = ') if not isinstance(v, dict) else _inline(v)}")
    return "\n".join(lines) + "\n"


def _inline(d: dict) -> str:
    return "{ " + ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in d.items()) + " }"


def _load(name: str, data: bytes):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, name)
        with open(path, "wb") as f:
            f.write(data)
        try:
            configs = config_files.load_configs(path)
        except InvalidArgumentError as e:
            assert name in str(e)
            return None
        assert all(isinstance(c, AttentionConfig) for c in configs)
        return configs


@settings(max_examples=150, deadline=None, derandomize=True)
@given(_document, st.sampled_from(["w.json", "w.toml", "w.conf", "w"]))
def test_generated_documents(doc, name):
    text = json.dumps(doc) if not name.endswith(".toml") else _toml(doc)
    if text is None:
        return
    configs = _load(name, text.encode())
    if configs is not None and name != "w.toml":  # JSON and TOML of one document read the same
        toml = _toml(doc)
        if toml is not None:
            assert _load("w.toml", toml.encode()) == configs


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode),
       st.sampled_from(["w.json", "w.toml", "w.conf"]))
def test_generated_bytes(data, name):
    _load(name, data)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.integers(0, 400), st.sampled_from(["w.json", "w.toml"]))
def test_truncated_files(cut, name):
    doc = {"configs": [{"batch": 1, "heads_q": 8, "seqlen_q": {"from": 64, "to": 256, "times": 2},
                        "head_dim_qk": [64, 128], "window": [[16, 0], [-1, -1]], "mask": "causal"}]}
    text = json.dumps(doc) if name.endswith(".json") else (
        '[[configs]]\nbatch = 1\nheads_q = 8\nseqlen_q = { from = 64, to = 256, times = 2 }\n'
        'head_dim_qk = [64, 128]\nwindow = [[16, 0], [-1, -1]]\nmask = "causal"\n')
    full = _load(name, text.encode())
    assert full is not None and len(full) == 12
    _load(name, text.encode()[:cut])
