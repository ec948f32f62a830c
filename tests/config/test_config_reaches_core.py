"""Every field of AttentionConfig reaches the C++ core's Config: _core._config_fields reads
back the members of the struct that the generated conversion _c_config fills, and each
field's value must arrive (a field whose assignment is missing is built with the C++
default, which only a GPU would notice). Needs the compiled extension, not a GPU."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, reject, settings
from hypothesis import strategies as st

from fastattn import AttentionConfig, InvalidArgumentError
from fastattn.config import ALIGNMENTS, BIAS_SHAPES, DTYPES, FIELDS, FP8_DTYPES, LAYOUTS, MASKS, TENSORS

_core = pytest.importorskip("fastattn._core", reason="the extension is not built")

CORE_ONLY = {"full_lengths": False}  # set by _core from fastattn.defects, from no field


def expected_members(cfg: AttentionConfig) -> dict[str, dict]:
    """{field: {C++ member: value}}, as the core is documented to take each field
    (csrc/config_gen.h), written here apart from the registry's description of it."""
    out = {}
    for f in FIELDS:
        name, value = f.name, getattr(cfg, f.name)
        if name == "layout":
            out[name] = {f"{t}_stride": cfg.strides(t) for t in TENSORS}
        elif name == "window":
            out[name] = {"window_left": value[0], "window_right": value[1]}
        elif name == "alignment":
            out[name] = {"bottom_right": value == "bottom_right"}
        elif name == "bias":
            extents = cfg.shape("bias")[:3] if value != "none" else (0, 0, 0)
            out[name] = dict(zip(("bias_batch", "bias_heads", "bias_seq_q"), extents))
        elif name == "softcap":
            out[name] = {"softcap": 0.0 if value is None else value}
        else:
            out[name] = {name: value}
    return out


def _strided(cfg: AttentionConfig, gap: int) -> dict:
    """Explicit strides: bshd's order with `gap` unused elements after each row of head_dim."""
    strides = {}
    for t in TENSORS:
        b, h, s, d = cfg.shape(t)
        row = d + gap
        strides[t] = (s * h * row, row, h * row, 1)
    return strides


@st.composite
def configs(draw) -> AttentionConfig:
    heads_kv = draw(st.integers(1, 4))
    kw = dict(batch=draw(st.integers(1, 6)), heads_q=heads_kv * draw(st.integers(1, 4)), heads_kv=heads_kv,
              seqlen_q=draw(st.integers(1, 300)), seqlen_kv=draw(st.integers(1, 300)),
              head_dim_qk=draw(st.sampled_from([32, 64, 72, 128])), head_dim_v=draw(st.sampled_from([32, 64, 128])))
    dtype = kw["dtype"] = draw(st.sampled_from(DTYPES))
    training = kw["training"] = draw(st.booleans())
    if dtype in FP8_DTYPES:
        kw["out_dtype"] = draw(st.sampled_from(DTYPES))
        if training:
            kw["grad_dtype"] = draw(st.sampled_from(DTYPES))
    kw["deterministic"] = training and draw(st.booleans())
    padding = kw["padding"] = draw(st.booleans())
    ragged = kw["ragged"] = padding and draw(st.booleans())
    if ragged:
        kw["max_tokens_q"] = draw(st.none() | st.integers(1, kw["batch"] * kw["seqlen_q"]))
        kw["max_tokens_kv"] = draw(st.none() | st.integers(1, kw["batch"] * kw["seqlen_kv"]))
    mask = kw["mask"] = draw(st.sampled_from(MASKS))
    right = draw(st.sampled_from([-1, 0]) if mask != "none" else st.integers(-1, 400))
    kw["window"] = (draw(st.integers(-1, 400)), right)
    alignment = draw(st.sampled_from((None, *ALIGNMENTS)))
    if not (mask == "causal_bottom_right" and alignment == "top_left"):
        kw["alignment"] = alignment
    kw["scale"] = draw(st.none() | st.floats(0.01, 10.0))
    kw["alibi"] = draw(st.booleans())
    bias = kw["bias"] = draw(st.sampled_from(BIAS_SHAPES))
    kw["bias_grad"] = training and bias != "none" and draw(st.booleans())
    dropout = kw["dropout"] = draw(st.sampled_from([0.0, 0.1]) | st.floats(0.0, 0.9))
    kw["host_seed"] = dropout > 0 and draw(st.booleans())
    kw["sinks"] = draw(st.booleans())
    if padding and not training:
        page_size = kw["page_size"] = draw(st.sampled_from([0, 16, 64]))
        if page_size:
            kw["num_pages"] = draw(st.none() | st.integers(1, 100))
    kw["softcap"] = draw(st.none() | st.floats(1.0, 100.0))
    try:
        cfg = AttentionConfig(**kw)
        layout = draw(st.sampled_from((*LAYOUTS, "strided")) if not ragged else st.just("bshd"))
        return cfg.replace(layout=_strided(cfg, draw(st.integers(1, 8))) if layout == "strided" else layout)
    except InvalidArgumentError:  # a rule this strategy does not model
        reject()


# Configs at which every member differs from its C++ default, beside the drawn ones: a missing
# assignment leaves a member at its default, which a config at that default cannot show.
EXAMPLES = [
    AttentionConfig(batch=2, heads_q=4, heads_kv=2, seqlen_q=8, seqlen_kv=16, head_dim_qk=64, head_dim_v=32,
                    dtype="fp8_e4m3", out_dtype="bf16", grad_dtype="fp8_e5m2", window=(4, 3),
                    alignment="bottom_right", scale=0.5, training=True, deterministic=True, padding=True,
                    ragged=True, max_tokens_q=12, max_tokens_kv=20, alibi=True, bias="b1ss", bias_grad=True,
                    dropout=0.25, host_seed=True, sinks=True, softcap=30.0),
    AttentionConfig(batch=3, heads_q=2, seqlen_q=5, head_dim_qk=128, dtype="fp16", mask="causal", window=(7, 0),
                    padding=True, page_size=16, num_pages=9, bias="bh1s"),
]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
@example(EXAMPLES[0])
@example(EXAMPLES[1])
def test_every_field_of_the_config_reaches_the_cxx_config(cfg):
    members = _core._config_fields(cfg)
    owned = {}
    for field, expected in expected_members(cfg).items():
        for member, value in expected.items():
            assert member in members, f"field {field}: no member {member} in the C++ Config"
            assert members[member] == value, f"field {field}={getattr(cfg, field)!r}: {member} is {members[member]!r}"
            owned[member] = field
    assert set(members) - set(owned) == set(CORE_ONLY), "a C++ member that no field owns"
    for member, value in CORE_ONLY.items():
        assert members[member] == value
