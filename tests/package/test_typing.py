"""A user's calls of the public API type-check under `mypy --strict`: each
call's result has its precise type (assert_type fails on Any), and fastattn.flash's
functions are annotated with FlashAttention's signatures. One mypy run, its cache under
tmp_path; skipped where mypy (tests/requirements.txt) or torch is not installed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

USER = '''
from concurrent.futures import Future

import torch
from typing_extensions import assert_type

import fastattn
import fastattn.torch
from fastattn._core import Plan
from fastattn.flash import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                            flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                            flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)

Pair = tuple[torch.Tensor, torch.Tensor]
Triple = tuple[torch.Tensor, torch.Tensor, None]


def runtime(cfg: fastattn.AttentionConfig) -> None:
    assert_type(fastattn.plan(cfg), Plan)
    assert_type(fastattn.plan({"batch": 1, "heads_q": 8, "seqlen_q": 128, "head_dim_qk": 64}, device=0), Plan)
    assert_type(fastattn.plan(cfg.to_json()).forward_workspace_size, int)
    assert_type(fastattn.probe(cfg, device=0, refresh=True), fastattn.ProbeResult)
    assert_type(fastattn.preload([cfg, cfg.to_json()], threads=2), list[fastattn.ProbeResult])
    assert_type(fastattn.preload(background=True), Future[list[fastattn.ProbeResult]])


def torch_entry_points(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, table: torch.Tensor,
                       lengths: torch.Tensor, flag: bool) -> None:
    assert_type(fastattn.torch.attention(q, k, v, causal=True, window=(128, 0), scale=0.125, softcap=30.0),
                torch.Tensor)
    assert_type(fastattn.torch.attention(q, k, v, return_lse=False), torch.Tensor)
    assert_type(fastattn.torch.attention(q, k, v, return_lse=True), Pair)
    assert_type(fastattn.torch.attention(q, k, v, return_lse=flag), torch.Tensor | Pair)
    assert_type(fastattn.torch.attention_varlen(q, k, v, cu, cu, 128, 128, causal=True), torch.Tensor)
    assert_type(fastattn.torch.attention_varlen(q, k, v, cu, cu, 128, 128, return_lse=True), Pair)
    assert_type(fastattn.torch.attention_paged(q, k, v, table, lengths, causal_bottom_right=True), torch.Tensor)
    assert_type(fastattn.torch.scaled_dot_product_attention(q, k, v, None, 0.1, True, scale=0.125, enable_gqa=flag),
                torch.Tensor)
    assert_type(fastattn.torch.scaled_dot_product_attention(q, k, v, attn_mask=lengths, recognize_mask=True),
                torch.Tensor)


def flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qkv: torch.Tensor, kv: torch.Tensor,
          cu: torch.Tensor, slopes: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor) -> None:
    assert_type(flash_attn_func(q, k, v, 0.1, None, True, (-1, -1), 0.0, slopes, False), torch.Tensor)
    assert_type(flash_attn_func(q, k, v, causal=True, softcap=30.0, return_attn_probs=True), Triple)
    assert_type(flash_attn_qkvpacked_func(qkv, causal=True), torch.Tensor)
    assert_type(flash_attn_qkvpacked_func(qkv, return_attn_probs=True), Triple)
    assert_type(flash_attn_kvpacked_func(q, kv, softmax_scale=0.125), torch.Tensor)
    assert_type(flash_attn_kvpacked_func(q, kv, return_attn_probs=True), Triple)
    assert_type(flash_attn_varlen_func(q, k, v, cu, cu, 128, 128, causal=True, block_table=None), torch.Tensor)
    assert_type(flash_attn_varlen_func(q, k, v, cu, cu, 128, 128, return_attn_probs=True), Triple)
    assert_type(flash_attn_varlen_qkvpacked_func(qkv, cu, 128, window_size=(64, 0)), torch.Tensor)
    assert_type(flash_attn_varlen_qkvpacked_func(qkv, cu, 128, return_attn_probs=True), Triple)
    assert_type(flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 128, 128, deterministic=True), torch.Tensor)
    assert_type(flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 128, 128, return_attn_probs=True), Triple)
    assert_type(flash_attn_with_kvcache(q, k, v, k, v, cache_seqlens=lengths, causal=True), torch.Tensor)
    assert_type(flash_attn_with_kvcache(q, k, v, cache_seqlens=3, block_table=table, num_splits=1), torch.Tensor)
    assert_type(flash_attn_with_kvcache(q, k, v, return_softmax_lse=True), Pair)
'''


def test_mypy_strict_accepts_a_users_calls_and_infers_their_types(tmp_path):
    pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")
    pytest.importorskip("mypy", reason="mypy is not installed (pip install -r tests/requirements.txt)")
    import fastattn

    (tmp_path / "user.py").write_text(textwrap.dedent(USER))
    # The fastattn under test (a checkout or an installed one), found as an installed
    # package (py.typed): mypy checks the user's file against its annotations only.
    root = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    env.pop("MYPYPATH", None)
    r = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--no-color-output", "--cache-dir",
                        str(tmp_path / "cache"), "user.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
