"""The field registry and its one validation path: every way to make a config (the
constructor, from_dict, from_json, warm files, the CLI, fastattn.torch) refuses the same
classes of values, naming the field; what is derived from the registry matches it."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastattn import _fields, config_files
from fastattn.cli.matrix import MATRIX_FEATURES
from fastattn.config import _OPTIONAL_FEATURES, FIELDS, AttentionConfig
from fastattn.errors import InvalidArgumentError
from fastattn.warm import kernel_family

BASE = {"batch": 1, "heads_q": 8, "seqlen_q": 128, "head_dim_qk": 64}


def every_path(field: str, value):
    """The ways a user's value reaches a config; each must refuse it the same way."""
    yield lambda: AttentionConfig(**BASE, **{field: value})
    yield lambda: AttentionConfig.from_dict({**BASE, field: value})
    try:
        text = json.dumps({**BASE, field: value})
    except (TypeError, ValueError):
        return  # not JSON-able: only Python callers can pass it
    yield lambda: AttentionConfig.from_json(text)
    if not isinstance(value, (list, dict)):  # in a warm file, those are sweeps
        yield lambda: config_files.expand_entry({**BASE, field: value}, "w.json: configs[0]")


# -- defect 1: a window as an object ---------------------------------------------------


@pytest.mark.parametrize("window", [{"left": 16, "right": 0}, {0: 5, 1: 0}, {"0": 5, "1": 0}, {16, 0},
                                    frozenset({1, 2}), "16,0", b"ab", 5, (1, 2, 3)])
def test_a_window_is_a_pair_never_a_mapping_set_or_string(window):
    for make in every_path("window", window):
        with pytest.raises(InvalidArgumentError, match=r"window"):
            make()


def test_window_object_in_the_cli_is_bad_input(capsys):
    from fastattn import cli

    cfg = json.dumps({**BASE, "window": {"left": 16, "right": 0}})
    assert cli.main(["probe", "--config", cfg]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "window=" in err and "must be a pair" in err and "Traceback" not in err


def test_window_pairs_still_accepted():
    for w in ((16, 0), [16, 0], (None, 4), range(3, 5)):
        AttentionConfig(**BASE, window=w)
    assert AttentionConfig.from_json(json.dumps({**BASE, "window": [16, 0]})).window == (16, 0)


# -- defect 11 and its class: numbers are never strings, bools never ints ----------------


@pytest.mark.parametrize("field,value", [("scale", "0.1"), ("dropout", "0.1"), ("scale", b"1"), ("dropout", True),
                                         ("scale", True), ("scale", [0.1]), ("dropout", {"p": 0.1})])
def test_numbers_refuse_strings_bools_and_containers(field, value):
    for make in every_path(field, value):
        with pytest.raises(InvalidArgumentError, match=rf"^(w\.json: configs\[0\]: )?{field}="):
            make()


_WRONG = {
    "int": [True, 1.5, "8", None, [8]],
    "bool": [1, 0, "true", None, [True]],
    "choice": [1, None, ["none"], b"none"],
    "dtype": [1, None, ["bf16"], b"bf16", {"bf16": 1}],
    "positive": ["0.5", True, [1.0], float("nan"), 0, -1],
    "probability": ["0.1", True, [0.1], float("nan"), 1.0, -0.1, 0.99999999],  # the last is 1.0 in float32
    "pair": [{"left": 1, "right": 0}, "1,0", (1,), 5, {1, 0}],
    "layout": [1, None, "bsdh", (1, 2, 3)],
}


def test_every_field_of_a_kind_refuses_the_same_classes():
    # The validators are per kind, so this is a statement about classes, not instances.
    required = [f.name for f in FIELDS if _fields.is_required(f)]
    assert required == ["batch", "heads_q", "seqlen_q", "head_dim_qk"]
    for f in FIELDS:
        for value in _WRONG[f.metadata["kind"]]:
            if value is None and f.default is None:
                continue  # None is this field's "follow the others"
            with pytest.raises(InvalidArgumentError, match=rf"^{f.name}"):
                AttentionConfig.from_dict({**BASE, f.name: value})


def test_from_dict_refuses_keys_that_are_not_strings():
    with pytest.raises(InvalidArgumentError, match="config key 1: field names are strings"):
        AttentionConfig.from_dict({**BASE, 1: 2})
    with pytest.raises(InvalidArgumentError, match="^batch, heads_q are required"):
        AttentionConfig.from_dict({"seqlen_q": 1, "head_dim_qk": 64})


@pytest.mark.parametrize("text", [b"\xff\xfe", "[" * 100_000, 42, None])
def test_from_json_refuses_anything_but_json_text_of_an_object(text):
    with pytest.raises(InvalidArgumentError):
        AttentionConfig.from_json(text)


# -- the registry and what is derived from it --------------------------------------------


def test_optional_features_are_the_fields_marked_off():
    assert _OPTIONAL_FEATURES == {"padding": False, "alibi": False, "ragged": False, "bias": "none",
                                  "bias_grad": False, "dropout": 0.0, "host_seed": False, "sinks": False,
                                  "page_size": 0, "alignment": "top_left", "softcap": None,
                                  "shape_override": False}


def _old_kernel_family(config):  # fastattn.warm's hand-written tuple before the registry, as a reference
    return (config.dtype, config.head_dim_qk, config.head_dim_v, config.mask, config.window, config.training,
            config.deterministic, config.padding, config.ragged, config.alibi, config.bias.replace("b", "1", 1),
            config.bias_grad, config.dropout > 0, config.sinks, config.page_size > 0)


_VARIANTS = [dict(), dict(dtype="fp16"), dict(head_dim_qk=128), dict(head_dim_v=32), dict(mask="causal"),
             dict(window=(16, 16)), dict(training=True), dict(training=True, deterministic=True),
             dict(padding=True), dict(padding=True, ragged=True), dict(alibi=True), dict(bias="1hss"),
             dict(bias="bhss"), dict(bias="1hss", training=True, bias_grad=True), dict(dropout=0.1),
             dict(dropout=0.3, host_seed=True), dict(sinks=True), dict(padding=True, page_size=64),
             dict(batch=4, seqlen_q=256, heads_q=16, heads_kv=4, scale=0.3, layout="sbhd")]


def test_kernel_family_groups_as_the_hand_written_one_did():
    configs = [AttentionConfig(**{**BASE, **v}) for v in _VARIANTS]
    for a in configs:
        for b in configs:
            assert (kernel_family(a) == kernel_family(b)) == (_old_kernel_family(a) == _old_kernel_family(b))


def test_describe_shows_each_feature_once():
    text = config_files.describe_config(AttentionConfig(**BASE, mask="causal", window=(16, 0), training=True,
                                                 deterministic=True, padding=True, ragged=True, alibi=True,
                                                 bias="1hss", bias_grad=True, dropout=0.25, sinks=True))
    assert text == "b1 8h s128 d64 bf16 causal win16,-1 train/det padded alibi packed bias1hss/grad drop0.25 sinks"
    assert config_files.describe_config(AttentionConfig(**BASE, padding=True, page_size=64)).endswith("padded paged64x2")
    assert config_files.describe_config(AttentionConfig(**BASE, layout="bhsd")) == "b1 8h s128 d64 bf16 bhsd none"


def test_every_field_has_a_probe_flag_and_help():
    from fastattn.cli._main import build_parser

    probe = build_parser()._subparsers._group_actions[0].choices["probe"]
    dests = {a.dest for a in probe._actions}
    for f in FIELDS:
        assert f.name in dests and f.metadata["help"]


def test_matrix_features_come_from_the_registry_and_are_valid():
    assert set(MATRIX_FEATURES) == {"dense", "padding", "ragged", "paged", "bias", "bias_grad", "alibi", "dropout",
                                    "sinks", "window_br", "softcap"}
    for name, (settings_, _) in MATRIX_FEATURES.items():
        training = name == "bias_grad"
        AttentionConfig(**BASE, training=training, **settings_)


def test_a_field_kind_without_a_validator_is_refused_at_definition():
    with pytest.raises(ValueError, match="unknown field kind"):
        _fields.spec("complex", help="x", cxx=_fields.Cxx("int64_t", "0"))


# -- property: generated values through every path -------------------------------------

_json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**33, 2**33) | st.floats(allow_nan=True)
                            | st.text(max_size=8),
                            lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                         max_size=4),
                            max_leaves=8)
_field_names = st.sampled_from([f.name for f in FIELDS] + ["seq_len", ""])
_plausible = st.fixed_dictionaries({}, optional={
    "batch": st.integers(0, 4), "heads_q": st.sampled_from([1, 2, 8]), "heads_kv": st.sampled_from([None, 1, 2, 3]),
    "seqlen_q": st.integers(0, 300), "seqlen_kv": st.sampled_from([None, 1, 64, 300]),
    "head_dim_qk": st.sampled_from([64, 128]), "head_dim_v": st.sampled_from([None, 64]),
    "dtype": st.sampled_from(["bf16", "fp16", "half", "fp32"]), "layout": st.sampled_from(["bshd", "bhsd", "x"]),
    "mask": st.sampled_from(["none", "causal", "causal_bottom_right"]),
    "window": st.sampled_from([None, [-1, -1], [16, 0], [4, 4], [0, 5], {"left": 1}]),
    "scale": st.sampled_from([None, 0.1, 1.0, "0.1", 0]), "training": st.booleans(),
    "deterministic": st.booleans(), "padding": st.booleans(), "alibi": st.booleans(), "ragged": st.booleans(),
    "max_tokens_q": st.sampled_from([None, 0, 1, 100]), "bias": st.sampled_from(["none", "1hss", "bhss"]),
    "bias_grad": st.booleans(), "dropout": st.sampled_from([0.0, 0.1, 0.99, 1.0]), "host_seed": st.booleans(),
    "sinks": st.booleans(), "page_size": st.sampled_from([0, 16, 64]), "num_pages": st.sampled_from([None, 0, 3]),
})


def _round_trips(cfg: AttentionConfig) -> None:
    text = cfg.to_json()
    back = AttentionConfig.from_json(text)
    assert back == cfg and back.to_json() == text and hash(back) == hash(cfg)
    assert AttentionConfig.from_dict(cfg.to_dict()) == cfg


@settings(max_examples=300, deadline=None, derandomize=True)
@given(_plausible, st.dictionaries(_field_names, _json_values, max_size=3))
def test_generated_configs_are_invalid_argument_or_round_trip(plausible, noise):
    data = {**BASE, **plausible, **noise}
    makers = [lambda: AttentionConfig.from_dict(data), lambda: AttentionConfig.from_json(json.dumps(data))]
    if set(data) <= {f.name for f in FIELDS}:  # the constructor takes fields (others: Python's TypeError)
        makers.append(lambda: AttentionConfig(**data))
    for make in makers:
        try:
            cfg = make()
        except InvalidArgumentError:
            continue
        _round_trips(cfg)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.one_of(_json_values, st.text(max_size=40), st.binary(max_size=20)))
def test_from_json_of_anything(value):
    text = value if isinstance(value, (str, bytes)) else json.dumps(value)
    try:
        cfg = AttentionConfig.from_json(text)
    except InvalidArgumentError:
        return
    _round_trips(cfg)



@pytest.mark.parametrize("options,match", [
    (dict(window={"left": 16, "right": 0}), r"^window="), (dict(window={0: 5, 1: 0}), r"^window="),
    (dict(scale="0.1"), r"^scale="), (dict(scale=True), r"^scale="), (dict(causal="false"), r"^causal="),
    (dict(deterministic=1), r"^deterministic="), (dict(alibi="yes"), r"^alibi="),
    (dict(dropout_p="0.1"), r"^dropout_p="), (dict(dropout_p=float("nan")), r"^dropout_p="),
])
def test_fastattn_torch_reaches_the_same_validators(options, match):
    torch = pytest.importorskip("torch", reason="PyTorch is an optional extra")
    from fastattn.torch import attention

    q = torch.empty((2, 128, 8, 64), device="meta", dtype=torch.bfloat16)
    with pytest.raises(InvalidArgumentError, match=match):
        attention(q, q, q, **options)


def test_a_score_modifier_is_on_only_when_its_field_is():
    base = dict(batch=1, heads_q=2, seqlen_q=16, head_dim_qk=64)
    assert _fields.score_modifiers(FIELDS, AttentionConfig(**base)) == []
    [(score, value)] = _fields.score_modifiers(FIELDS, AttentionConfig(**base, softcap=30.0))
    assert value == 30.0


@settings(max_examples=50, deadline=None)
@given(cap=st.floats(0.05, 1e4), s=st.lists(st.floats(-1e5, 1e5), min_size=1, max_size=8))
def test_the_registrys_score_modifiers_are_what_their_help_says_with_their_derivative(cap, s):
    # The reference (fastattn.verify) runs each field's `score`: softcap's must be
    # cap * tanh(s / cap), and its second value the derivative in s (the backward's chain
    # rule), checked against a central difference in float64.
    import torch

    [(score, _)] = _fields.score_modifiers(FIELDS, AttentionConfig(batch=1, heads_q=2, seqlen_q=16, head_dim_qk=64,
                                                                   softcap=cap))
    x = torch.tensor(s, dtype=torch.float64)
    out, derivative = score(cap, x)
    assert torch.allclose(out, cap * torch.tanh(x / cap), rtol=1e-12, atol=0)
    h = 1e-6 * torch.clamp(x.abs(), min=1.0)
    numeric = (score(cap, x + h)[0] - score(cap, x - h)[0]) / (2 * h)
    assert torch.allclose(derivative, numeric, rtol=1e-5, atol=1e-9)
