"""The dtypes' names and facts are one table (fastattn.dtypes): every other spelling in the
package is derived from it, and the table agrees with numpy's and torch's own facts."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from fastattn import _arrays, _fields, config, dtypes, verdict, verify

from helpers import paths

ATTENTION = [d for d in dtypes.ROWS if d.attention]
TORCH_ATTRS = {d.torch for d in ATTENTION} | {"half"}


def _tables(tree: ast.AST):
    """(line, the dtypes it names) of each dict, tuple, list or set display naming two or
    more attention dtypes, by any of their names or as torch.<dtype> attributes."""
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Dict, ast.Tuple, ast.List, ast.Set)):
            continue
        elts = [e for e in (node.keys + node.values if isinstance(node, ast.Dict) else node.elts) if e is not None]
        named = {dtypes.ALIASES[e.value] for e in elts if isinstance(e, ast.Constant) and e.value in dtypes.ALIASES}
        named |= {e.attr for e in elts if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name)
                  and e.value.id == "torch" and e.attr in TORCH_ATTRS}
        if len(named) >= 2:
            yield node.lineno, sorted(named)


def test_no_module_spells_a_table_of_dtypes_but_the_one():
    # A collection of two or more dtype names (or torch dtypes) is a table kept by hand: it
    # is derived from fastattn.dtypes instead. One name alone (a default) is not a table.
    root = paths.ROOT / "fastattn"
    found = [f"{p.relative_to(paths.ROOT)}:{line}: {named}"
             for p in sorted(root.rglob("*.py")) if p != root / "dtypes.py"
             for line, named in _tables(ast.parse(p.read_text()))]
    assert found == [], "\n".join(found)


def test_the_check_sees_a_table():
    source = ('A = ("fp16", "bf16")\nB = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 1.0}\n'
              'C = {"half": 1, "torch.float16": 2}\nD = (torch.int32, torch.int64)\nE = {"dtype": "bf16"}\n')
    assert [line for line, _ in _tables(ast.parse(source))] == [1, 2]


def test_every_spelling_has_the_tables_names():
    assert config.DTYPES == tuple(d.name for d in ATTENTION) == next(f for f in config.FIELDS if f.name == "dtype").metadata["choices"]
    assert config.FP8_DTYPES == tuple(d.name for d in ATTENTION if d.fp8) == ("fp8_e4m3", "fp8_e5m2")
    assert config.DTYPES == ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2")  # the C++ DType enum's values, in order
    assert set(_fields._DTYPE_ALIASES.values()) == set(config.DTYPES)
    assert set(config._ITEMSIZE) == {d.name for d in dtypes.ROWS}
    assert set(_arrays._NUMPY_NAMES) == {d.name for d in dtypes.ROWS}
    assert set(_arrays._ITEMSIZE) == set(_arrays._NUMPY_NAMES.values())
    assert set(_arrays._TYPESTR) <= set(_arrays._ITEMSIZE) and set(_arrays._ML_DTYPES) <= set(_arrays._ITEMSIZE)
    assert tuple(verdict.TOLERANCE) == tuple(verify.UNIT_ROUNDOFF) == verify._TORCH_DTYPES == dtypes.VERIFIED
    assert dtypes.VERIFIED == dtypes.SIXTEEN_BIT == ("fp16", "bf16")


def test_the_cli_takes_the_tables_names():
    from fastattn.cli._main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.choices and "warm" in a.choices).choices
    warm = next(a for a in sub["warm"]._actions if a.dest == "dtype")
    matrix = next(a for a in sub["matrix"]._actions if a.dest == "dtypes")
    assert tuple(warm.choices) == dtypes.SIXTEEN_BIT and tuple(matrix.default) == dtypes.SIXTEEN_BIT


def test_the_table_agrees_with_numpy():
    np = pytest.importorskip("numpy")
    for d in dtypes.ROWS:
        if d.ml_dtypes:
            continue
        assert np.dtype(d.numpy).itemsize == d.itemsize, d
        assert d.typestr == np.dtype(d.numpy).str, d
    assert {d.name for d in dtypes.ROWS if d.typestr is None} == {"bf16", "fp8_e4m3", "fp8_e5m2"}


def test_the_table_agrees_with_torch():
    torch = pytest.importorskip("torch")
    for d in dtypes.ROWS:
        t = getattr(torch, d.torch)
        assert t.itemsize == d.itemsize, d
        if d.attention:
            assert dtypes.ALIASES[str(t)] == d.name and dtypes.ALIASES[d.numpy] == d.name
        if d.fp8_max is not None:
            assert torch.finfo(t).max == d.fp8_max, d
        if d.unit_roundoff is not None:
            assert torch.finfo(t).eps / 2 == d.unit_roundoff, d
    assert dtypes.torch_dtypes(torch, dtypes.FP8_DTYPES) == {torch.float8_e4m3fn: "fp8_e4m3",
                                                              torch.float8_e5m2: "fp8_e5m2"}
    from fastattn.torch import _fp8, _fp8_scaled, _plans

    assert _plans.DTYPES == {torch.float16: "fp16", torch.bfloat16: "bf16"}
    assert list(_fp8.OUT) == [torch.float8_e4m3fn, torch.float8_e5m2, torch.float16, torch.bfloat16]
    assert _fp8_scaled.FP8_MAX == {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def test_the_table_imports_without_torch():
    code = "import sys, fastattn.dtypes, fastattn.config; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=paths.ROOT)
