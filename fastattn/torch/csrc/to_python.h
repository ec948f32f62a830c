// An op's options as the tuple of its Python NamedTuple's fields (under the GIL): what the
// op library hands the Python side (ops.cpp: a miss's options, an SDPA route's) and what the
// tests' readers extension (tests/pytorch/csrc/readers.cpp) returns, one conversion for both.
#pragma once

#include <torch/csrc/utils/pybind.h>  // first: Python.h, then pybind11 with torch's casters

#include <type_traits>

#include <c10/util/string_view.h>

namespace fastattn::ops {

template <class Options>
pybind11::tuple to_python(const Options &opt) {
    pybind11::list out;
    opt.each([&out](const auto &value) {
        if constexpr (std::is_same_v<std::decay_t<decltype(value)>, c10::string_view>) {
            out.append(pybind11::str(value.data(), value.size()));
        } else {
            out.append(value);
        }
    });
    return pybind11::tuple(out);
}

}  // namespace fastattn::ops
