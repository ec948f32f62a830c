# Included by _core.pyx: the benchmark hooks of benchmarks/ (csrc/bench.h), kept apart from
# the production interface (Plan.forward / Plan.backward and the C ABI).

cdef extern from "bench.h" namespace "fastattn::bench" nogil:
    cdef enum class Mode(int):
        kFastattn
        kFrontendSorted
        kFrontendUidMap
        kFrontendSortedPreamble
        kFastattnPacksOnly

    Status time_execute(const Graph* g, Direction dir, int device, const intptr_t* slots, intptr_t workspace,
                        intptr_t stream, Mode mode, int iters, int layers, int64_t layer_bytes, double* seconds)
    uint64_t graph_slots(const Graph* g)
    bint direct_launch(const Graph* g)
    void pack_counts(uint64_t* hits, uint64_t* misses, uint64_t* replays)


cdef dict _BENCH_MODES = {"fastattn": 0, "frontend_sorted": 1, "frontend_uid_map": 2, "frontend_sorted_preamble": 3,
                          "fastattn_packs_only": 4}


cdef const Graph* _bench_graph(Plan plan, str direction) except NULL:
    """The plan's graph of `direction` ("forward" or "backward"), or InvalidArgumentError."""
    cdef const Graph* g = plan._fwd.get() if direction == "forward" else plan._bwd.get()
    if direction not in ("forward", "backward") or g == NULL:
        raise InvalidArgumentError(f"direction={direction!r}: this plan has no such graph")
    return g


def bench_execute(Plan plan, str direction, str mode, int iters, intptr_t workspace=0, intptr_t stream=0, *,
                  int layers=1, int64_t layer_bytes=0, **tensors):
    """Seconds for `iters` launches of the plan's `direction` graph looped in C++, in
    `mode`: "fastattn" (the C++ execute behind plan.forward/backward, checks included),
    "frontend_sorted" (cudnn-frontend's cheapest execute on the same plan, no checks,
    device and stream set once: the floor), "frontend_sorted_preamble" (the same with
    device, handle and stream set per call, as a caller of cudnn-frontend pays them),
    "frontend_uid_map" (its uid-map execute, the map built per call) or
    "fastattn_packs_only" ("fastattn" with CUDA graph replays off for the loop).
    `tensors`: device addresses by name, as forward/backward take them (with
    config.host_seed, seed and offset are the values). Call i runs layer i % `layers`,
    whose device tensors are `tensors` moved by layer * `layer_bytes` (a model's layers,
    each with its own tensors, the workspace shared). For benchmarks/ and tests only: a
    hook outside the production interface (csrc/bench.h)."""
    cdef intptr_t t[kNumSlots]
    cdef int64_t host[2]
    cdef double seconds = 0
    cdef Status st
    cdef Direction d = Direction.kForward if direction == "forward" else Direction.kBackward
    cdef const Graph* g = _bench_graph(plan, direction)
    if mode not in _BENCH_MODES:
        raise InvalidArgumentError(f"mode={mode!r} is not one of {sorted(_BENCH_MODES)}")
    memset(t, 0, sizeof(t))
    for name, value in tensors.items():
        if name not in SLOT_NAMES:
            raise InvalidArgumentError(f"{name}= is not a tensor of fastattn's plans")
        t[SLOT_NAMES.index(name)] = value
    if plan._c.host_seed:
        host[0] = t[kSlotSeed]
        host[1] = t[kSlotOffset]
        t[kSlotSeed] = <intptr_t>&host[0]
        t[kSlotOffset] = <intptr_t>&host[1]
    cdef Mode m = <Mode><int>_BENCH_MODES[mode]
    with nogil:
        st = time_execute(g, d, plan.device, t, workspace, stream, m, iters, layers, layer_bytes, &seconds)
    if not st.ok():
        raise _error(st)
    return seconds


def bench_raw_execute(Plan plan, str direction, ptrs, intptr_t workspace=0, intptr_t stream=0, int iters=1000):
    """bench_execute(plan, direction, "frontend_sorted", ...) with the graph's tensors
    given in uid order (q, k, v, o, stats, d_o, d_q, d_k, d_v, then the features' in
    fastattn.h's Slot order), as the benchmarks passed them before bench_execute existed."""
    cdef const Graph* g = plan._fwd.get() if direction == "forward" else plan._bwd.get()
    cdef uint64_t mask = graph_slots(g)
    names = [SLOT_NAMES[s] for s in range(kNumSlots) if mask & ((<uint64_t>1) << s)]
    if len(ptrs) != len(names):
        raise InvalidArgumentError(f"{direction} takes {len(names)} tensors ({', '.join(names)}), got {len(ptrs)}")
    return bench_execute(plan, direction, "frontend_sorted", iters, workspace, stream, **dict(zip(names, ptrs)))


def bench_direct_launch(Plan plan, str direction):
    """Whether execute launches the plan's `direction` graph through cached variant packs
    (csrc/packs.h) rather than cudnn-frontend's execute."""
    return direct_launch(_bench_graph(plan, direction))


def bench_pack_counts():
    """(hits, misses, replays) of the calling thread's variant-pack cache (csrc/packs.h):
    launches that found their pack, that made one, and that replayed a captured graph."""
    cdef uint64_t hits = 0, misses = 0, replays = 0
    pack_counts(&hits, &misses, &replays)
    return hits, misses, replays
