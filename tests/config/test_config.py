"""AttentionConfig: validation of every field, canonical form, JSON round trip, strides."""

import json
import re
import struct
import math

import numpy as np
import pytest

from fastattn import AttentionConfig, InvalidArgumentError

BASE = dict(batch=2, heads_q=8, seqlen_q=128, head_dim_qk=64)


def cfg(**kw):
    return AttentionConfig(**{**BASE, **kw})


def test_defaults_are_filled_in_canonically():
    c = cfg()
    assert (c.heads_kv, c.seqlen_kv, c.head_dim_v) == (8, 128, 64)
    assert c.dtype == "bf16" and c.layout == "bshd" and c.mask == "none" and c.window == (-1, -1)
    assert c.scale == pytest.approx(1 / math.sqrt(64)) and not c.training and not c.deterministic


@pytest.mark.parametrize("field", ["batch", "heads_q", "seqlen_q", "head_dim_qk", "heads_kv", "seqlen_kv", "head_dim_v"])
@pytest.mark.parametrize("value", [0, -3, 2**31, 1.5, "4", True, None])
def test_size_fields_reject_bad_values(field, value):
    if value is None and field in ("heads_kv", "seqlen_kv", "head_dim_v"):
        return  # None means "same as the q side" for these
    with pytest.raises(InvalidArgumentError) as e:
        cfg(**{field: value})
    assert str(e.value).startswith(f"{field}={value!r}")
    assert isinstance(e.value, ValueError)


def test_numpy_integers_are_accepted():
    c = cfg(batch=np.int64(3), seqlen_q=np.int32(100))
    assert c.batch == 3 and type(c.batch) is int and c == cfg(batch=3, seqlen_q=100)


def test_heads_q_must_be_a_multiple_of_heads_kv():
    with pytest.raises(InvalidArgumentError, match=r"^heads_kv=3: heads_q=8 must be a multiple of heads_kv"):
        cfg(heads_kv=3)
    assert cfg(heads_kv=1).heads_kv == 1  # MQA
    assert cfg(heads_kv=2).heads_kv == 2  # GQA


@pytest.mark.parametrize("alias,canon", [("fp16", "fp16"), ("float16", "fp16"), ("half", "fp16"), ("bf16", "bf16"),
                                         ("bfloat16", "bf16"), ("torch.bfloat16", "bf16")])
def test_dtype_aliases(alias, canon):
    assert cfg(dtype=alias).dtype == canon


class _FakeTorchDtype:
    def __str__(self):
        return "torch.float16"


def test_dtype_from_an_object_whose_str_names_it():
    assert cfg(dtype=_FakeTorchDtype()).dtype == "fp16"


@pytest.mark.parametrize("bad", ["fp32", "float32", "fp8", "", None, 16, "BF16", "Half"])  # names: as written
def test_dtype_rejects_unknown(bad):
    with pytest.raises(InvalidArgumentError, match=r"^dtype="):
        cfg(dtype=bad)


@pytest.mark.parametrize("bad", ["causal_top_left", "Causal", "", None, 1])
def test_mask_rejects_unknown(bad):
    with pytest.raises(InvalidArgumentError, match=r"^mask="):
        cfg(mask=bad)


def test_window_validation_and_canonical_form():
    assert cfg(window=None).window == (-1, -1)
    assert cfg(window=(None, None)).window == (-1, -1)
    assert cfg(window=[16, 4]).window == (16, 4)
    assert cfg(window=(16, 0), mask="causal").window == (16, -1)  # the mask fixes right=0
    assert cfg(window=(16, 0), mask="causal") == cfg(window=(16, -1), mask="causal")
    with pytest.raises(InvalidArgumentError, match=r"^window\[0\] \(left\)=-2"):
        cfg(window=(-2, 0))
    with pytest.raises(InvalidArgumentError, match=r"^window\[1\] \(right\)=-5"):
        cfg(window=(3, -5))
    with pytest.raises(InvalidArgumentError, match=r"^window=\(8, 2\): mask='causal' fixes the right bound at 0"):
        cfg(window=(8, 2), mask="causal")
    for bad in ((1, 2, 3), 5, "16,0"):
        with pytest.raises(InvalidArgumentError, match=r"^window="):
            cfg(window=bad)


def test_scale_default_explicit_and_invalid():
    assert cfg(head_dim_qk=128).scale == np.float32(1 / math.sqrt(128))
    assert cfg(scale=0.5).scale == 0.5
    # Stored as the float32 cuDNN receives: values equal in float32 are one config.
    assert cfg(scale=0.1) == cfg(scale=float(np.float32(0.1)))
    assert cfg(scale=0.1).scale == float(np.float32(0.1))
    for bad in (0, -1.0, float("nan"), float("inf"), "x", True, 1e-60, 1e60):
        with pytest.raises(InvalidArgumentError, match=r"^scale="):
            cfg(scale=bad)


@pytest.mark.parametrize("field", ["training", "deterministic", "padding", "alibi", "ragged", "sinks", "bias_grad"])
@pytest.mark.parametrize("bad", [1, 0, "true", "false", None])
def test_bool_fields_must_be_bool(field, bad):
    with pytest.raises(InvalidArgumentError, match=rf"^{field}="):
        cfg(**{field: bad, "training": True} if field == "deterministic" else {field: bad})


def test_deterministic_needs_training():
    with pytest.raises(InvalidArgumentError, match=r"^deterministic=True: .*needs training=True"):
        cfg(deterministic=True)
    assert cfg(training=True, deterministic=True).deterministic


def test_config_is_frozen_and_hashable():
    c = cfg()
    with pytest.raises(Exception):
        c.batch = 4
    assert hash(c) == hash(cfg()) and {c: 1}[cfg()] == 1
    assert c != cfg(batch=3)


# -- layouts ----------------------------------------------------------------------------


def test_named_layout_strides():
    c = cfg(batch=2, heads_q=4, heads_kv=2, seqlen_q=10, seqlen_kv=12, head_dim_qk=8, head_dim_v=6)
    assert c.replace(layout="bshd").strides("q") == (10 * 4 * 8, 8, 4 * 8, 1)
    assert c.replace(layout="bshd").strides("k") == (12 * 2 * 8, 8, 2 * 8, 1)
    assert c.replace(layout="sbhd").strides("v") == (2 * 6, 6, 2 * 2 * 6, 1)
    assert c.replace(layout="bhsd").strides("o") == (4 * 10 * 6, 10 * 6, 6, 1)
    assert c.strides("d_q") == c.strides("q") and c.strides("d_o") == c.strides("o")
    assert c.strides("stats") == (4 * 10, 10, 1, 1) and c.shape("stats") == (2, 4, 10, 1)
    for layout in ("bshd", "sbhd", "bhsd"):
        d = c.replace(layout=layout)
        for t in ("q", "k", "v", "o"):
            assert d.storage_elements(t) == int(np.prod(d.shape(t)))  # dense


def test_explicit_strides_equal_to_a_named_layout_become_its_name():
    c = cfg(layout="sbhd")
    explicit = {t: c.strides(t) for t in ("q", "k", "v", "o")}
    assert cfg(layout=explicit).layout == "sbhd"
    assert cfg(layout=explicit) == c and hash(cfg(layout=explicit)) == hash(c)
    assert cfg(layout=tuple(explicit.values())).layout == "sbhd"


def test_explicit_strides_packed_qkv_are_kept():
    b, s, h, d = 2, 128, 8, 64
    qkv = (s * 3 * h * d, d, 3 * h * d, 1)
    c = cfg(layout={"q": qkv, "k": qkv, "v": qkv, "o": cfg().strides("o")})
    assert c.layout == (qkv, qkv, qkv, cfg().strides("o"))
    assert c.strides("k") == qkv
    assert c.storage_elements("q") == 1 + (b - 1) * qkv[0] + (h - 1) * d + (s - 1) * 3 * h * d + (d - 1)


def test_explicit_strides_validation():
    good = cfg().strides("q")
    with pytest.raises(InvalidArgumentError, match=r"^layout=.*exactly the keys"):
        cfg(layout={"q": good, "k": good, "v": good})
    with pytest.raises(InvalidArgumentError, match=r"^layout\['v'\]="):
        cfg(layout={"q": good, "k": good, "v": (1, 2, 3), "o": good})
    with pytest.raises(InvalidArgumentError, match=r"^layout\['o'\]=0"):
        cfg(layout={"q": good, "k": good, "v": good, "o": (0, 1, 1, 1)})
    with pytest.raises(InvalidArgumentError, match=r"^layout\['o'\]=.*overlap"):
        cfg(layout={"q": good, "k": good, "v": good, "o": (1, 1, 1, 1)})
    with pytest.raises(InvalidArgumentError, match=r"^layout='bsdh'"):
        cfg(layout="bsdh")
    with pytest.raises(InvalidArgumentError, match=r"^layout="):
        cfg(layout=42)


def test_shape_rejects_unknown_tensor():
    with pytest.raises(InvalidArgumentError, match=r"^tensor='x'"):
        cfg().shape("x")
    with pytest.raises(InvalidArgumentError, match=r"^tensor='d_x'"):
        cfg().strides("d_x")


# -- canonical JSON ---------------------------------------------------------------------

VARIANTS = [
    cfg(),
    cfg(heads_kv=2, seqlen_kv=300, head_dim_v=32, dtype="fp16", layout="sbhd", mask="causal_bottom_right",
        window=(64, -1), scale=0.3, training=True, deterministic=True),
    cfg(layout={"q": (3 * 128 * 8 * 64, 64, 3 * 8 * 64, 1), "k": (3 * 128 * 8 * 64, 64, 3 * 8 * 64, 1),
                "v": (3 * 128 * 8 * 64, 64, 3 * 8 * 64, 1), "o": cfg().strides("o")}),
    cfg(window=(10, 5)),
    cfg(padding=True, mask="causal_bottom_right", seqlen_kv=200, training=True),
    cfg(padding=True, ragged=True, max_tokens_q=200, training=True),
    cfg(bias="1hss", bias_grad=True, training=True, dropout=0.1, sinks=True),
    cfg(seqlen_q=1, seqlen_kv=300, padding=True, page_size=64, num_pages=12),
]


@pytest.mark.parametrize("c", VARIANTS)
def test_json_round_trip(c):
    text = c.to_json()
    back = AttentionConfig.from_json(text)
    assert back == c and hash(back) == hash(c) and back.to_json() == text
    assert json.loads(text) == c.to_dict()
    assert AttentionConfig.from_dict(json.loads(text)) == c
    assert AttentionConfig.coerce(text) == c and AttentionConfig.coerce(c.to_dict()) == c and AttentionConfig.coerce(c) is c


def test_canonical_json_is_stable():
    # A golden string: a change here changes every cache key, so it must be deliberate.
    assert cfg().to_json() == (
        '{"batch":2,"deterministic":false,"dtype":"bf16","head_dim_qk":64,"head_dim_v":64,"heads_kv":8,'
        '"heads_q":8,"layout":"bshd","mask":"none","scale":0.125,"seqlen_kv":128,"seqlen_q":128,'
        '"training":false,"window":[-1,-1]}'
    )


def test_features_appear_in_the_canonical_form_only_when_used():
    # So that adding a feature leaves the keys of every config without it unchanged.
    assert "padding" not in cfg().to_dict() and cfg(padding=True).to_dict()["padding"] is True
    assert cfg(padding=True) != cfg() and AttentionConfig.from_dict(cfg().to_dict()).padding is False


def test_every_feature_stays_out_of_the_canonical_form_when_off():
    assert set(cfg().to_dict()) == {"batch", "deterministic", "dtype", "head_dim_qk", "head_dim_v", "heads_kv",
                                    "heads_q", "layout", "mask", "scale", "seqlen_kv", "seqlen_q", "training",
                                    "window"}
    assert cfg(dropout=0.0, bias="none", page_size=0, max_tokens_q=None) == cfg()


# -- the features' fields -----------------------------------------------------------------


def test_ragged_needs_padding_and_packed_tokens():
    with pytest.raises(InvalidArgumentError, match=r"^ragged=True: needs padding=True"):
        cfg(ragged=True)
    with pytest.raises(InvalidArgumentError, match=r"^layout='bhsd': ragged"):
        cfg(padding=True, ragged=True, layout="bhsd")
    c = cfg(padding=True, ragged=True)
    assert (c.max_tokens_q, c.max_tokens_kv) == (2 * 128, 2 * 128)  # default: every sequence at its longest
    assert c.storage_elements("q") == 256 * 8 * 64 and c.shape("ragged_q") == (3,)
    c = cfg(padding=True, ragged=True, max_tokens_q=100, seqlen_kv=50, heads_kv=2, max_tokens_kv=7)
    assert c.storage_elements("o") == 100 * 8 * 64 and c.storage_elements("v") == 7 * 2 * 64
    # Packed stats: (tokens, heads_q) float32.
    assert c.strides("stats") == (8 * 128, 1, 8, 1) and c.storage_elements("stats") == 100 * 8
    assert c.shape("ragged_stats") == (3,) and c.tensor_dtype("ragged_stats") == "int32"


def test_defaults_that_follow_other_fields_follow_them_through_replace():
    c = cfg(padding=True, ragged=True)
    assert "max_tokens_q" not in c.to_dict() and c == cfg(padding=True, ragged=True, max_tokens_q=256)
    assert c.replace(seqlen_q=64).max_tokens_q == 128  # the default again, not the old 256
    assert c.replace(ragged=False).max_tokens_q == 0 and cfg().replace(padding=True, ragged=True).max_tokens_q == 256
    explicit = cfg(padding=True, ragged=True, max_tokens_q=100)
    assert explicit.to_dict()["max_tokens_q"] == 100 and explicit.replace(batch=3).max_tokens_q == 100
    with pytest.raises(InvalidArgumentError, match=r"^max_tokens_q=100: applies only to ragged=True"):
        explicit.replace(ragged=False)
    paged = cfg(seqlen_q=1, seqlen_kv=300, padding=True, page_size=64)
    assert paged.replace(seqlen_kv=600).num_pages == 2 * 10 and paged.replace(page_size=0).num_pages == 0


@pytest.mark.parametrize("field,value,why", [
    ("max_tokens_q", 0, "must be >= 1"),
    ("max_tokens_q", 257, "exceeds batch \\* seqlen = 256"),
    ("max_tokens_kv", "9", "must be an integer"),
])
def test_max_tokens_validation(field, value, why):
    with pytest.raises(InvalidArgumentError, match=rf"^{field}={value!r}: {why}"):
        cfg(padding=True, ragged=True, **{field: value})
    with pytest.raises(InvalidArgumentError, match=rf"^{field}=5: applies only to ragged=True"):
        cfg(**{field: 5})


def test_bias_shapes_and_validation():
    c = cfg(batch=3, heads_q=4, heads_kv=4, seqlen_q=10, seqlen_kv=20, bias="b1ss")
    assert c.shape("bias") == (3, 1, 10, 20) and c.strides("bias") == (200, 200, 20, 1)
    assert cfg(bias="1hss").shape("d_bias") == (1, 8, 128, 128) and cfg(bias="11ss").shape("bias")[:2] == (1, 1)
    assert cfg(bias="bhss").shape("bias") == (2, 8, 128, 128)
    for bad in ("1h", "BHSS", None, 3):
        with pytest.raises(InvalidArgumentError, match=r"^bias=.*: must be one of"):
            cfg(bias=bad)
    with pytest.raises(InvalidArgumentError, match=r"^bias_grad=True: needs a bias and training=True"):
        cfg(bias="1hss", bias_grad=True)
    with pytest.raises(InvalidArgumentError, match=r"^bias_grad=True: needs a bias"):
        cfg(bias_grad=True, training=True)


@pytest.mark.parametrize("bad", [-0.1, 1.0, 2, float("nan"), "0.1", True, None])
def test_dropout_must_be_a_probability_below_one(bad):
    with pytest.raises(InvalidArgumentError, match=r"^dropout="):
        cfg(dropout=bad)


def test_dropout_is_stored_as_the_float32_cudnn_uses():
    assert cfg(dropout=0.1).dropout == struct.unpack("f", struct.pack("f", 0.1))[0]
    assert cfg(dropout=0.1).shape("seed") == (1,) and AttentionConfig.tensor_dtype("offset") == "int64"


def test_host_seed_needs_dropout():
    assert cfg(dropout=0.1, host_seed=True).to_dict()["host_seed"] is True and "host_seed" not in cfg(dropout=0.1).to_dict()
    with pytest.raises(InvalidArgumentError, match=r"^host_seed=True: applies only to dropout > 0"):
        cfg(host_seed=True)
    with pytest.raises(InvalidArgumentError, match=r"^host_seed=1: must be True or False"):
        cfg(dropout=0.1, host_seed=1)


def test_sinks_tensor():
    c = cfg(sinks=True, training=True)
    assert c.shape("sink") == (1, 8, 1, 1) == c.shape("d_sink") and c.tensor_dtype("d_sink") == "float32"


def test_paged_kv_cache_fields():
    c = cfg(batch=3, seqlen_q=1, seqlen_kv=300, padding=True, page_size=64)
    assert c.pages_per_sequence == 5 and c.num_pages == 15  # default: every sequence at its longest
    assert c.shape("k") == (15, 8, 64, 64) and c.shape("page_table_v") == (3, 1, 5, 1)
    assert c.strides("k") == (64 * 8 * 64, 64, 8 * 64, 1)  # bshd pages: (page, token, head, dim)
    assert c.tensor_dtype("page_table_k") == "int32" and c.shape("q") == (3, 8, 1, 64)
    with pytest.raises(InvalidArgumentError, match=r"^page_size=64: a paged KV cache is forward only"):
        cfg(page_size=64, padding=True, training=True)
    with pytest.raises(InvalidArgumentError, match=r"^page_size=-1: must be >= 0"):
        cfg(page_size=-1)
    with pytest.raises(InvalidArgumentError, match=r"^num_pages=4: applies only to a paged KV cache"):
        cfg(num_pages=4)
    with pytest.raises(InvalidArgumentError, match=r"^num_pages=0: must be >= 1"):
        cfg(page_size=16, padding=True, num_pages=0)


def test_equivalent_spellings_give_one_canonical_form():
    a = AttentionConfig(batch=1, heads_q=4, seqlen_q=64, head_dim_qk=64, dtype="bfloat16")
    b = AttentionConfig(batch=1, heads_q=4, heads_kv=4, seqlen_q=64, seqlen_kv=64, head_dim_qk=64, head_dim_v=64,
                        dtype="bf16", scale=0.125, window=(-1, -1), layout="bshd")
    assert a == b and a.to_json() == b.to_json()


def test_from_dict_errors_name_the_field():
    with pytest.raises(InvalidArgumentError, match=r"^seq_len=5: is not a field"):
        AttentionConfig.from_dict({**BASE, "seq_len": 5})
    with pytest.raises(InvalidArgumentError, match=r"^head_dim_qk is required"):
        AttentionConfig.from_dict({"batch": 1, "heads_q": 1, "seqlen_q": 1})
    with pytest.raises(InvalidArgumentError, match="not valid JSON"):
        AttentionConfig.from_json("{batch: 1")
    with pytest.raises(InvalidArgumentError, match=r"^config="):
        AttentionConfig.from_dict([1, 2])
    with pytest.raises(InvalidArgumentError, match=r"^config=42"):
        AttentionConfig.coerce(42)


def test_softcap_is_a_positive_float32_left_out_of_the_canonical_form_when_unset():
    plain = cfg()
    assert plain.softcap is None and "softcap" not in plain.to_json()  # old configs' keys are unchanged
    capped = cfg(softcap=30)
    assert capped.softcap == 30.0 and json.loads(capped.to_json())["softcap"] == 30.0
    assert AttentionConfig.from_json(capped.to_json()) == capped and capped != plain
    assert cfg(softcap=0.1).softcap == struct.unpack("f", struct.pack("f", 0.1))[0]  # what cuDNN gets


@pytest.mark.parametrize("value,why", [(0, "> 0"), (-1.0, "> 0"), (math.inf, "> 0"), (math.nan, "> 0"),
                                       (True, "a number"), ("30", "a number"), (1e39, "float32"), (1e-50, "float32")])
def test_softcap_refuses_what_is_not_a_cap(value, why):
    with pytest.raises(InvalidArgumentError, match=rf"^softcap={re.escape(repr(value))}: .*{why}"):
        cfg(softcap=value)
