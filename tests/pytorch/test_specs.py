"""The ops' specs (fastattn/torch/_specs.py), without a GPU: each spec's options agree
with the field registry (kinds, docs, off values) and their off values round-trip to the
config's and to the C++ core's."""

import dataclasses

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

from fastattn import AttentionConfig  # noqa: E402
from fastattn._fields import has_off  # noqa: E402
from fastattn.config import FIELDS  # noqa: E402
from fastattn.torch import _options, _specs  # noqa: E402

REGISTRY = {f.name: f for f in FIELDS}


# -- options and the registry --------------------------------------------------------------------

def registry_off(option: _specs.Option):
    """What the option's field is when the feature is off: its off value, else its default."""
    f = REGISTRY[option.field]
    return f.metadata["off"] if has_off(f) else f.default


@pytest.mark.parametrize("op", [*_specs.SPECS, "fp8"])
def test_every_option_is_its_registry_fields(op):
    kinds = {"bool": "bool", "int": "int", "positive": "float", "probability": "float", "pair": "int",
             "layout": "str", "choice": "str", "dtype": "str"}
    for o in _specs.options_of(op):
        f = REGISTRY[o.field]
        meta = f.metadata
        if o.name in ("causal", "bottom_right"):  # the flags that stand for the mask and the alignment
            assert (o.field, o.kind, o.off) == ({"causal": "mask", "bottom_right": "alignment"}[o.name], "bool", False)
            continue
        assert o.kind == kinds[meta["kind"]], o.name
        if meta["kind"] == "pair":  # a pair's options are its C++ members
            assert o.name in meta["cxx"].names
        if o.kind == "str":
            assert o.choices == tuple(meta["choices"]), o.name
        if o.name == o.field:
            assert o.doc == meta["help"], o.name
        value = registry_off(o)
        if meta["kind"] == "pair":
            value = value[meta["cxx"].names.index(o.name)]
        if value is not dataclasses.MISSING:
            assert o.off == ({"bool": False, "int": 0, "float": 0.0, "str": ""}[o.kind] if value is None else value)


def test_the_op_librarys_options_are_the_specs_in_their_kind_order():
    assert _options.OPS == {name: s.options for name, s in _specs.SPECS.items()}
    header = _options.cpp_header()
    for spec in _specs.SPECS.values():
        for o in spec.options:  # each member, initialized to its off value
            assert f" {o.name}{_specs.cpp_initializer(o)};  // {_specs.describe(o)}" in header
    assert "int64_t window_left = -1;" in header and "double softcap{};" in header


def _all_off(op: str):
    cls = _specs.named_tuple(op, "Options")
    values = {o.name: o.off for o in _specs.options_of(op)}
    values.update(layout="bshd", max_q=64, max_kv=64)
    return cls(**{n: values[n] for n in cls._fields})


@pytest.mark.parametrize("op", list(_specs.SPECS))
def test_the_off_value_of_every_option_round_trips_to_the_configs_off(op):
    fields = _specs.config_fields(_all_off(op))
    for o in _specs.options_of(op):
        if o.name in ("layout", "max_q", "max_kv"):  # the tensors' strides; a packed plan's lengths
            continue
        expected = registry_off(o)
        if o.field == "deterministic":
            expected = False
        assert fields[o.field] == expected, o.name
    # Off options leave the config, so its cache key, as a config made without them.
    base = dict(batch=2, heads_q=4, seqlen_q=64, seqlen_kv=64, head_dim_qk=64)
    given = {k: v for k, v in fields.items() if k not in ("seqlen_q", "seqlen_kv")}
    assert AttentionConfig(**base, **given).to_json() == AttentionConfig(**base).to_json()


@pytest.mark.parametrize("op", list(_specs.SPECS))
def test_an_off_option_is_the_value_the_cxx_core_holds_for_the_off_field(op):
    # One spelling of "off": an option that is a member of the core's Config holds what
    # the core holds when the field is off (softcap 0.0 for None, the window's -1s).
    _core = pytest.importorskip("fastattn._core", reason="the extension is not built")
    fields = _specs.config_fields(_all_off(op))
    cfg = AttentionConfig(batch=2, heads_q=4, seqlen_q=64, seqlen_kv=64, head_dim_qk=64,
                          **{k: v for k, v in fields.items() if k not in ("seqlen_q", "seqlen_kv")})
    members = _core._config_fields(cfg)
    checked = 0
    for o in _specs.options_of(op):
        f = REGISTRY[o.field]
        if o.name in members and (has_off(f) or f.default is not None):  # (scale's None the config resolves)
            assert members[o.name] == o.off, o.name
            checked += 1
    assert checked >= 4


@pytest.mark.parametrize("op", list(_specs.SPECS))
def test_config_fields_reads_each_options_value_back(op):
    # Not only the off values: a value given becomes the field's (the zero that stands for
    # None aside), so the conversion is one way to spell the same config.
    opts = _all_off(op)
    for o in _specs.options_of(op):
        if o.kind != "float" or o.name not in ("scale", "softcap", "dropout"):
            continue
        assert _specs.config_fields(opts._replace(**{o.name: 0.25}))[o.field] == 0.25
