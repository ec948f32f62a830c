"""The op library's per-op C++ (fastattn/torch/_kernels.py), generated from the ops' specs
at its build, without a compiler: what each op's work fills, allocates and returns follows
its spec as the Python executor's does, its autograd node takes the spec's differentiable
inputs, its ops are registered with the Python ops' schemas, and the source is one a
person can read. test_torch_native.py builds and loads it (its Meta kernels and autograd
on meta tensors); the GPU suite's bitwise parity tests (test_torch_native_gpu.py) run it
against the Python executor."""

import re

import pytest

pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

from fastattn._slots import NO, SLOTS, upper  # noqa: E402
from fastattn.torch import _kernels, _native, _specs  # noqa: E402

SOURCE = _kernels.source()
AUTOGRAD = _kernels.autograd()
REGISTRATION = _kernels.registration()
TAKES = {"forward": {s.name for s in SLOTS if s.forward is not NO},
         "backward": {s.name for s in SLOTS if s.backward is not NO}}


def function(name: str, source: str = SOURCE) -> str:
    """The body of the generated function `name` (in kernels.cpp, or `source`)."""
    start = re.search(rf"^\S.* {name}\(", source, re.M)
    assert start, name
    end = source.index("\n}\n", start.end())
    return source[start.start():end]


def filled(body: str) -> set[str]:
    return set(re.findall(r"slots\[FASTATTN_SLOT_(\w+)\]", body))


def test_each_ops_work_fills_the_slots_its_spec_names():
    for spec in _kernels.NATIVE:
        forward = function(f"{spec.name}_forward")
        expected = {upper(slot) for i in spec.inputs for slot, _ in i.slots if slot in TAKES["forward"]}
        expected |= {upper(o.slot) for o in spec.outputs}
        assert filled(forward) == expected, spec.name
        if spec.backward_op:
            backward = function(f"{spec.name}_backward")
            expected = {upper(slot) for i in spec.inputs for slot, _ in i.slots if slot in TAKES["backward"]}
            expected |= {"O", "DO", "STATS"} | {upper(i.grad) for i in spec.differentiable()}
            assert filled(backward) == expected, spec.name


def test_an_input_filling_a_slot_at_an_offset_fills_it_only_when_given():
    forward = function("dense_forward")
    assert "slots[FASTATTN_SLOT_OFFSET] = given(rng) ? ptr(*rng) + 16 : 0;" in forward
    assert "slots[FASTATTN_SLOT_SEED] = ptr(rng);" in forward


def test_outputs_past_a_sequences_length_are_zeroed_where_the_spec_says():
    for spec in _kernels.NATIVE:
        forward = function(f"{spec.name}_forward")
        assert ("at::zeros(" in forward) == bool(spec.padded_by), spec.name
        if spec.padded_by:
            assert f"given({spec.padded_by}) ? at::zeros(" in forward


def test_an_absent_input_takes_the_op_librarys_function_of_its_name():
    forward = function("paged_forward")
    absent = [i for i in _specs.PAGED.inputs if i.absent]
    assert absent
    for i in absent:
        assert f"given({i.name}) ? *{i.name} : {i.absent}(q)" in forward


def test_the_autograd_node_has_an_edge_per_differentiable_input_and_one_style():
    for spec in _kernels.NATIVE:
        if not spec.backward_op:
            assert f"{spec.name}_recorded" not in AUTOGRAD
            continue
        node = spec.name.capitalize() + "Backward"
        assert f"struct {node} final : torch::autograd::Node" in AUTOGRAD
        edges = ", ".join(i.name for i in spec.differentiable())
        assert f"collect_next_edges({edges})" in function(f"{spec.name}_recorded", AUTOGRAD)
        assert f"variable_list out({len(spec.differentiable())});" in AUTOGRAD
    assert "torch::autograd::Function" not in AUTOGRAD and "AutogradContext" not in AUTOGRAD


def test_kernels_cpp_compiles_without_autograds_headers():
    # Autograd's headers cost more to compile than kernels.cpp's own code with ATen's: the
    # library builds as long as its slowest unit, so they stay in autograd.cpp alone.
    assert "torch/csrc/autograd" not in SOURCE and '"node.h"' not in SOURCE
    assert "torch/csrc/autograd/function.h" in AUTOGRAD


def test_the_ops_are_registered_with_the_python_ops_schemas():
    # Adjacent string literals joined: each m.def's schema, as the dispatcher reads it.
    defs = [re.sub(r'"\s*"', "", d) for d in re.findall(r'm\.def\(("(?:[^;])*?")\);', REGISTRATION, re.S)]
    expected = []
    for spec in _kernels.NATIVE:
        expected.append(f'"native_{spec.forward_op}{_specs.forward_schema(spec)}"')
        if spec.backward_op:
            expected.append(f'"native_{spec.backward_op}{_specs.backward_schema(spec)}"')
    assert defs == expected
    for key in ("CUDA", "Meta", "CPU", "Autograd"):
        assert f"TORCH_LIBRARY_IMPL(fastattn, {key}, m)" in REGISTRATION
    assert "TORCH_LIBRARY" not in SOURCE + AUTOGRAD  # (registration.cpp alone: a unit of its own)


def test_every_registered_kernel_is_declared_and_defined():
    """registration.cpp takes each kernel's address by its declaration in fastattn_kernels.h, which
    must be kernels.cpp's definition: a declaration that differs would leave the library with an
    undefined symbol that only the library's import finds."""
    registered = set(re.findall(r"&(\w+)\);", REGISTRATION))
    assert registered and {f"{s.name}_forward_cuda" for s in _kernels.NATIVE} <= registered
    flat = lambda text: re.sub(r"\s+", " ", text)  # noqa: E731  (the two wrap their lines apart)
    header, source = flat(_kernels.header()), flat(SOURCE + AUTOGRAD)
    for name in registered:
        declaration = re.search(rf"; ([^;]* {name}\([^;]*\));", header)
        assert declaration, name
        assert f"{declaration.group(1)} {{" in source, name


def test_the_generated_source_is_readable():
    for text in (SOURCE, AUTOGRAD, REGISTRATION, _kernels.header()):
        lines = text.splitlines()
        assert lines[0].startswith("// Generated from fastattn/torch/_specs.py by fastattn/torch/_kernels.py")
        assert [line for line in lines if len(line) > 120] == []
        assert [line for line in lines if line != line.rstrip()] == []


def test_the_build_writes_the_kernels_beside_the_option_headers(tmp_path):
    folder = _native.write_generated(tmp_path / "generated")
    assert sorted(p.name for p in folder.iterdir()) == ["autograd.cpp", "fastattn_calls.h", "fastattn_kernels.h",
                                                         "fastattn_options.h", "kernels.cpp", "registration.cpp"]
    assert (folder / "kernels.cpp").read_text() == SOURCE
    assert (folder / "autograd.cpp").read_text() == AUTOGRAD
    assert (folder / "registration.cpp").read_text() == REGISTRATION
    assert set(_native.GENERATED) <= {p.name for p in folder.iterdir()}
