"""fastattn._core without a GPU: its type stub, its slot table and argument handling
that happens before any CUDA call.

A Plan made with Plan.__new__ has no graphs, so execute refuses it ("not a forward
graph") before touching cuDNN or CUDA: enough to see what forward and backward do
with their arguments on a machine with no GPU.
"""

import ast
import inspect
import re

import numpy as np
import pytest

from fastattn import errors

from helpers.paths import ROOT

_core = pytest.importorskip("fastattn._core", reason="the extension is not built")

STUB = ROOT / "fastattn" / "_core.pyi"


def _stub_tree():
    return ast.parse(STUB.read_text())


def _stub_top_level():
    names = set()
    for node in _stub_tree().body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if not n.startswith("_")}  # private: the stub's own protocols


def _stub_plan_methods():
    (plan,) = [n for n in _stub_tree().body if isinstance(n, ast.ClassDef) and n.name == "Plan"]
    return {n.name: n for n in plan.body if isinstance(n, ast.FunctionDef)}


def test_stub_names_are_the_modules():
    defined = {name for name, obj in vars(_core).items()
               if not name.startswith("_") and getattr(obj, "__module__", None) == "fastattn._core"}
    defined.add("SLOT_NAMES")  # a tuple has no __module__
    assert _stub_top_level() == defined


def test_stub_plan_members_are_the_plans():
    built = {name for name in dir(_core.Plan) if not name.startswith("_")}
    assert set(_stub_plan_methods()) == built


@pytest.mark.parametrize("method", ["forward", "backward"])
def test_stub_signatures_match_the_built_ones(method):
    stub = _stub_plan_methods()[method].args
    built = inspect.signature(getattr(_core.Plan, method))
    stub_params = [a.arg for a in stub.args] + [a.arg for a in stub.kwonlyargs]
    assert stub_params == list(built.parameters)
    kwonly = [n for n, p in built.parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert [a.arg for a in stub.kwonlyargs] == kwonly
    defaults = {n: p.default for n, p in built.parameters.items() if p.default is not inspect.Parameter.empty}
    stub_defaults = dict(zip([a.arg for a in stub.args][-len(stub.defaults):], stub.defaults)) if stub.defaults else {}
    stub_defaults.update({a.arg: d for a, d in zip(stub.kwonlyargs, stub.kw_defaults) if d is not None})
    assert {n: ast.literal_eval(d) for n, d in stub_defaults.items()} == defaults


def test_slot_names_are_the_one_slot_table():
    # fastattn_abi.h's X-macro table is the only list of slots: C, C++ and _core read it.
    header = (ROOT / "fastattn" / "include" / "fastattn_abi.h").read_text()
    assert tuple(re.findall(r'^\s*X\(\w+, \w+, "(\w+)", "', header, re.M)) == _core.SLOT_NAMES
    assert len(_core.SLOT_NAMES) == len(set(_core.SLOT_NAMES)) == 45
    for src in ("csrc/fastattn.h", "csrc/attention.cpp", "fastattn/include/fastattn_abi.h"):
        text = (ROOT / src).read_text()
        assert '"seq_len_q"' not in text or src.endswith("fastattn_abi.h"), f"{src} spells a slot out again"


def test_status_codes_are_the_exception_table():
    # fastattn_abi.h's status table and fastattn.errors' code -> class table agree, so the
    # op library (which raises through error_for_code) and _core raise the same classes.
    assert _core.status_codes() == {cls.__name__: code for code, cls in errors._BY_CODE.items()}
    for name, code in _core.status_codes().items():
        assert type(errors.error_for_code(code, "m")).__name__ == name


def test_enum_values_are_the_headers():
    header = (ROOT / "csrc" / "fastattn.h").read_text()
    assert "enum class DType : int { kFp16 = 0, kBf16 = 1, kFp8E4m3 = 2, kFp8E5m2 = 3 };" in header
    for name, value in (("kNone", 0), ("kCausal", 1), ("kCausalBottomRight", 2)):
        assert re.search(rf"\b{name}\s*=\s*{value},", header), name


def _bare_plan():
    return _core.Plan.__new__(_core.Plan)


def test_plan_cannot_be_constructed_directly():
    with pytest.raises(TypeError, match="fastattn.plan"):
        _core.Plan()


@pytest.mark.parametrize("address", [16, np.int64(16), np.uint64(32), True])
def test_int_and_integer_like_addresses_reach_the_core(address):
    # The core refuses the graphless plan: the address itself was accepted.
    with pytest.raises(errors.InvalidArgumentError, match="not a forward graph"):
        _bare_plan().forward(address, 16, 16, 16)


@pytest.mark.parametrize("name,index", [("q", 0), ("v", 2), ("o", 3)])
def test_a_non_address_is_a_type_error_naming_the_tensor(name, index):
    args = [16, 16, 16, 16]
    args[index] = 1.5
    with pytest.raises(TypeError, match=rf"^{name}= takes a device address \(int\) or a device array .*got float"):
        _bare_plan().forward(*args)


@pytest.mark.parametrize("kw", ["workspace", "bias", "page_table_v"])
def test_a_non_address_keyword_is_named(kw):
    with pytest.raises(TypeError, match=rf"^{kw}= takes a device address"):
        _bare_plan().forward(16, 16, 16, 16, **{kw: "0x10"})


def test_a_stream_that_is_no_stream_is_named():
    with pytest.raises(TypeError, match="^stream= takes a cudaStream_t as an int or an object with __cuda_stream__"):
        _bare_plan().forward(16, 16, 16, 16, stream="0x10")


def test_host_arrays_are_refused_before_the_core():
    with pytest.raises(errors.InvalidArgumentError, match=r"^k: device memory needed, got host memory \(numpy"):
        _bare_plan().forward(16, np.zeros((2, 2), np.float16), 16, 16)


def test_backward_needs_a_training_plan_before_anything_else():
    with pytest.raises(errors.InvalidArgumentError, match="training=True"):
        _bare_plan().backward(*([16] * 9))


def test_an_address_out_of_range_is_an_overflow_error():
    with pytest.raises(OverflowError):
        _bare_plan().forward(1 << 70, 16, 16, 16)
