"""Values derived from other fields meet the limits given ones meet: num_pages's and
max_tokens_*'s defaults (batch=2**30, seqlen=2**30 derived 2**60 pages or tokens, while
the same value given was refused as >= 2**31), and the elements a tensor spans, which
cuDNN (and the C config's int64 strides) index in int64; each error names the fields
the value is derived from."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastattn.config import AttentionConfig
from fastattn.errors import InvalidArgumentError

BASE = {"heads_q": 1, "head_dim_qk": 1}  # (every tensor then within int64, for any batch and lengths)
BIG = dict(BASE, batch=2**30, seqlen_q=2**30)


@pytest.mark.parametrize("features,field,formula", [
    (dict(padding=True, page_size=1), "num_pages", "batch * ceil(seqlen_kv / page_size)"),
    (dict(padding=True, ragged=True), "max_tokens_q", "batch * seqlen_q"),
    (dict(padding=True, ragged=True, max_tokens_q=2**31 - 1), "max_tokens_kv", "batch * seqlen_kv"),
])
def test_a_derived_default_past_the_limit_is_refused_naming_what_it_derives_from(features, field, formula):
    with pytest.raises(InvalidArgumentError) as e:
        AttentionConfig(**BIG, **features)
    assert str(e.value) == (f"{field}={2**60} (its default, {formula}): must be < 2**31, as a given {field}; "
                            f"give {field}")
    with pytest.raises(InvalidArgumentError, match=rf"^{field}={2**60}: must be < 2\*\*31"):  # as the given one
        AttentionConfig(**BIG, **{**features, field: 2**60})


def test_a_value_given_below_the_limit_still_serves():
    paged = AttentionConfig(**BIG, padding=True, page_size=1, num_pages=2**31 - 1)
    assert paged.num_pages == 2**31 - 1 and AttentionConfig.from_json(paged.to_json()) == paged
    packed = AttentionConfig(**BIG, padding=True, ragged=True, max_tokens_q=5, max_tokens_kv=2**31 - 1)
    assert (packed.max_tokens_q, packed.max_tokens_kv) == (5, 2**31 - 1)
    assert AttentionConfig.from_json(packed.to_json()) == packed
    largest = AttentionConfig(**dict(BASE, batch=2**15, seqlen_q=2**16 - 1), padding=True, page_size=1)
    assert largest.num_pages == 2**31 - 2**15 and "num_pages" not in largest.to_dict()  # (a default: implied)


@pytest.mark.parametrize("sizes,tensor", [
    (dict(batch=2**30, heads_q=2**30, seqlen_q=2**30, head_dim_qk=2**30), "q"),
    (dict(batch=2**20, heads_q=2**20, seqlen_q=2**20, head_dim_qk=8), "q"),
    (dict(batch=2**20, heads_q=1, seqlen_q=1, seqlen_kv=2**20, head_dim_qk=1, head_dim_v=2**23), "v"),
    (dict(batch=2**20, heads_q=2**20, seqlen_q=2**10, seqlen_kv=2**20, head_dim_qk=1, bias="bhss"), "bias"),
])
def test_a_tensor_past_int64_is_refused_naming_it(sizes, tensor):
    for layout in ("bshd", "sbhd", "bhsd"):
        with pytest.raises(InvalidArgumentError, match=rf"^tensor {tensor} of shape .* spans \d+ elements: must be "
                                                       r"< 2\*\*63"):
            AttentionConfig(**sizes, layout=layout)


def test_tensors_within_int64_are_taken():
    # (Explicit strides, each < 2**31 and not overlapping, span less than 2**63 by themselves.)
    assert AttentionConfig(batch=2**20, heads_q=2**20, seqlen_q=2**20, head_dim_qk=8 - 1).storage_elements("q") < 2**63
    assert AttentionConfig(batch=2**20, heads_q=2**20, seqlen_q=2**20, head_dim_qk=4).storage_elements("q") == 2**62


@settings(max_examples=300, deadline=None, derandomize=True)
@given(batch=st.integers(1, 2**31 - 1), seqlen=st.integers(1, 2**31 - 1), page_size=st.integers(1, 2**31 - 1),
       ragged=st.booleans())
def test_a_default_is_accepted_exactly_when_the_same_value_given_is(batch, seqlen, page_size, ragged):
    features = dict(padding=True, ragged=True) if ragged else dict(padding=True, page_size=page_size)
    field = "max_tokens_q" if ragged else "num_pages"
    base = dict(BASE, batch=batch, seqlen_q=seqlen, **({"max_tokens_kv": 1} if ragged else {}))
    try:
        derived = getattr(AttentionConfig(**base, **features), field)
    except InvalidArgumentError as e:
        derived = None
        assert str(e).startswith(f"{field}=") and "(its default, batch * " in str(e)
    value = batch * seqlen if ragged else batch * -(-seqlen // page_size)
    try:
        given_ = getattr(AttentionConfig(**base, **features, **{field: value}), field)
    except InvalidArgumentError as e:
        given_ = None
        assert str(e).startswith(f"{field}={value}: must be < 2**31")
    assert derived == given_ == (value if value < 2**31 else None)
