# Included by _core.pyx: AttentionConfig to the core's plain Config (fastattn.h).

# AttentionConfig validated these names; an unknown one here is a config newer than this core.
cdef DType _dtype(str name) except *:
    if name == "fp16":
        return DType.kFp16
    if name == "bf16":
        return DType.kBf16
    if name == "fp8_e4m3":
        return DType.kFp8E4m3
    if name == "fp8_e5m2":
        return DType.kFp8E5m2
    raise InvalidArgumentError(
        f"dtype={name!r} is not one this build of fastattn._core knows (fp16, bf16, fp8_e4m3, fp8_e5m2)")


cdef Mask _mask(str name) except *:
    if name == "none":
        return Mask.kNone
    if name == "causal":
        return Mask.kCausal
    if name == "causal_bottom_right":
        return Mask.kCausalBottomRight
    raise InvalidArgumentError(
        f"mask={name!r} is not one this build of fastattn._core knows (none, causal, causal_bottom_right)")


# A bias's (batch, heads, query rows) extents, from its broadcast shape's name: each
# letter is 1 or the full extent (-1 here), "s" at the query position the full extent.
cdef dict _BIAS = {"none": (0, 0, 0),
                   "11ss": (1, 1, -1), "1hss": (1, -1, -1), "b1ss": (-1, 1, -1), "bhss": (-1, -1, -1),
                   "111s": (1, 1, 1), "1h1s": (1, -1, 1), "b11s": (-1, 1, 1), "bh1s": (-1, -1, 1)}


cdef Config _c_config(cfg) except *:
    cdef Config c
    cdef int i
    c.batch = cfg.batch
    c.heads_q = cfg.heads_q
    c.heads_kv = cfg.heads_kv
    c.seqlen_q = cfg.seqlen_q
    c.seqlen_kv = cfg.seqlen_kv
    c.head_dim_qk = cfg.head_dim_qk
    c.head_dim_v = cfg.head_dim_v
    c.dtype = _dtype(cfg.dtype)
    q, k, v, o = cfg.strides("q"), cfg.strides("k"), cfg.strides("v"), cfg.strides("o")
    for i in range(4):
        c.q_stride[i] = q[i]
        c.k_stride[i] = k[i]
        c.v_stride[i] = v[i]
        c.o_stride[i] = o[i]
    c.mask = _mask(cfg.mask)
    c.window_left = cfg.window[0]
    c.window_right = cfg.window[1]
    c.bottom_right = cfg.alignment == "bottom_right"
    c.scale = cfg.scale
    c.training = cfg.training
    c.deterministic = cfg.deterministic
    c.padding = cfg.padding
    c.alibi = cfg.alibi
    c.ragged = cfg.ragged
    c.max_tokens_q = cfg.max_tokens_q
    c.max_tokens_kv = cfg.max_tokens_kv
    bb, bh, bs = _BIAS[cfg.bias]
    c.bias_batch = cfg.batch if bb < 0 else bb
    c.bias_heads = cfg.heads_q if bh < 0 else bh
    c.bias_seq_q = cfg.seqlen_q if bs < 0 else bs
    c.bias_grad = cfg.bias_grad
    c.dropout = cfg.dropout
    c.host_seed = cfg.host_seed
    c.sinks = cfg.sinks
    c.page_size = cfg.page_size
    c.num_pages = cfg.num_pages
    c.out_dtype = _dtype(cfg.out_dtype)
    c.grad_dtype = _dtype(cfg.grad_dtype)
    c.softcap = cfg.softcap or 0.0
    return c
