"""The ops' specs (fastattn/torch/_specs.py) and the executor made from them
(_executor), without a GPU: each spec fills every slot its op's configs use and no other,
its options agree with the field registry (kinds, docs, off values) and their off values
round-trip to the config's and to the C++ core's, its shape rules agree with the plan
entries and the fake kernels, and its launches hand the plan exactly its slots."""

import dataclasses
import itertools

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

from fastattn import AttentionConfig, InvalidArgumentError  # noqa: E402
from fastattn._fields import has_off  # noqa: E402
from fastattn._slots import NO, SLOTS  # noqa: E402
from fastattn.config import FIELDS  # noqa: E402
from fastattn.torch import _dense, _executor, _options, _paged, _plans, _specs, _varlen  # noqa: E402

MODULES = {"dense": _dense, "varlen": _varlen, "paged": _paged}
REGISTRY = {f.name: f for f in FIELDS}
BF16 = torch.bfloat16


# -- options and the registry --------------------------------------------------------------------

def registry_off(option: _specs.Option):
    """What the option's field is when the feature is off: its off value, else its default."""
    f = REGISTRY[option.field]
    return f.metadata["off"] if has_off(f) else f.default


@pytest.mark.parametrize("op", [*_specs.SPECS, "fp8"])
def test_every_option_is_its_registry_fields(op):
    kinds = {"bool": "bool", "int": "int", "positive": "float", "probability": "float", "pair": "int",
             "layout": "str", "choice": "str", "dtype": "str"}
    for o in _specs.options_of(op):
        f = REGISTRY[o.field]
        meta = f.metadata
        if o.name in ("causal", "bottom_right"):  # the flags that stand for the mask and the alignment
            assert (o.field, o.kind, o.off) == ({"causal": "mask", "bottom_right": "alignment"}[o.name], "bool", False)
            continue
        assert o.kind == kinds[meta["kind"]], o.name
        if meta["kind"] == "pair":  # a pair's options are its C++ members
            assert o.name in meta["cxx"].names
        if o.kind == "str":
            assert o.choices == tuple(meta["choices"]), o.name
        if o.name == o.field:
            assert o.doc == meta["help"], o.name
        value = registry_off(o)
        if meta["kind"] == "pair":
            value = value[meta["cxx"].names.index(o.name)]
        if value is not dataclasses.MISSING:
            assert o.off == ({"bool": False, "int": 0, "float": 0.0, "str": ""}[o.kind] if value is None else value)


def test_the_op_librarys_options_are_the_specs_in_their_kind_order():
    assert _options.OPS == {name: s.options for name, s in _specs.SPECS.items()}
    header = _options.cpp_header()
    for spec in _specs.SPECS.values():
        for o in spec.options:  # each member, initialized to its off value
            assert f" {o.name}{_specs.cpp_initializer(o)};  // {_specs.describe(o)}" in header
    assert "int64_t window_left = -1;" in header and "double softcap{};" in header


def _all_off(op: str):
    cls = _specs.named_tuple(op, "Options")
    values = {o.name: o.off for o in _specs.options_of(op)}
    values.update(layout="bshd", max_q=64, max_kv=64)
    return cls(**{n: values[n] for n in cls._fields})


@pytest.mark.parametrize("op", list(_specs.SPECS))
def test_the_off_value_of_every_option_round_trips_to_the_configs_off(op):
    fields = _specs.config_fields(_all_off(op))
    for o in _specs.options_of(op):
        if o.name in ("layout", "max_q", "max_kv"):  # the tensors' strides; a packed plan's lengths
            continue
        expected = registry_off(o)
        if o.field == "deterministic":
            expected = False
        assert fields[o.field] == expected, o.name
    # Off options leave the config, so its cache key, as a config made without them.
    base = dict(batch=2, heads_q=4, seqlen_q=64, seqlen_kv=64, head_dim_qk=64)
    given = {k: v for k, v in fields.items() if k not in ("seqlen_q", "seqlen_kv")}
    assert AttentionConfig(**base, **given).to_json() == AttentionConfig(**base).to_json()


@pytest.mark.parametrize("op", list(_specs.SPECS))
def test_an_off_option_is_the_value_the_cxx_core_holds_for_the_off_field(op):
    # One spelling of "off": an option that is a member of the core's Config holds what
    # the core holds when the field is off (softcap 0.0 for None, the window's -1s).
    _core = pytest.importorskip("fastattn._core", reason="the extension is not built")
    fields = _specs.config_fields(_all_off(op))
    cfg = AttentionConfig(batch=2, heads_q=4, seqlen_q=64, seqlen_kv=64, head_dim_qk=64,
                          **{k: v for k, v in fields.items() if k not in ("seqlen_q", "seqlen_kv")})
    members = _core._config_fields(cfg)
    checked = 0
    for o in _specs.options_of(op):
        f = REGISTRY[o.field]
        if o.name in members and (has_off(f) or f.default is not None):  # (scale's None the config resolves)
            assert members[o.name] == o.off, o.name
            checked += 1
    assert checked >= 4


@pytest.mark.parametrize("op", list(_specs.SPECS))
def test_config_fields_reads_each_options_value_back(op):
    # Not only the off values: a value given becomes the field's (the zero that stands for
    # None aside), so the conversion is one way to spell the same config.
    opts = _all_off(op)
    for o in _specs.options_of(op):
        if o.kind != "float" or o.name not in ("scale", "softcap", "dropout"):
            continue
        assert _specs.config_fields(opts._replace(**{o.name: 0.25}))[o.field] == 0.25


# -- slots ------------------------------------------------------------------------------------------

_FORWARD = {s.name: s.forward for s in SLOTS if s.index is not None}
_BACKWARD = {s.name: s.backward for s in SLOTS if s.index is not None}
_RAGGED = {"seq_len_q", "seq_len_kv", "ragged_q", "ragged_k", "ragged_v", "ragged_o", "ragged_stats"}


def used_slots(cfg: AttentionConfig, backward: bool) -> set[str]:
    """The slots a config's graph takes (csrc/slots.cpp's slot_mask, from the config's own
    tensors): the core tensors, stats when training, each feature's tensors, d_bias only
    with bias_grad; a ragged plan given cumulative lengths takes them in place of its
    lengths and offsets."""
    table = _BACKWARD if backward else _FORWARD
    out = set()
    for name, how in table.items():
        if how is NO:
            continue
        try:
            cfg.shape(name)
        except InvalidArgumentError:
            continue
        if name == "stats" and not (backward or cfg.training):
            continue
        if name == "d_bias" and not cfg.bias_grad:
            continue
        out.add(name)
    if cfg.ragged:
        out = (out - _RAGGED) | {"cu_seqlens_q", "cu_seqlens_kv"}
    return out


def filled_slots(spec: _specs.Spec, given: dict, options, backward: bool) -> set[str]:
    """The slots the spec fills for these inputs (name -> given) and options."""
    table = _BACKWARD if backward else _FORWARD
    out = {slot for i in spec.inputs if given[i.name] or i.absent for slot, _ in i.slots}
    if backward:
        out |= {"o", "d_o", "stats"}
        out |= {i.grad for i in spec.inputs if i.grad and (
            not i.grad_if or (given[i.name] and (i.grad_if == "given" or getattr(options, i.grad_if))))}
    else:
        out |= {o.slot for o in spec.outputs if not o.training_only or options.training}
    return {s for s in out if table.get(s) is not NO}


def dense_calls():
    for padded, bias, sink, dropout, training in itertools.product([False, True], repeat=5):
        q, k, v = (torch.empty(2, 64, h, 64, device="meta", dtype=BF16) for h in (4, 2, 2))
        lens = torch.empty(2, device="meta", dtype=torch.int32) if padded else None
        given = dict(q=q, k=k, v=v, seq_len_q=lens, seq_len_kv=lens,
                     bias=torch.empty(1, 4, 64, 64, device="meta", dtype=BF16) if bias else None,
                     sink=torch.empty(4, device="meta") if sink else None,
                     rng=torch.empty(4, device="meta", dtype=torch.int64) if dropout else None)
        options = _dense.DenseOptions("bshd", True, False, -1, -1, 0.0, False, False, training,
                                      0.1 if dropout else 0.0, bias and training, 0.0)
        cfg = _dense.config_for(q, k, v, None, lens, lens, given["bias"], given["sink"], options)
        yield given, options, cfg


def varlen_calls():
    for sink, dropout, training in itertools.product([False, True], repeat=3):
        q, k, v = (torch.empty(100, h, 64, device="meta", dtype=BF16) for h in (4, 2, 2))
        cu = torch.empty(3, device="meta", dtype=torch.int32)
        given = dict(q=q, k=k, v=v, cu_q=cu, cu_kv=cu, sink=torch.empty(4, device="meta") if sink else None,
                     rng=torch.empty(4, device="meta", dtype=torch.int64) if dropout else None)
        options = _varlen.VarlenOptions(64, 64, False, False, -1, -1, 0.0, False, training, False,
                                        0.1 if dropout else 0.0, 0.0)
        yield given, options, _varlen.config_for(q, k, v, 2, given["sink"], options)


def paged_calls():
    for q_lens in (False, True):
        q = torch.empty(2, 4, 8, 64, device="meta", dtype=BF16)
        cache = torch.empty(16, 16, 2, 64, device="meta", dtype=BF16)
        table = torch.empty(2, 4, device="meta", dtype=torch.int32)
        lens = torch.empty(2, device="meta", dtype=torch.int32)
        given = dict(q=q, k_cache=cache, v_cache=cache, block_table=table, cache_seqlens=lens,
                     seq_lens_q=lens if q_lens else None)
        options = _paged.PagedOptions(True, True, -1, -1, 0.0, 0.0)
        yield given, options, _paged.config_for(q, cache, cache, table, given["seq_lens_q"], lens, options)


CALLS = {"dense": dense_calls, "varlen": varlen_calls, "paged": paged_calls}


@pytest.mark.parametrize("op", list(_specs.SPECS))
def test_every_ops_spec_covers_every_slot_its_config_can_use(op):
    spec = _specs.SPECS[op]
    seen = 0
    for given, options, cfg in CALLS[op]():
        given = {n: t is not None for n, t in given.items()}
        assert filled_slots(spec, given, options, False) == used_slots(cfg, False), (given, options)
        if spec.backward_op and options.training:
            assert filled_slots(spec, given, options, True) == used_slots(cfg, True), (given, options)
        seen += 1
    assert seen


def test_every_slot_a_spec_names_is_a_slot_of_the_plan():
    names = {s.name for s in SLOTS}
    for spec in _specs.SPECS.values():
        for i in spec.inputs:
            assert {slot for slot, _ in i.slots} <= names and (not i.grad or i.grad in names), i.name
        assert {o.slot for o in spec.outputs} <= names


# -- the executor: launches, shapes, fake kernels -----------------------------------------------

class RecordingPlan:
    """A plan on host memory: records the slots each launch hands it (nonzero pointers)."""

    forward_workspace_size = backward_workspace_size = 64

    def __init__(self):
        self.calls = []

    def _record(self, direction, names, args, kwargs):
        given = {n for n, a in zip(names, args) if a} | {n for n, a in kwargs.items() if a}
        self.calls.append((direction, given - {"workspace", "stream"}))

    def forward(self, *args, **kwargs):
        self._record("forward", [s.name for s in SLOTS if s.forward in ("arg", "opt")], args, kwargs)

    def backward(self, *args, **kwargs):
        self._record("backward", [s.name for s in SLOTS if s.backward in ("arg", "opt")], args, kwargs)


def cpu(t):
    if t is None:
        return None
    return torch.zeros(t.shape, dtype=t.dtype)


@pytest.mark.parametrize("op", list(_specs.SPECS))
def test_the_executor_hands_the_plan_exactly_the_slots_the_spec_fills(op, recording):
    spec, module, plan = _specs.SPECS[op], MODULES[op], recording
    for given, options, _ in CALLS[op]():
        tensors = [cpu(given[i.name]) for i in spec.inputs]
        plan.calls.clear()
        out = module.forward_impl(*tensors, options)
        present = {i.name: t is not None for i, t in zip(spec.inputs, tensors)}
        assert plan.calls == [("forward", filled_slots(spec, present, options, False))]
        if not (spec.backward_op and options.training):
            continue
        o, stats = out
        grads = module.backward_impl(torch.zeros_like(o), o, stats, *tensors, options)
        assert plan.calls[1] == ("backward", filled_slots(spec, present, options, True))
        assert len(grads) == len(spec.inputs)
        for i, t, g in zip(spec.inputs, tensors, grads):  # a gradient where the spec says, of its input's shape
            wanted = i.grad and t is not None and (not i.grad_if or i.grad_if == "given" or getattr(options, i.grad_if))
            assert (g is not None) == bool(wanted), i.name
            if g is not None:
                assert g.shape == t.shape and g.dtype == t.dtype


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "sbhd"])
def test_a_plan_entrys_shapes_are_the_specs_shape_rules(layout):
    # The executor of a spec whose plan key fixes the shapes reads o's and stats' shapes
    # from the plan's entry (_plans.CachedPlan, computed once per plan): they must be the
    # rules the fake kernels apply.
    at = dict(zip(("batch", "head", "seq", "dim"), _plans.AXES[layout]))
    shapes = {"q": (2, 8, 64, 32), "k": (2, 2, 96, 32), "v": (2, 2, 96, 48)}  # logical (b, h, s, d)

    def tensor(logical):
        shape = [0] * 4
        for axis, n in zip(("batch", "head", "seq", "dim"), logical):
            shape[at[axis]] = n
        return torch.empty(shape, device="meta", dtype=BF16)

    q, k, v = (tensor(shapes[n]) for n in "qkv")
    entry = _plans.CachedPlan(RecordingPlan(), q, k, v, layout)
    options = _dense.DenseOptions(layout, False, False, -1, -1, 0.0, False, False, True, 0.0, False)
    tensors = {"q": q, "k": k, "v": v}
    o, stats = _dense.SPEC.outputs
    assert _specs.output_shape(_dense.SPEC, o, tensors, options) == list(entry.out_shape)
    assert _specs.output_shape(_dense.SPEC, stats, tensors, options) == list(entry.stats_shape)
    q, cache = torch.empty(2, 3, 8, 32, device="meta"), torch.empty(12, 16, 2, 48, device="meta")
    entry = _plans.CachedPlan(RecordingPlan(), q, cache, cache, "bshd")
    assert _specs.output_shape(_paged.SPEC, _paged.SPEC.outputs[0], {"q": q, "v_cache": cache}, None) == \
        list(entry.out_shape) == [2, 3, 8, 48]


def test_the_fake_kernels_give_the_shapes_the_executor_gives(monkeypatch):
    monkeypatch.setattr(_dense, "check_traced", lambda *a: None)
    monkeypatch.setattr(_varlen, "check_traced", lambda *a: None)
    for given, options, _ in itertools.chain(dense_calls(), varlen_calls()):
        module = _dense if "seq_len_q" in given else _varlen
        spec = module.SPEC
        inputs = [given[i.name] for i in spec.inputs]
        with torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True):
            o, stats = module.forward_op(*inputs, *options)
        q, v = inputs[0], inputs[2]
        assert list(o.shape) == _specs.output_shape(spec, spec.outputs[0], given, options)
        assert list(o.shape)[-1] == v.shape[-1] and o.dtype == q.dtype
        assert stats.dtype == torch.float32 and list(stats.shape) == (
            _specs.output_shape(spec, spec.outputs[1], given, options) if options.training else [0])


def test_the_executors_source_is_what_runs():
    # The generated functions are the module's: tracebacks show their lines (linecache).
    import linecache

    for spec in _specs.SPECS.values():
        fn = MODULES[spec.name].forward_impl
        assert linecache.getline(fn.__code__.co_filename, fn.__code__.co_firstlineno).startswith("def forward_impl(")
        assert "def forward_impl(" in _executor.source(spec)
        assert ("def backward_impl(" in _executor.source(spec)) == bool(spec.backward_op)


def test_the_custom_ops_schemas_are_made_from_the_specs():
    for module in MODULES.values():
        spec = module.SPEC
        parse = torch._C.parse_schema
        assert module.forward_op._opoverload._schema == parse(f"fastattn::{spec.forward_op}{_specs.forward_schema(spec)}")
        if spec.backward_op:
            assert module.backward_op._opoverload._schema == \
                parse(f"fastattn::{spec.backward_op}{_specs.backward_schema(spec)}")
        else:
            assert module.backward_op is None and module.backward_impl is None


@pytest.fixture
def recording(monkeypatch):
    """Every plan lookup of the op modules answers one RecordingPlan; CPU tensors need no
    stream and no capture check."""
    plan = RecordingPlan()
    for module in MODULES.values():
        layout = None if module.SPEC.packed else "bshd"
        monkeypatch.setattr(module, "plan_for", lambda *a, layout=layout: _plans.CachedPlan(plan, a[0], a[1], a[2], layout))
        monkeypatch.setattr(module, "raw_stream", lambda device: 0)
    monkeypatch.setattr(_plans, "capturing", lambda: False)
    monkeypatch.setattr(_paged, "capturing", lambda: False)
    monkeypatch.setattr(_plans, "workspaces", {})
    return plan


@pytest.mark.parametrize("bias_grad", [False, True])
def test_a_backward_through_the_op_gives_no_gradient_the_spec_does_not_write(recording, bias_grad):
    # The backward op returns empty tensors for gradients it does not compute (its schema
    # fixes Tensors): autograd gets None for them, as from backward_impl.
    q, k, v = (torch.zeros(2, 16, h, 8, dtype=BF16) for h in (4, 2, 2))
    bias = torch.zeros(1, 4, 16, 16, dtype=BF16)
    inputs = (q, k, v, None, None, bias, None, None)
    options = _dense.DenseOptions("bshd", False, False, -1, -1, 0.0, False, False, True, 0.0, bias_grad)
    o, stats = _dense.forward_impl(*inputs, options)
    through = _dense.backward_through_op(torch.zeros_like(o), o, stats, inputs, options)
    direct = _dense.backward_impl(torch.zeros_like(o), o, stats, *inputs, options)
    expected = [True, True, True, False, False, bias_grad, False, False]
    assert [g is not None for g in through] == [g is not None for g in direct] == expected


def test_the_executor_adds_nothing_to_a_hit_but_the_launch():
    # The common call's forward reads no dict and expands no keywords: its source calls
    # the plan with positional arguments only.
    source = _executor.source(_dense.SPEC)
    common = source.split("# the common call: positional only\n")[1].splitlines()[0]
    assert "c.plan.forward(" in common and "=" not in common.replace("==", "").replace("!=", "")
    assert "**" not in source and "{" not in source


def test_a_pointer_given_lands_in_its_slot(recording):
    # rng's two slots: the seed at its start, the offset 16 bytes on.
    seen = {}
    recording.forward = lambda *a, **kw: seen.update(kw)
    q = torch.zeros(1, 4, 2, 8, dtype=BF16)
    rng = torch.zeros(4, dtype=torch.int64)
    options = _dense.DenseOptions("bshd", False, False, -1, -1, 0.0, False, False, False, 0.1, False)
    _dense.forward_impl(q, q, q, None, None, None, None, rng, options)
    assert seen["seed"] == rng.data_ptr() and seen["offset"] == rng.data_ptr() + 16


def test_the_op_librarys_misses_reach_each_ops_plan_for_as_the_executor_calls_it(monkeypatch):
    # kernels.cpp's misses hand _native._miss (kind, direction, the op's inputs in its
    # spec's order, o, the options as a tuple): the op's plan_for gets what the Python
    # executor gives it, plan_for(*inputs, o, options), with the options' NamedTuple.
    from fastattn.torch import _native

    class Stop(Exception):
        pass

    assert _native.KINDS == tuple(_specs.SPECS)
    assert _native.PLAN_FOR == {"dense": (_dense.plan_for, _dense.DenseOptions),
                                "varlen": (_varlen.native_plan_for, _varlen.VarlenOptions),
                                "paged": (_paged.plan_for, _paged.PagedOptions)}
    seen = []

    def record(*args):
        seen.append(args)
        raise Stop

    for kind, (_, options) in list(_native.PLAN_FOR.items()):
        monkeypatch.setitem(_native.PLAN_FOR, kind, (record, options))
        inputs = tuple(object() for _ in _specs.SPECS[kind].inputs)
        values = tuple(o.off if o.kind != "str" else "bshd" for o in _specs.SPECS[kind].options)
        o = object()
        with pytest.raises(Stop):
            _native._miss(_native.KINDS.index(kind), 1, *inputs, o, values)
        got = seen.pop()
        assert got == (*inputs, o, options(*values)) and type(got[-1]) is options


def test_a_native_varlen_miss_checks_the_cumulative_lengths_the_plan_reads():
    # The op library's varlen table keys the cumulative lengths whole, so the check on its
    # miss is every call's: an int64 array, or one on another device, is refused there.
    q = torch.zeros(8, 2, 8, dtype=BF16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    options = _varlen.VarlenOptions(8, 8, False, False, -1, -1, 0.0, False, False, False, 0.0)
    with pytest.raises(InvalidArgumentError, match="cu_seqlens_q: expected an int32 tensor"):
        _varlen.native_plan_for(q, q, q, cu.long(), cu, None, None, None, options)
    with pytest.raises(InvalidArgumentError, match="cu_seqlens_kv is on meta"):
        _varlen.native_plan_for(q, q, q, cu, cu.to("meta"), None, None, None, options)
