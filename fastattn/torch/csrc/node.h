// How the op library's autograd nodes (autograd.cpp's <Op>Backward, generated from the ops'
// specs) are made and owned: a torch::autograd::Node of their own, as PyTorch's generated
// ops have (its cuDNN attention's is ScaledDotProductCudnnAttentionBackward0), not a
// torch::autograd::Function, which packs its inputs into a variable list, keeps the
// options in a string-keyed map of IValues and wraps its outputs generically on every
// forward, and unpacks all of that again in backward.
#pragma once

#include <torch/csrc/autograd/function.h>

#include <memory>
#include <type_traits>
#include <utility>

namespace fastattn::ops {

// How torch owns nodes: std::shared_ptr<Node> up to 2.12, c10::intrusive_ptr<Node> since.
using NodePtr = decltype(std::declval<torch::autograd::Node &>().getptr());

template <class T>
void delete_node(T *node) {
    deleteNode(node);  // torch::autograd::deleteNode (found by ADL; only torch's with shared_ptr nodes has it)
}

// A new node of type T, owned as torch owns nodes.
template <class T>
auto new_node() {
    if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>) {
        // As torch's own: deleteNode frees a long chain of nodes without deep recursion.
        return std::shared_ptr<T>(new T(), [](T *node) { delete_node(node); });
    } else {
        return c10::make_intrusive<T>();
    }
}

}  // namespace fastattn::ops
