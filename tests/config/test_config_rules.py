"""AttentionConfig refuses what its documentation calls invalid, with an
error naming the field and the value; choice fields follow one rule; a feature's
tensor is asked only of a config that has the feature. Valid configs keep their exact
canonical form (the golden keys: tests/store/test_store.py, tests/config/test_alignment_bias.py).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastattn import AttentionConfig, InvalidArgumentError
from fastattn.config import FIELD_NAMES, FIELDS, FP8_SCALARS

BASE = dict(batch=2, heads_q=8, seqlen_q=128, seqlen_kv=256, head_dim_qk=64)


def cfg(**kw) -> AttentionConfig:
    return AttentionConfig(**{**BASE, **kw})


# -- a paged KV cache needs padding ----------------------------------------------------------------


def test_a_paged_kv_cache_needs_padding():
    with pytest.raises(InvalidArgumentError, match=r"^page_size=64: a paged KV cache needs padding=True"):
        cfg(page_size=64)
    assert cfg(page_size=64, padding=True).page_size == 64


# -- the diagonal's position is stated once ----------------------------------------------------------


def test_a_bottom_right_mask_refuses_a_top_left_alignment():
    # Was stored as the bottom-right mask: the alignment asked for was dropped silently.
    with pytest.raises(InvalidArgumentError, match=r"^alignment='top_left': mask='causal_bottom_right' puts"):
        cfg(mask="causal_bottom_right", alignment="top_left")
    plain = cfg(mask="causal_bottom_right")
    assert cfg(mask="causal_bottom_right", alignment="bottom_right") == plain
    assert cfg(mask="causal_bottom_right", alignment=None) == plain
    assert cfg(mask="causal", alignment="bottom_right") == plain
    assert cfg(mask="causal", alignment="top_left").mask == "causal"


def test_replace_moves_the_diagonal_with_the_mask():
    # replace() passes every field again: an alignment left at its default follows the
    # mask rather than contradicting it.
    bottom = cfg(mask="causal_bottom_right")
    assert bottom.replace(window=(64, -1)).window == (64, -1)
    assert bottom.replace(mask="causal").mask == "causal"
    assert cfg(mask="causal", alignment="top_left").replace(mask="causal_bottom_right") == bottom
    windowed = cfg(window=(16, 8), alignment="bottom_right")
    assert windowed.replace(window=(16, 0)).mask == "causal_bottom_right"
    assert windowed.replace(batch=3).alignment == "bottom_right"


# -- one rule for every choice field --------------------------------------------------------------------

_CHOICE_FIELDS = [f for f in FIELDS if f.metadata["kind"] in ("choice", "dtype", "layout")]
_DTYPE_SPELLINGS = ["fp16", "float16", "half", "bf16", "bfloat16", "torch.bfloat16", "torch.float16", "fp8_e4m3",
                    "float8_e4m3fn", "e5m2"]


def _valid_with(field: str, name: str) -> dict:
    extra = {"bias": {}, "alignment": {"window": (16, 8)}, "mask": {}, "layout": {}}.get(field, {})
    if field in ("out_dtype", "grad_dtype"):
        extra = {"dtype": "fp8_e4m3", "training": True}
    return {**extra, field: name}


@pytest.mark.parametrize("field", [f.name for f in _CHOICE_FIELDS])
def test_every_choice_field_takes_its_names_exactly_as_written(field):
    # dtype took any case ("BF16") while mask, layout and bias took none ("Causal" refused).
    names = _DTYPE_SPELLINGS if field == "dtype" else list({f.name: f for f in _CHOICE_FIELDS}[field].metadata["choices"])
    for name in names:
        cfg(**_valid_with(field, name))  # as written: taken
        for other in {name.upper(), name.title(), name.capitalize()} - {name}:
            with pytest.raises(InvalidArgumentError, match=rf"^{field}={other!r}: must be one of .*lowercase"):
                cfg(**_valid_with(field, other))


# -- a feature's tensors belong to configs with the feature ------------------------------------------

_FEATURE_TENSORS = {
    "bias": dict(bias="1hss"), "d_bias": dict(bias="1hss"), "sink": dict(sinks=True), "d_sink": dict(sinks=True),
    "seq_len_q": dict(padding=True), "seq_len_kv": dict(padding=True), "ragged_q": dict(padding=True, ragged=True),
    "ragged_stats": dict(padding=True, ragged=True), "cu_seqlens_kv": dict(padding=True, ragged=True),
    "seed": dict(dropout=0.1), "offset": dict(dropout=0.1), "page_table_k": dict(padding=True, page_size=64),
    "page_table_v": dict(padding=True, page_size=64), "descale_q": dict(dtype="fp8_e4m3"),
    "amax_o": dict(dtype="fp8_e4m3"),
}


@pytest.mark.parametrize("tensor", sorted(_FEATURE_TENSORS))
def test_a_features_tensor_is_asked_only_of_a_config_with_the_feature(tensor):
    with_it = cfg(**_FEATURE_TENSORS[tensor])
    assert with_it.shape(tensor) and with_it.strides(tensor) and with_it.dtype_of(tensor)
    plain = cfg()
    for ask in (plain.shape, plain.strides, plain.dtype_of, plain.storage_elements, plain.tensor_itemsize):
        with pytest.raises(InvalidArgumentError, match=rf"^tensor={tensor!r}: this config has no "):
            ask(tensor)


def test_an_unknown_tensor_is_named_by_every_question():
    for ask in (cfg().shape, cfg().strides, cfg().dtype_of, cfg().tensor_itemsize):
        with pytest.raises(InvalidArgumentError, match=r"^tensor='x': must be one of"):
            ask("x")


# -- generated configs ---------------------------------------------------------------------------------------

_TENSORS = ["q", "k", "v", "o", "d_q", "d_o", "stats", *_FEATURE_TENSORS, *FP8_SCALARS]
_case = st.sampled_from([str.lower, str.upper, str.title])
_config = st.fixed_dictionaries({}, optional={
    "heads_kv": st.sampled_from([None, 1, 2, 3]), "seqlen_kv": st.sampled_from([None, 1, 64, 300]),
    "dtype": st.sampled_from(["bf16", "fp16", "half", "fp8_e4m3", "fp32"]),
    "out_dtype": st.sampled_from([None, "bf16", "fp8_e4m3"]), "layout": st.sampled_from(["bshd", "bhsd", "sbhd"]),
    "mask": st.sampled_from(["none", "causal", "causal_bottom_right"]),
    "alignment": st.sampled_from([None, "top_left", "bottom_right"]),
    "window": st.sampled_from([None, (-1, -1), (16, 0), (4, 4), (0, 5), (-1, 0)]),
    "training": st.booleans(), "padding": st.booleans(), "ragged": st.booleans(), "alibi": st.booleans(),
    "bias": st.sampled_from(["none", "1hss", "b11s"]), "bias_grad": st.booleans(),
    "dropout": st.sampled_from([0.0, 0.1]), "sinks": st.booleans(), "page_size": st.sampled_from([0, 16, 64]),
    "num_pages": st.sampled_from([None, 3, 40]),
})


def _names_a_field(message: str) -> bool:
    return any(message.startswith(f + sep) for f in (*FIELD_NAMES, "tensor") for sep in ("=", "[", " "))


@settings(max_examples=400, deadline=None, derandomize=True)
@given(_config, st.dictionaries(st.sampled_from(["mask", "layout", "bias", "dtype", "alignment"]), _case,
                                max_size=2))
def test_generated_configs_construct_and_round_trip_or_name_a_field(fields, cases):
    for name, case in cases.items():
        if isinstance(fields.get(name), str):
            fields[name] = case(fields[name])
    data = {**BASE, **fields}
    try:
        c = AttentionConfig(**data)
    except InvalidArgumentError as e:
        assert _names_a_field(str(e)), str(e)
        return
    text = c.to_json()
    assert AttentionConfig.from_json(text) == c and AttentionConfig.from_json(text).to_json() == text
    assert AttentionConfig.from_dict(json.loads(text)) == c and c.replace() == c
    assert AttentionConfig.from_dict(data) == c  # the spelling given and the canonical one are one config
    for tensor in _TENSORS:  # a tensor the config has answers; any other is an error naming it
        try:
            shape = c.shape(tensor)
        except InvalidArgumentError as e:
            assert str(e).startswith(f"tensor={tensor!r}: "), str(e)
            continue
        assert all(isinstance(n, int) and n >= 1 for n in shape) and len(c.strides(tensor)) == len(shape)


# -- shape_override ---------------------------------------------------------------------

_OVR = dict(batch=2, heads_q=4, seqlen_q=256, head_dim_qk=64, dtype="bf16", shape_override=True)


@pytest.mark.parametrize("fields,word", [
    (dict(padding=True), "padding"),
    (dict(padding=True, ragged=True), "padding"),
    (dict(padding=True, page_size=64), "padding"),
    (dict(bias="1hss"), "a bias"),
    (dict(dtype="fp8_e4m3", head_dim_qk=128), "fp8_e4m3"),
])
def test_shape_override_refuses_what_is_declared_at_the_plans_lengths(fields, word):
    with pytest.raises(InvalidArgumentError, match=rf"^shape_override=True: cannot be combined with .*{word}"):
        AttentionConfig(**{**_OVR, **fields})


def test_shape_override_is_forward_only():
    with pytest.raises(InvalidArgumentError, match=r"^shape_override=True: is forward only \(training=False\)"):
        AttentionConfig(**{**_OVR, "training": True})


def test_shape_override_is_in_the_key_only_when_on():
    on = AttentionConfig(**_OVR)
    off = AttentionConfig(**{**_OVR, "shape_override": False})
    assert '"shape_override":true' in on.to_json() and "shape_override" not in off.to_json()


@pytest.mark.parametrize("extra", [dict(mask="causal_bottom_right"), dict(mask="causal_bottom_right", dropout=0.1),
                                   dict(mask="none", window=(64, 0), alignment="bottom_right"),
                                   dict(mask="causal_bottom_right", seqlen_kv=256)])
def test_shape_override_refuses_a_bottom_right_diagonal(extra):
    # Without per-sequence lengths cudnn-frontend places a bottom-right diagonal from the
    # declared lengths (graph constants): a call's override would keep the declared diagonal.
    # (Declared equal lengths too: a call's lengths may differ.)
    with pytest.raises(InvalidArgumentError, match=r"shape_override=True: cannot be combined with a bottom-right "
                                                    r"diagonal \((mask|alignment)="):
        AttentionConfig(**{**_OVR, "seqlen_kv": 512, **extra})
    # Without the override the band is rewritten top-left, shifted by the declared lengths.
    assert AttentionConfig(**{**_OVR, "shape_override": False, "seqlen_kv": 512, "mask": "causal_bottom_right",
                              "dropout": 0.1}).mask == "none"
    assert AttentionConfig(**{**_OVR, "mask": "causal"}).shape_override  # top-left stays served
