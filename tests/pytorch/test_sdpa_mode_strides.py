"""The SDPA mode's rules for the strides and shapes PyTorch's Meta kernels give (the
output's, the logsumexp's, the gradients'), held to the installed torch's own Meta kernels
and empty_like on every layout and stride pattern a call can bring: fastattn computes them
instead of asking the Meta kernel, whose first call imports sympy (~3 s on the H200)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fastattn.torch import _sdpa_mode  # noqa: E402

OP = torch.ops.aten._scaled_dot_product_cudnn_attention.default
BWD = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default


@st.composite
def strided(draw, shape):
    """A (shape, strides) pair of a view into a bigger buffer: the dims in any memory
    order, each with room to spare or none (packed qkv, slices), extents of 1 included."""
    order = draw(st.permutations(range(4)))
    strides = [0] * 4
    step = 1
    for d in reversed(order):
        strides[d] = step
        step *= shape[d] * draw(st.sampled_from((1, 1, 2, 3)))
    return tuple(shape), tuple(strides)


def _meta(shape, strides, dtype=torch.bfloat16):
    return torch.empty_strided(shape, strides, dtype=dtype, device="meta")


dims = st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 5), st.sampled_from((1, 8, 16)))


@settings(max_examples=300, deadline=None)
@given(st.data(), dims, st.integers(1, 6), st.sampled_from((None, 8, 16, 24)))
def test_the_routes_strides_are_the_meta_kernels(data, bhsd, s_kv, d_v):
    b, h, s_q, d = bhsd
    q_shape, q_str = data.draw(strided((b, h, s_q, d)))
    k_shape, k_str = data.draw(strided((b, h, s_kv, d)))
    v_shape, v_str = data.draw(strided((b, h, s_kv, d if d_v is None else d_v)))
    q, k, v = _meta(q_shape, q_str), _meta(k_shape, k_str), _meta(v_shape, v_str)
    o, lse = OP(q, k, v, None, True, 0.0, False, False)[:2]
    got_o = (_sdpa_mode.empty_like_strides(q_shape, q_str) if o.shape == q.shape
             else _sdpa_mode._dense_strides(o.shape, sorted(range(4), key=lambda i: q_str[i], reverse=True)))
    assert got_o == o.stride()
    assert lse.shape == (b, h, s_q, 1)
    grads = BWD(o, q, k, v, o, lse, torch.empty((), dtype=torch.int64, device="meta"),
                torch.empty((), dtype=torch.int64, device="meta"), None, None, None, s_q, s_kv, 0.0, False)
    for t, g in zip((q, k, v), grads):
        assert _sdpa_mode.empty_like_strides(t.shape, t.stride()) == g.stride(), (t.shape, t.stride())


@settings(max_examples=500, deadline=None)
@given(st.data(), st.lists(st.integers(0, 4), min_size=1, max_size=5))
def test_empty_like_strides_are_the_meta_tensors_on_any_strides(data, shape):
    # zero strides (expanded dims), overlapping ones, empty tensors, channels-last
    strides = tuple(data.draw(st.integers(0, 40)) for _ in shape)
    assert _sdpa_mode.empty_like_strides(shape, strides) == torch.empty_like(_meta(shape, strides)).stride()


@pytest.mark.parametrize("layout,shape,strides", [
    ("bshd", (2, 4, 5, 16), (320, 16, 64, 1)),
    ("bhsd", (2, 4, 5, 16), (320, 80, 16, 1)),
    ("sbhd", (2, 4, 5, 16), (64, 16, 128, 1)),
    ("packed qkv, bshd", (2, 4, 5, 16), (960, 16, 192, 1)),
])
def test_a_route_carries_the_meta_kernels_strides(monkeypatch, layout, shape, strides):
    monkeypatch.setattr(_sdpa_mode._dense, "plan_for", lambda *a: None)
    q = torch.empty(4096, dtype=torch.bfloat16).as_strided(shape, strides)
    route = _sdpa_mode._decide(q, q, q, None, 0.0, True, None, True)
    o, lse = OP(*(_meta(shape, strides) for _ in range(3)), None, True, 0.0, True, False)[:2]
    assert (route.out_stride, route.lse_shape) == (o.stride(), tuple(lse.shape))
    assert route.grad_strides == (torch.empty_like(_meta(shape, strides)).stride(),) * 3
