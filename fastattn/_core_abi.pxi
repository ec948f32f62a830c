# Included by _core.pyx.
# -- the C ABI for native code outside _core (fastattn/include/fastattn_abi.h) -------------------
# The PyTorch op library executes plans through this table instead of compiling
# cudnn-frontend again: its statics (the loaded libcudnn, handles, caches) stay here, once.

from cpython.pycapsule cimport PyCapsule_New
from libc.string cimport strncpy

cdef extern from "fastattn_abi.h" nogil:
    ctypedef struct fastattn_abi:
        int version
        int num_slots
        int (*execute)(const void*, int, int, const intptr_t*, intptr_t, intptr_t, char*, size_t) noexcept nogil
        int (*stream_capturing)(intptr_t) noexcept nogil
    int FASTATTN_ABI_VERSION
    int FASTATTN_NUM_SLOTS

assert FASTATTN_NUM_SLOTS == <int>kNumSlots, "fastattn_abi.h's slots differ from fastattn.h's"


cdef int _abi_execute(const void* graph, int direction, int device, const intptr_t* slots, intptr_t workspace,
                      intptr_t stream, char* message, size_t message_size) noexcept nogil:
    cdef Status st = execute(<const Graph*>graph, <Direction>direction, device, slots, workspace, stream)
    if st.ok():
        return 0
    if message_size:
        strncpy(message, st.message.c_str(), message_size - 1)
        message[message_size - 1] = 0
    return <int>st.code


cdef int _abi_stream_capturing(intptr_t stream) noexcept nogil:
    cdef cbool capturing = False
    if not stream_capturing(stream, &capturing).ok():
        return -1
    return 1 if capturing else 0


cdef fastattn_abi _ABI
_ABI.version = FASTATTN_ABI_VERSION
_ABI.num_slots = FASTATTN_NUM_SLOTS
_ABI.execute = _abi_execute
_ABI.stream_capturing = _abi_stream_capturing


def abi_capsule():
    """The C ABI table (fastattn_abi.h) as a PyCapsule named "fastattn._core.abi". The
    table is static: valid as long as this module is loaded, which is for the process."""
    return PyCapsule_New(<void*>&_ABI, b"fastattn._core.abi", NULL)


def abi_graphs(Plan plan):
    """(forward, backward) graph addresses of `plan` for fastattn_abi.execute (backward 0
    without training). Valid while `plan` lives: the caller keeps a reference to it."""
    return <intptr_t>plan._fwd.get(), <intptr_t>plan._bwd.get()
