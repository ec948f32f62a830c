"""Float fields reach cuDNN as float32 (fastattn._fields.float32): a value accepted must
mean, as float32, what it meant. dropout=1e-50 was accepted and became 0 (no dropout
in the graph or the JSON, and host_seed=True then refused with "applies only to
dropout > 0"), while scale=1e-50 was refused as out of float32 range; subnormals
(1e-40), which GPU kernels that flush them take for 0, passed both kinds."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fastattn import _fields, config_files
from fastattn.config import FIELDS, AttentionConfig
from fastattn.errors import InvalidArgumentError

BASE = {"batch": 1, "heads_q": 8, "seqlen_q": 128, "head_dim_qk": 64}
FLOAT_FIELDS = [f.name for f in FIELDS if f.metadata["kind"] in ("positive", "probability")]
TINY = [1e-50, 1e-46, 7e-46, 1e-45, 1e-40, 1e-39, 1.1e-38]  # 0 or subnormal as float32


def test_the_float_fields():
    assert FLOAT_FIELDS == ["scale", "dropout", "softcap"]


def every_path(field, value):
    yield lambda: AttentionConfig(**{**BASE, field: value})
    yield lambda: AttentionConfig.from_json(json.dumps({**BASE, field: value}))
    yield lambda: config_files.expand_entry({**BASE, field: value}, "w.json: configs[0]")


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", TINY)
def test_a_nonzero_value_that_float32_makes_zero_or_subnormal_is_refused(field, value):
    for make in every_path(field, value):
        with pytest.raises(InvalidArgumentError, match=rf"^(w\.json: configs\[0\]: )?{field}={value!r}: is out of "
                                                       r"float32 range"):
            make()


def test_dropout_1e_50_with_host_seed_names_the_dropout():
    with pytest.raises(InvalidArgumentError, match=r"^dropout=1e-50: is out of float32 range"):
        AttentionConfig(**BASE, dropout=1e-50, host_seed=True)


def test_the_smallest_normal_float32_and_zero_are_taken():
    for field in FLOAT_FIELDS:
        assert getattr(AttentionConfig(**BASE, **{field: 2.0**-126}), field) == 2.0**-126
    cfg = AttentionConfig(**BASE, dropout=-0.0)
    assert math.copysign(1.0, cfg.dropout) == 1.0 and "dropout" not in cfg.to_dict()
    assert cfg == AttentionConfig(**BASE) and cfg.to_json() == AttentionConfig(**BASE).to_json()


def test_fastattn_torch_arguments_reach_the_same_rule():
    for kind, name in (("probability", "dropout_p"), ("positive", "scale"), ("positive", "softcap")):
        with pytest.raises(InvalidArgumentError, match=rf"^{name}=1e-40: is out of float32 range"):
            _fields.check(kind, name, 1e-40)


_floats = st.one_of(st.floats(), st.floats(width=32), st.floats(min_value=-1e-36, max_value=1e-36),
                    st.floats(min_value=3.4e38, max_value=3.5e38), st.floats(min_value=0.999999, max_value=1.0))


@settings(max_examples=500, deadline=None, derandomize=True)
@given(st.sampled_from(FLOAT_FIELDS), _floats)
@example("dropout", 1e-50)
@example("dropout", 5e-324)
@example("scale", 1.17549435e-38)
def test_any_float_accepted_survives_float32_with_its_meaning(field, x):
    try:
        cfg = AttentionConfig(**{**BASE, field: x})
    except InvalidArgumentError as e:
        assert str(e).startswith(f"{field}=")
        return
    stored = getattr(cfg, field)
    assert (stored != 0.0) == (x != 0.0), (field, x, stored)
    assert _fields.float32(stored) == stored  # what cuDNN gets
    assert stored == 0.0 or abs(stored) >= _fields.FLOAT32_NORMAL  # not a subnormal
    assert math.copysign(1.0, stored) == 1.0
    again = AttentionConfig.from_json(cfg.to_json())
    assert again == cfg and getattr(again, field) == stored
