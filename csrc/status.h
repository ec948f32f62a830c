// What every file of the core uses to make and pass statuses: a status from a code and
// a message, an early return on a failed one, and the boundary that turns a C++
// exception into a status. Header-only; needs no cudnn-frontend.
#pragma once

#include <chrono>
#include <exception>
#include <string>
#include <utility>

#include "fastattn.h"

#define FA_RETURN_IF_ERROR(expr)         \
    do {                                 \
        ::fastattn::Status _st = (expr); \
        if (!_st.ok()) return _st;       \
    } while (0)

namespace fastattn::detail {

inline Status error(Code code, std::string message) { return Status{code, std::move(message)}; }

inline double ms_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// Runs fn and turns any C++ exception into a status with `code`: nothing crosses
// the boundary (cudnn-frontend throws from graph construction, blob parsing and
// its dynamic loader; an uncaught throw aborts the Python process).
template <class Fn>
Status guarded(Code code, const char *what, Fn &&fn) {
    try {
        return fn();
    } catch (const std::exception &e) {
        return error(code, std::string(what) + ": " + e.what());
    } catch (...) {
        return error(code, std::string(what) + ": unknown C++ exception");
    }
}

}  // namespace fastattn::detail
