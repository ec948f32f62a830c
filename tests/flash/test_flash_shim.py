"""tools/flash_shim, the stand-in flash_attn package that runs FlashAttention's own test file
against fastattn.flash (tools/run_flash_tests.sh), without a GPU: its helpers against
straightforward references (unpad_input and pad_input against a loop over the mask,
apply_rotary_emb against a rotation matrix per position, in float64), its re-exports, and
its pytest plugin (the sample, the S_dmask refusal counted apart and no other, the
report)."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

from helpers.paths import ROOT  # noqa: E402

SHIM = ROOT / "tools" / "flash_shim"


def _load(name: str, path):
    """A shim module loaded by file under a private name: the suite's process gets no
    `flash_attn` module (other tests look for a real one)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bert_padding = _load("_shim_bert_padding", SHIM / "flash_attn" / "bert_padding.py")
rotary = _load("_shim_rotary", SHIM / "flash_attn" / "layers" / "rotary.py")
fa_report = _load("_shim_fa_report", SHIM / "fa_report.py")


# -- unpad_input, pad_input ---------------------------------------------------------------------

@st.composite
def _padded(draw):
    batch, seqlen = draw(st.integers(1, 4)), draw(st.integers(1, 9))
    rest = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    bits = st.lists(st.lists(st.booleans(), min_size=seqlen, max_size=seqlen), min_size=batch, max_size=batch)
    mask = torch.tensor(draw(bits))
    mask[0, 0] = True  # at least one token (FlashAttention's max of an empty batch is undefined)
    unused = None
    if draw(st.booleans()):
        unused = torch.tensor(draw(bits)) & ~mask  # allocated-but-unused tokens: not those the mask keeps
    seed = draw(st.integers(0, 2**16))
    x = torch.randn((batch, seqlen) + rest, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return x, mask, unused


@settings(max_examples=150, deadline=None, derandomize=True)
@given(case=_padded(), as_int=st.booleans())
def test_unpad_input_matches_a_loop_over_the_mask(case, as_int):
    x, mask, unused = case
    batch, seqlen = mask.shape
    kept = mask if unused is None else mask | unused
    want_rows, want_idx, want_lens = [], [], []
    for b in range(batch):
        n = 0
        for s in range(seqlen):
            if kept[b, s]:
                want_rows.append(x[b, s])
                want_idx.append(b * seqlen + s)
                n += 1
        want_lens.append(n)
    m = mask.int() if as_int else mask
    u = None if unused is None else (unused.int() if as_int else unused)
    packed, indices, cu, max_seqlen, seqused = bert_padding.unpad_input(x, m, u)
    assert torch.equal(packed, torch.stack(want_rows))
    assert indices.tolist() == want_idx
    assert cu.dtype == torch.int32 and cu.tolist() == [sum(want_lens[:i]) for i in range(batch + 1)]
    assert max_seqlen == max(want_lens) and isinstance(max_seqlen, int)
    assert seqused.dtype == torch.int32 and seqused.tolist() == mask.sum(-1).tolist()


@settings(max_examples=150, deadline=None, derandomize=True)
@given(case=_padded())
def test_pad_input_inverts_unpad_input_and_carries_the_gradient(case):
    x, mask, _ = case
    batch, seqlen = mask.shape
    packed, indices, *_ = bert_padding.unpad_input(x, mask)
    packed = packed.clone().requires_grad_()
    padded = bert_padding.pad_input(packed, indices, batch, seqlen)
    keep = mask.view(batch, seqlen, *([1] * (x.dim() - 2)))
    assert padded.shape == x.shape
    assert torch.equal(padded, torch.where(keep, x, torch.zeros((), dtype=x.dtype)))
    g = torch.randn_like(padded)
    (grad,) = torch.autograd.grad(padded, packed, g)
    assert torch.equal(grad, g.reshape(batch * seqlen, *x.shape[2:])[indices])


# -- apply_rotary_emb ----------------------------------------------------------------------------

def _rotation(cos_row, sin_row, headdim: int, interleaved: bool) -> torch.Tensor:
    """The (headdim, headdim) matrix apply_rotary_emb is at one position: a 2x2 rotation
    [[c, -s], [s, c]] on each pair of features (i, i + rotary_dim/2), or (2i, 2i + 1)
    interleaved, the identity on the features past rotary_dim."""
    half = cos_row.shape[0]
    r = torch.eye(headdim, dtype=torch.float64)
    for i in range(half):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
        c, s = float(cos_row[i]), float(sin_row[i])
        r[a, a], r[a, b], r[b, a], r[b, b] = c, -s, s, c
    return r


def _rotary_reference(x, cos, sin, positions, interleaved):
    """x (tokens, heads, headdim), positions (tokens,): each token times its position's
    matrix (the identity at a position past the table)."""
    out = torch.empty_like(x, dtype=torch.float64)
    for t in range(x.shape[0]):
        p = int(positions[t])
        r = (_rotation(cos[p], sin[p], x.shape[-1], interleaved) if 0 <= p < cos.shape[0]
             else torch.eye(x.shape[-1], dtype=torch.float64))
        out[t] = x[t].double() @ r.T
    return out


@st.composite
def _rotary_case(draw):
    batch, seqlen, heads = draw(st.integers(1, 3)), draw(st.integers(1, 6)), draw(st.integers(1, 2))
    headdim = 2 * draw(st.integers(1, 5))
    half = draw(st.integers(1, headdim // 2))
    seqlen_ro = draw(st.integers(1, 12))
    offsets = draw(st.one_of(st.integers(0, 4), st.lists(st.integers(0, 8), min_size=batch, max_size=batch)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = torch.randn(batch, seqlen, heads, headdim, generator=g, dtype=torch.float64)
    angle = torch.rand(seqlen_ro, half, generator=g, dtype=torch.float64) * 6.3
    return x, torch.cos(angle), torch.sin(angle), offsets


@settings(max_examples=150, deadline=None, derandomize=True)
@given(case=_rotary_case(), interleaved=st.booleans(), packed=st.booleans())
def test_apply_rotary_emb_matches_a_rotation_matrix_per_position(case, interleaved, packed):
    x, cos, sin, offsets = case
    batch, seqlen = x.shape[:2]
    off = torch.tensor(offsets, dtype=torch.int32) if isinstance(offsets, list) else offsets
    per_seq = offsets if isinstance(offsets, list) else [offsets] * batch
    positions = torch.tensor([per_seq[b] + s for b in range(batch) for s in range(seqlen)])
    want = _rotary_reference(x.reshape(batch * seqlen, *x.shape[2:]), cos, sin, positions, interleaved)
    if packed:  # (total, heads, headdim) with cu_seqlens: positions count from each sequence's start
        cu = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32)
        got = rotary.apply_rotary_emb(x.reshape(batch * seqlen, *x.shape[2:]), cos, sin, interleaved=interleaved,
                                      seqlen_offsets=off, cu_seqlens=cu, max_seqlen=seqlen)
    else:
        got = rotary.apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=off)
        got = got.reshape(batch * seqlen, *x.shape[2:])
    # float32 arithmetic (FlashAttention's kernel computes in float32), rounded back to float64
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_apply_rotary_emb_keeps_the_dtype_and_writes_in_place(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 16, generator=g).to(dtype)
    angle = torch.rand(9, 4, generator=g) * 6.3
    cos, sin = torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)
    want = _rotary_reference(x.reshape(10, 3, 16), cos.double(), sin.double(),
                             torch.tensor([p + o for o in (1, 4) for p in range(5)]), False).reshape(x.shape)
    out = rotary.apply_rotary_emb(x, cos, sin, seqlen_offsets=torch.tensor([1, 4]))
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)
    y = x.clone()
    assert rotary.apply_rotary_emb(y, cos, sin, inplace=True, seqlen_offsets=torch.tensor([1, 4])) is y
    assert torch.equal(y, out)
    assert torch.equal(y[..., 8:], x[..., 8:])  # past rotary_dim = 8: unchanged


# -- the package: fastattn.flash's functions under FlashAttention's names ------------------------

@pytest.fixture
def shim_path(monkeypatch):
    """tools/flash_shim on sys.path for one test; the flash_attn modules it imported are
    dropped after, so no other test sees them."""
    monkeypatch.syspath_prepend(str(SHIM))
    yield
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        del sys.modules[name]


def test_the_package_re_exports_fastattn_flash(shim_path):
    from fastattn import flash

    import flash_attn
    from flash_attn import flash_attn_interface

    assert flash_attn.__file__.startswith(str(SHIM))
    assert flash_attn.__version__.endswith("+fastattn.shim")
    assert set(flash_attn.__all__) == set(flash.__all__)
    for name in flash.__all__:
        assert getattr(flash_attn, name) is getattr(flash, name)
        assert getattr(flash_attn_interface, name) is getattr(flash, name)
    # Reached only to decode an S_dmask with dropout, which fastattn.flash refuses first.
    with pytest.raises(NotImplementedError, match="S_dmask"):
        flash_attn_interface._get_block_size_n("cuda", 64, True, False)


# -- the pytest plugin and the report ------------------------------------------------------------

_CASES = textwrap.dedent('''
    import pytest
    from fastattn.errors import NotSupportedError

    @pytest.mark.parametrize("b", range(10))
    @pytest.mark.parametrize("a,c", [(1, 2), (3, 4), (5, 6)])
    def test_sampled(a, c, b):
        pass

    @pytest.mark.parametrize("dropout_p", [0.0, 0.17])
    def test_refusals(dropout_p):
        if dropout_p:
            raise NotSupportedError("return_attn_probs=True with dropout_p > 0: FlashAttention then returns ...")
        raise NotSupportedError("cuDNN refused the plan: hidden_dim should be multiple of 8")

    def test_skips():
        pytest.skip("Softcap and dropout not supported together")

    def test_fails():
        assert 1 + 1 == 3
''')


def _run_plugin(tmp_path, per_func: int, results: str, *args):
    env = dict(os.environ, FA_PER_FUNC=str(per_func), FA_SEED="7", FA_RESULTS=results, FA_BUDGET_S="600",
               PYTHONPATH=os.pathsep.join([str(SHIM), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "fa_subset", "-p", "no:cacheprovider", "-q",
                           "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_cases.py"), *args],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)


def test_the_plugin_samples_counts_the_s_dmask_refusal_alone_and_reports(tmp_path):
    (tmp_path / "test_cases.py").write_text(_CASES)
    results = str(tmp_path / "results.jsonl")
    r = _run_plugin(tmp_path, 4, results)
    assert r.returncode == 1, r.stdout + r.stderr  # the other refusal and the assertion fail
    s = fa_report.summarize(fa_report.load(results))
    t = s["table"]
    assert t["test_sampled"] == {"collected": 30, "selected": 4, "passed": 4, "failed": 0, "skipped": 0,
                                 "refused": 0, "not_reached": 0, "crashed": 0}
    assert t["test_refusals"]["refused"] == 1 and t["test_refusals"]["failed"] == 1
    assert t["test_skips"]["skipped"] == 1 and t["test_fails"]["failed"] == 1
    reasons = " ".join(f["reason"] for f in s["failure_reasons"])
    assert "hidden_dim should be multiple of 8" in reasons  # a refusal other than S_dmask: a failure, with why
    assert "assert" in reasons and "test_cases.py:" in reasons
    assert not s["ok"]
    md = fa_report.markdown(s)
    assert "| test_sampled | 30 | 4 | 4 | 0 | 0 | 0 | 0 | 0 |" in md
    # The documented draw, so the same on any machine: random.Random("FA_SEED:function")
    # over the product in index space, the first marker applied (the lowest decorator) the
    # most significant digit.
    selected = [json.loads(line) for line in open(results)][0]["selected"]["test_sampled"]
    assert [n.split("::")[-1] for n in selected] == _drawn("7", 4)


def _drawn(seed: str, k: int) -> list[str]:
    """test_sampled's case ids that FA_SEED=seed, FA_PER_FUNC=k draw: (a, c) the first
    digit (3 values), b the second (10)."""
    ac = [(1, 2), (3, 4), (5, 6)]
    return [f"test_sampled[{ac[p // 10][0]}-{ac[p // 10][1]}-{p % 10}]"
            for p in random.Random(f"{seed}:test_sampled").sample(range(30), k)]


def test_a_rerun_skips_started_cases_and_the_report_names_a_crash(tmp_path):
    """As after a process that died in a case: its start recorded, no report. The next
    process (tools/run_flash_tests.sh starts one) runs the rest, and the report names it."""
    (tmp_path / "test_cases.py").write_text(_CASES)
    results = tmp_path / "results.jsonl"
    first, second = (f"test_cases.py::{name}" for name in _drawn("7", 2))
    results.write_text(json.dumps({"event": "selection", "seed": "7", "per_func": 2, "collected": {"test_sampled": 30},
                                   "selected": {"test_sampled": [first, second]}}) + "\n"
                       + json.dumps({"event": "start", "nodeid": first, "t": 0}) + "\n")
    r = _run_plugin(tmp_path, 2, str(results), "-k", "sampled")
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout + r.stderr
    s = fa_report.summarize(fa_report.load(str(results)))
    assert s["table"]["test_sampled"]["passed"] == 1 and s["table"]["test_sampled"]["crashed"] == 1
    assert s["failure_reasons"][0]["example"] == first and not s["ok"]


def _ran(results: str) -> list[str]:
    return [rec["nodeid"] for rec in map(json.loads, open(results)) if rec.get("event") == "start"]


def test_shards_split_one_sample_between_processes(tmp_path, monkeypatch):
    # FA_SHARD=i/n: every n-th case of the run's order from the i-th; together the shards
    # run the unsharded run's cases, each once, and each records the whole selection.
    (tmp_path / "test_cases.py").write_text(_CASES)
    whole = str(tmp_path / "whole.jsonl")
    _run_plugin(tmp_path, 4, whole, "-k", "sampled or refusals")
    parts = []
    for i in range(3):
        monkeypatch.setenv("FA_SHARD", f"{i}/3")
        part = str(tmp_path / f"part-{i}.jsonl")
        _run_plugin(tmp_path, 4, part, "-k", "sampled or refusals")
        parts.append(_ran(part))
        assert [json.loads(line) for line in open(part)][0]["selected"] == \
            [json.loads(line) for line in open(whole)][0]["selected"]
    assert [len(p) for p in parts] == [2, 2, 2]  # 6 cases: 4 sampled, 2 refusals
    assert sorted(sum(parts, [])) == sorted(_ran(whole)) and len(set(sum(parts, []))) == 6
    assert sum(parts, []) != _ran(whole)  # interleaved, not cut in three runs of the order
    for bad in ("3/3", "1", "a/b"):
        monkeypatch.setenv("FA_SHARD", bad)
        r = _run_plugin(tmp_path, 4, str(tmp_path / "bad.jsonl"))
        assert r.returncode == 4 and "FA_SHARD" in r.stderr, r.stdout + r.stderr
