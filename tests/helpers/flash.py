"""fastattn.flash's CPU tests' inputs (meta tensors) and call recorder, shared by
tests/flash/test_flash.py and test_flash_alibi.py."""

from __future__ import annotations

import torch

from fastattn import flash
from fastattn.integrations.flash import _common

M = dict(device="meta", dtype=torch.bfloat16)


def dense(b=2, sq=128, sk=128, h=8, hk=2, d=64, device="meta", grad=False):
    return tuple(torch.empty(b, s, hh, d, device=device, dtype=torch.bfloat16, requires_grad=grad)
                 for s, hh in ((sq, h), (sk, hk), (sk, hk)))


def varlen(total_q=201, total_k=301, h=8, hk=2, d=64, b=2):
    q = torch.empty(total_q, h, d, **M)
    k, v = (torch.empty(total_k, hk, d, **M) for _ in range(2))
    cu_q, cu_k = (torch.zeros(b + 1, dtype=torch.int32, device="meta") for _ in range(2))
    return q, k, v, cu_q, cu_k


def kvcache(b=2, sq=1, h=8, hk=2, d=64, pages=12, page=16, per_seq=4, paged=True):
    q = torch.empty(b, sq, h, d, **M)
    shape = (pages, page, hk, d) if paged else (b, per_seq * page, hk, d)
    k_cache, v_cache = (torch.empty(shape, **M) for _ in range(2))
    table = torch.zeros(b, per_seq, dtype=torch.int32, device="meta") if paged else None
    lens = torch.zeros(b, dtype=torch.int32, device="meta")
    return q, k_cache, v_cache, table, lens


def calls_with(**extra):
    q, k, v = dense()
    qv, kv_, vv, cu_q, cu_k = varlen()
    qc, kc, vc, table, lens = kvcache()
    qkv = torch.empty(2, 128, 3, 8, 64, **M)
    kvp = torch.empty(2, 128, 2, 2, 64, **M)
    return [
        lambda: flash.flash_attn_func(q, k, v, **extra),
        lambda: flash.flash_attn_qkvpacked_func(qkv, **extra),
        lambda: flash.flash_attn_kvpacked_func(q, kvp, **extra),
        lambda: flash.flash_attn_varlen_func(qv, kv_, vv, cu_q, cu_k, 100, 200, **extra),
        lambda: flash.flash_attn_varlen_qkvpacked_func(torch.empty(201, 3, 8, 64, **M), cu_q, 100, **extra),
        lambda: flash.flash_attn_varlen_kvpacked_func(qv, torch.empty(301, 2, 2, 64, **M), cu_q, cu_k, 100, 200,
                                                      **extra),
        lambda: flash.flash_attn_with_kvcache(qc, kc, vc, cache_seqlens=lens, block_table=table, **extra),
    ]


def recorded(monkeypatch, name, fn, *args, **kwargs) -> dict:
    """The keywords fn gives fastattn.torch's entry point `name` (and its q, as "q")."""
    seen = []

    def record(q, k, v, *rest, **kw):
        seen.append({**kw, "q": q, "k": k, "v": v, "args": rest})
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        return (out, q.new_empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)) if kw.get("return_lse") \
            else out

    monkeypatch.setattr(_common, name, record)
    fn(*args, **kwargs)
    return seen[0]
