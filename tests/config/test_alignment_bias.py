"""The alignment field and the one-row bias shapes, on the CPU: canonical
forms, unchanged keys for every config that existed before them, and properties over
mask / window / alignment / bias combinations."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastattn import store
from fastattn.config import ALIGNMENTS, BIAS_SHAPES, MASKS, AttentionConfig, bias_name
from fastattn.errors import InvalidArgumentError

BASE = dict(batch=2, heads_q=8, heads_kv=2, seqlen_q=128, seqlen_kv=256, head_dim_qk=64)
_HEAD = '{"batch":2,'
_TAIL = ('"deterministic":false,"dtype":"bf16","head_dim_qk":64,"head_dim_v":64,"heads_kv":2,"heads_q":8,'
         '"layout":"bshd",')

# Canonical JSON of configs that existed before the alignment field, as fastattn at main
# (commit 1f8556a) wrote them: these strings are what their cache keys hash.
GOLDEN_JSON = [
    (dict(mask="causal_bottom_right"), _HEAD + _TAIL + '"mask":"causal_bottom_right","scale":0.125,"seqlen_kv":256,'
     '"seqlen_q":128,"training":false,"window":[-1,-1]}'),
    (dict(mask="causal_bottom_right", window=(32, 0)), _HEAD + _TAIL + '"mask":"causal_bottom_right","scale":0.125,'
     '"seqlen_kv":256,"seqlen_q":128,"training":false,"window":[32,-1]}'),
    (dict(mask="causal", window=(16, -1)), _HEAD + _TAIL + '"mask":"causal","scale":0.125,"seqlen_kv":256,'
     '"seqlen_q":128,"training":false,"window":[16,-1]}'),
    (dict(window=(16, 8)), _HEAD + _TAIL + '"mask":"none","scale":0.125,"seqlen_kv":256,"seqlen_q":128,'
     '"training":false,"window":[16,8]}'),
    (dict(window=(-1, 4)), _HEAD + _TAIL + '"mask":"none","scale":0.125,"seqlen_kv":256,"seqlen_q":128,'
     '"training":false,"window":[-1,4]}'),
    (dict(bias="b1ss", training=True), _HEAD + '"bias":"b1ss",' + _TAIL + '"mask":"none","scale":0.125,'
     '"seqlen_kv":256,"seqlen_q":128,"training":true,"window":[-1,-1]}'),
    (dict(padding=True, page_size=64, mask="causal_bottom_right"), _HEAD + _TAIL + '"mask":"causal_bottom_right",'
     '"padding":true,"page_size":64,"scale":0.125,"seqlen_kv":256,"seqlen_q":128,"training":false,'
     '"window":[-1,-1]}'),
    (dict(padding=True, ragged=True, mask="causal_bottom_right", window=(8, -1), training=True),
     _HEAD + _TAIL + '"mask":"causal_bottom_right","padding":true,"ragged":true,"scale":0.125,"seqlen_kv":256,'
     '"seqlen_q":128,"training":true,"window":[8,-1]}'),
]

# Cache keys main computed for these configs (store.describe with the arguments below), at
# store.FORMAT_VERSION 2: a format bump changes every key, deliberately; nothing else may.
GOLDEN_KEYS = [
    (dict(mask="causal_bottom_right", window=(32, 0)),
     "a6fcfa1785f174e4792187fddfd77ec386ed6b2625e5fda21ccea6c0a203e928"),
    (dict(window=(16, 8)), "c2522780ed5be6a41bcc5c31203e13f5c1cd48f9feec4e3c441f209e1f1aa6a0"),
    (dict(bias="1hss", training=True, bias_grad=True),
     "e371b3fc8148896e50868a06e561b35518dda9e3b9c9ae5b39f3c6015100b5a4"),
]


def _key(config: AttentionConfig) -> str:
    return store.key_of(store.describe(
        config.to_dict(), fastattn_version="0.1.0", frontend_version="1.28.0", cudnn_version=91900,
        gpu_name="NVIDIA H200", compute_capability=(9, 0), sm_count=132, policy="p", env={}))


@pytest.mark.parametrize("fields,text", GOLDEN_JSON)
def test_existing_configs_keep_their_canonical_json(fields, text):
    assert AttentionConfig(**BASE, **fields).to_json() == text
    assert AttentionConfig.from_json(text).to_json() == text  # an old entry's config still loads as itself


@pytest.mark.parametrize("fields,key", GOLDEN_KEYS)
def test_existing_configs_keep_their_cache_keys(fields, key):
    assert _key(AttentionConfig(**BASE, **fields)) == key


def test_causal_at_the_bottom_right_has_one_spelling():
    old = AttentionConfig(**BASE, mask="causal_bottom_right", window=(32, 0))
    new = AttentionConfig(**BASE, mask="causal", alignment="bottom_right", window=(32, 0))
    assert new == old and new.to_json() == old.to_json() and hash(new) == hash(old)
    assert new.mask == "causal_bottom_right" and new.alignment == "top_left"
    # causal_bottom_right implies the alignment; stating it again changes nothing.
    assert AttentionConfig(**BASE, mask="causal_bottom_right", alignment="bottom_right") == \
        AttentionConfig(**BASE, mask="causal_bottom_right")


def test_alignment_without_a_bound_is_top_left():
    # No mask and no window: no bound uses the diagonal, so both alignments are one graph.
    assert AttentionConfig(**BASE, alignment="bottom_right") == AttentionConfig(**BASE)
    assert "alignment" not in AttentionConfig(**BASE, alignment="bottom_right").to_dict()


@pytest.mark.parametrize("window", [(16, 8), (16, -1), (-1, 4), (0, 3)])
def test_a_window_at_the_bottom_right_is_its_own_config(window):
    top = AttentionConfig(**BASE, window=window)
    bottom = AttentionConfig(**BASE, window=window, alignment="bottom_right")
    assert bottom != top and bottom.to_dict()["alignment"] == "bottom_right"
    assert json.loads(bottom.to_json())["window"] == list(window)
    assert AttentionConfig.from_json(bottom.to_json()) == bottom and _key(bottom) != _key(top)


@pytest.mark.parametrize("left", [-1, 0, 16])
def test_a_right_bound_of_0_at_the_bottom_right_is_the_causal_mask(left):
    window = AttentionConfig(**BASE, window=(left, 0), alignment="bottom_right")
    causal = AttentionConfig(**BASE, mask="causal_bottom_right", window=(left, 0))
    assert window == causal and window.to_json() == causal.to_json() and window.mask == "causal_bottom_right"
    # At the top left the two spellings stay apart: both existed before, with their keys.
    assert AttentionConfig(**BASE, window=(left, 0)) != AttentionConfig(**BASE, mask="causal", window=(left, 0))


def test_alignment_refuses_other_values():
    for bad in ("bottom-right", "BOTTOM_RIGHT", 1, True, ("bottom_right",)):  # (None: not given, the default)
        with pytest.raises(InvalidArgumentError, match=r"^alignment=.*must be one of \('top_left', 'bottom_right'\)"):
            AttentionConfig(**BASE, window=(4, 4), alignment=bad)


def test_a_causal_mask_still_fixes_the_right_bound_at_the_bottom_right():
    with pytest.raises(InvalidArgumentError, match=r"^window=\(4, 2\): mask='causal_bottom_right' fixes"):
        AttentionConfig(**BASE, mask="causal", alignment="bottom_right", window=(4, 2))


@pytest.mark.parametrize("name,shape", [
    ("111s", (1, 1, 1, 256)), ("1h1s", (1, 8, 1, 256)), ("b11s", (2, 1, 1, 256)), ("bh1s", (2, 8, 1, 256)),
    ("11ss", (1, 1, 128, 256)), ("1hss", (1, 8, 128, 256)), ("b1ss", (2, 1, 128, 256)), ("bhss", (2, 8, 128, 256)),
])
def test_bias_shapes(name, shape):
    c = AttentionConfig(**BASE, bias=name)
    assert c.shape("bias") == shape and c.shape("d_bias") == shape
    b, h, s, k = shape
    assert c.strides("bias") == (h * s * k, s * k, k, 1)  # contiguous
    assert c.to_dict()["bias"] == name


def test_bias_shape_names_refuse_others():
    for bad in ("1111", "bhs1", "11s1", "b1hs", "BHSS"):
        with pytest.raises(InvalidArgumentError, match=r"^bias="):
            AttentionConfig(**BASE, bias=bad)


@settings(max_examples=300, deadline=None)
@given(sizes=st.tuples(st.integers(1, 4), st.sampled_from([1, 2, 8]), st.sampled_from([1, 2, 128])),
       full=st.tuples(st.booleans(), st.booleans(), st.booleans()))
def test_bias_name_is_the_inverse_of_the_bias_shape(sizes, full):
    # Any bias of extents 1 or the call's own gets a name whose shape is those extents.
    b, h, s = sizes
    extents = tuple(n if f else 1 for n, f in zip(sizes, full))
    name = bias_name(extents, sizes)
    assert name in BIAS_SHAPES
    c = AttentionConfig(batch=b, heads_q=h, heads_kv=h, seqlen_q=s, seqlen_kv=256, head_dim_qk=64, bias=name)
    assert c.shape("bias") == (*extents, 256)


def test_every_bias_shape_names_its_extents():
    # Each letter is one extent: b|1, h|1, s|1, then always s (seqlen_kv).
    for name in BIAS_SHAPES[1:]:
        assert len(name) == 4 and name[0] in "b1" and name[1] in "h1" and name[2] in "s1" and name[3] == "s"
    assert len(set(BIAS_SHAPES)) == len(BIAS_SHAPES) == 9


# -- properties ---------------------------------------------------------------------------

_bounds = st.sampled_from([-1, 0, 1, 7, 64, 300])


@settings(max_examples=300, derandomize=True, deadline=None)
@given(mask=st.sampled_from(MASKS), alignment=st.sampled_from(ALIGNMENTS), left=_bounds, right=_bounds,
       bias=st.sampled_from(BIAS_SHAPES), seqlen_q=st.sampled_from([1, 64, 128]),
       seqlen_kv=st.sampled_from([1, 64, 256]), padding=st.booleans())
def test_alignment_window_bias_configs_are_canonical(mask, alignment, left, right, bias, seqlen_q, seqlen_kv,
                                                     padding):
    fields = dict(batch=2, heads_q=4, seqlen_q=seqlen_q, seqlen_kv=seqlen_kv, head_dim_qk=64, mask=mask,
                  alignment=alignment, window=(left, right), bias=bias, padding=padding)
    if mask == "causal_bottom_right" and alignment == "top_left":  # the diagonal stated twice, differently
        with pytest.raises(InvalidArgumentError, match=r"^alignment='top_left': mask='causal_bottom_right' puts"):
            AttentionConfig(**fields)
        return
    if mask != "none" and right > 0:
        with pytest.raises(InvalidArgumentError, match=r"^window=.*fixes the right bound at 0"):
            AttentionConfig(**fields)
        return
    c = AttentionConfig(**fields)
    text = c.to_json()
    again = AttentionConfig.from_json(text)
    assert again == c and again.to_json() == text and hash(again) == hash(c)
    d = c.to_dict()
    if bias != "none" and not padding:
        return  # a bottom-right band beside a bias has another spelling: the tests below
    # The diagonal's position is stated once: by the mask's name, or by the alignment
    # field where only a window uses it; never both, never where nothing uses it.
    bottom_right = mask == "causal_bottom_right" or (alignment == "bottom_right" and (
        mask == "causal" or (mask == "none" and right == 0)))
    assert (c.mask == "causal_bottom_right") == bottom_right
    uses_alignment = alignment == "bottom_right" and mask == "none" and (left, right) != (-1, -1) and right != 0
    assert ("alignment" in d) == uses_alignment and c.alignment == ("bottom_right" if uses_alignment else "top_left")
    # Equivalent spellings give one config.
    if bottom_right:
        assert c == AttentionConfig(**{**fields, "mask": "causal_bottom_right", "alignment": "bottom_right",
                                       "window": (left, min(right, 0))})
        assert c == AttentionConfig(**{**fields, "mask": "causal_bottom_right", "alignment": None,
                                       "window": (left, min(right, 0))})
    if not uses_alignment and not bottom_right:
        assert c == AttentionConfig(**{**fields, "alignment": "top_left"})
    if bias != "none":
        b, h, s, k = c.shape("bias")
        assert (b, h, s, k) == (2 if bias[0] == "b" else 1, 4 if bias[1] == "h" else 1,
                                seqlen_q if bias[2] == "s" else 1, seqlen_kv)


def _band(mask, alignment, window, seqlen_q, seqlen_kv):
    """The (query, key) pairs a mask, alignment and window keep, read from
    AttentionConfig's docstring alone: query i sees keys j with i + shift - left <= j <=
    i + shift + right, shift 0 at the top left and seqlen_kv - seqlen_q at the bottom
    right; a causal mask fixes right at 0; -1 is unbounded."""
    left, right = window
    bottom = mask == "causal_bottom_right" or alignment == "bottom_right"
    shift = seqlen_kv - seqlen_q if bottom else 0
    if mask != "none":
        right = 0
    return {(i, j) for i in range(seqlen_q) for j in range(seqlen_kv)
            if (left < 0 or j >= i + shift - left) and (right < 0 or j <= i + shift + right)}


_lengths = st.sampled_from([1, 2, 5, 16, 33])


@settings(max_examples=400, deadline=None)
@given(mask=st.sampled_from(MASKS), alignment=st.sampled_from([None, *ALIGNMENTS]),
       left=st.sampled_from([-1, 0, 1, 3, 8, 40]), right=st.sampled_from([-1, 0, 1, 3, 8, 40]),
       seqlen_q=_lengths, seqlen_kv=_lengths, bias=st.sampled_from(["none", "b11s", "1hss"]),
       dropout=st.sampled_from([0.0, 0.1]), padding=st.booleans(), alibi=st.booleans())
def test_a_band_is_stored_in_a_form_that_keeps_the_same_keys(mask, alignment, left, right, seqlen_q, seqlen_kv, bias,
                                                            dropout, padding, alibi):
    # Whatever spelling the config stores (the bottom-right causal mask's name, or the
    # top-left band a bottom-right one beside a bias or dropout becomes), every query
    # keeps exactly the keys the given mask, alignment and window keep.
    fields = dict(batch=2, heads_q=4, seqlen_q=seqlen_q, seqlen_kv=seqlen_kv, head_dim_qk=64, mask=mask,
                  alignment=alignment, window=(left, right), bias=bias, dropout=dropout, padding=padding,
                  alibi=alibi)
    try:
        c = AttentionConfig(**fields)
    except InvalidArgumentError:
        return  # (contradictions: the test above)
    assert _band(c.mask, c.alignment, c.window, seqlen_q, seqlen_kv) == _band(mask, alignment, (left, right),
                                                                            seqlen_q, seqlen_kv)
    assert AttentionConfig.from_json(c.to_json()) == c and c.replace() == c  # the stored form is a fixed point
    # Beside a bias or dropout without padding (and without ALiBi, which needs its right
    # bound at the diagonal), no bottom-right diagonal keeps a right bound where a top-left
    # one can say the same: the one cuDNN refuses there.
    if (bias != "none" or dropout) and not padding and not alibi:
        bottom = c.mask == "causal_bottom_right" or c.alignment == "bottom_right"
        right_bound = c.mask != "none" or c.window[1] >= 0
        shift = seqlen_kv - seqlen_q
        assert not (bottom and right_bound) or shift < 0 or 0 <= c.window[0] < shift, c


def test_a_left_padded_decode_step_and_chunked_prefill_are_stored_as_cudnn_takes_them():
    base = dict(batch=2, heads_q=8, heads_kv=2, head_dim_qk=64, bias="b11s")
    decode = AttentionConfig(**base, seqlen_q=1, seqlen_kv=100, mask="causal_bottom_right")
    assert (decode.mask, decode.window, decode.alignment) == ("none", (-1, -1), "top_left")
    sliding = AttentionConfig(**base, seqlen_q=1, seqlen_kv=100, mask="causal_bottom_right", window=(23, 0))
    assert (sliding.mask, sliding.window, sliding.alignment) == ("none", (23, -1), "bottom_right")
    chunk = AttentionConfig(**base, seqlen_q=16, seqlen_kv=100, mask="causal_bottom_right")
    assert (chunk.mask, chunk.window, chunk.alignment) == ("none", (-1, 84), "top_left")
    # transformers' sliding layer: the cache keeps window - 1 keys before the chunk's 16
    chunk = AttentionConfig(**base, seqlen_q=16, seqlen_kv=39, mask="causal_bottom_right", window=(23, 0))
    assert (chunk.mask, chunk.window, chunk.alignment) == ("none", (0, 23), "top_left")
    # Where it would change nothing cuDNN refuses (padding: each sequence its own shift;
    # no bias or dropout: cuDNN takes the bottom-right mask), the spelling stays.
    for kept in (dict(base, bias="none"), dict(base, padding=True)):
        c = AttentionConfig(**kept, seqlen_q=16, seqlen_kv=100, mask="causal_bottom_right")
        assert (c.mask, c.window) == ("causal_bottom_right", (-1, -1))


# -- through the CLI flags, warm files and matrix features (all derived from the registry) ----


def test_probe_flags_take_alignment_and_one_row_biases(capsys, monkeypatch):
    from fastattn import cli, runtime
    from fastattn.runtime import ProbeResult

    seen = []
    monkeypatch.setattr(runtime, "probe", lambda cfg, device=None: seen.append(cfg) or ProbeResult(cfg, 0, False, "x"))
    base = ["probe", "--batch", "2", "--heads-q", "8", "--seqlen-q", "64", "--seqlen-kv", "256", "--head-dim-qk",
            "64", "--json"]
    assert cli.main(base + ["--window", "16", "8", "--alignment", "bottom_right", "--bias", "b11s"]) == \
        cli.EXIT_UNSUPPORTED
    assert seen[-1].alignment == "bottom_right" and seen[-1].window == (16, 8) and seen[-1].bias == "b11s"
    assert seen[-1].shape("bias") == (2, 1, 1, 256)
    cli.main(base + ["--mask", "causal", "--alignment", "bottom_right"])
    assert seen[-1].mask == "causal_bottom_right" and seen[-1].alignment == "top_left"
    capsys.readouterr()
    assert cli.main(base + ["--alignment", "bottom"]) == cli.EXIT_BAD_INPUT
    assert "--alignment: invalid choice: 'bottom'" in capsys.readouterr().out  # --json: the error as JSON


def test_warm_files_take_the_new_fields(tmp_path):
    from fastattn.config_files import describe_config, load_configs

    f = tmp_path / "warm.json"
    f.write_text(json.dumps({"configs": [
        {"batch": 1, "heads_q": 8, "seqlen_q": 64, "seqlen_kv": 512, "head_dim_qk": 128, "window": [128, 16],
         "alignment": "bottom_right"},
        {"batch": 4, "heads_q": 8, "seqlen_q": 512, "head_dim_qk": 128, "bias": "b11s", "training": True},
        {"batch": 1, "heads_q": 8, "seqlen_q": 64, "seqlen_kv": 512, "head_dim_qk": 128, "mask": "causal",
         "alignment": "bottom_right"},
    ]}))
    configs = load_configs(str(f))
    assert [c.alignment for c in configs] == ["bottom_right", "top_left", "top_left"]
    assert configs[2].mask == "causal_bottom_right" and configs[1].bias == "b11s"
    assert " br" in describe_config(configs[0]) and "biasb11s" in describe_config(configs[1])
    bad = tmp_path / "bad.json"
    bad.write_text('{"configs": [{"batch": 1, "heads_q": 8, "seqlen_q": 64, "head_dim_qk": 64, "alignment": 1}]}')
    with pytest.raises(InvalidArgumentError, match=r"alignment=1: must be one of"):
        load_configs(str(bad))


def test_matrix_has_a_bottom_right_window_feature():
    from fastattn.cli.matrix import MATRIX_FEATURES

    settings_, _ = MATRIX_FEATURES["window_br"]
    c = AttentionConfig(batch=1, heads_q=8, seqlen_q=128, head_dim_qk=64, **settings_)
    assert c.alignment == "bottom_right" and c.window == (64, 64)
