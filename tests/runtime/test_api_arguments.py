"""The API checks its arguments first: a bad one is an InvalidArgumentError naming it,
raised before any library loads (on a machine without a GPU it was LibraryError) and
before any worker starts (warm(timeout=-1) "killed" every config; device="x" was each
worker's usage error); never an AttributeError (configure(5), cfg.strides(5)) nor a
made-up answer (AttentionConfig.tensor_dtype("zzz") was "bf16")."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastattn
import fastattn.warm
from fastattn import runtime, store
from fastattn.config import AttentionConfig
from fastattn.errors import InvalidArgumentError

CFG = dict(batch=1, heads_q=8, seqlen_q=128, head_dim_qk=64)


class Started(Exception):
    """Work started: the GPU stack was asked for, or a worker process was."""


@pytest.fixture
def no_start(monkeypatch, cache_dir):
    def start(*a, **k):
        raise Started

    monkeypatch.setattr(runtime, "_core", start)
    monkeypatch.setattr(fastattn.warm, "_Worker", start)


BAD_DEVICES = [-1, "0", "cuda:0", True, False, 1.0, [0]]


@pytest.mark.parametrize("device", BAD_DEVICES, ids=repr)
def test_a_bad_device_is_refused_before_the_gpu_stack_loads(no_start, device):
    calls = [lambda: fastattn.probe(CFG, device=device), lambda: fastattn.plan(CFG, device=device),
             lambda: runtime.planned(CFG, device=device), lambda: runtime.stored_answer(CFG, device=device),
             lambda: fastattn.device_info(device), lambda: runtime.cache_environment(device),
             lambda: fastattn.preload([CFG], device=device), lambda: fastattn.preload(device=device),
             lambda: fastattn.warm.warm([CFG], device=device)]
    for call in calls:
        with pytest.raises(InvalidArgumentError, match=r"^device=.*: must be a CUDA device index >= 0"):
            call()


@pytest.mark.parametrize("value", ["no", 1, 0, None], ids=repr)
def test_flags_are_booleans(no_start, value):
    for call in (lambda: fastattn.probe(CFG, verify=value), lambda: fastattn.plan(CFG, verify=value),
                 lambda: fastattn.preload([CFG], verify=value), lambda: fastattn.warm.warm([CFG], verify=value)):
        with pytest.raises(InvalidArgumentError, match=r"^verify=.*: must be True or False"):
            call()
    with pytest.raises(InvalidArgumentError, match=r"^refresh=.*: must be True or False"):
        fastattn.probe(CFG, refresh=value)


def test_background_is_a_boolean(no_start):
    with pytest.raises(InvalidArgumentError, match=r"^background='yes'"):
        fastattn.preload([CFG], background="yes")


@pytest.mark.parametrize("configs", ["abc", b"[]", 5, CFG, AttentionConfig(**CFG), [5], [CFG, "{"]], ids=repr)
def test_configs_are_an_iterable_of_configs(no_start, configs):
    for call in (lambda: fastattn.preload(configs), lambda: fastattn.warm.warm(configs)):
        with pytest.raises(InvalidArgumentError, match=r"^configs(\[\d\])?[=:]"):
            call()


def test_a_config_in_the_list_is_named_by_its_place(no_start):
    with pytest.raises(InvalidArgumentError, match=r"^configs\[1\]: batch=0: must be >= 1"):
        fastattn.preload([CFG, {**CFG, "batch": 0}])
    with pytest.raises(Started):  # (good arguments reach the GPU stack)
        fastattn.preload(iter([CFG, AttentionConfig(**CFG)]))


@pytest.mark.parametrize("timeout", [-1, 0, 0.0, -0.0, math.nan, math.inf, -math.inf, "10", True, None, [1]],
                         ids=repr)
def test_warm_refuses_a_timeout_that_is_not_a_finite_positive_number(no_start, timeout):
    with pytest.raises(InvalidArgumentError, match=r"^timeout=.*: must be"):
        fastattn.warm.warm([CFG], timeout=timeout)


def test_warm_refuses_a_progress_that_is_not_a_function(no_start):
    with pytest.raises(InvalidArgumentError, match=r"^progress=5: must be a function"):
        fastattn.warm.warm([CFG], progress=5)


def test_good_warm_arguments_reach_a_worker(no_start):
    with pytest.raises(Started):
        fastattn.warm.warm([CFG], timeout=0.5, device=0, verify=False, progress=lambda *a: None)
    assert fastattn.warm.warm([], timeout=1e-9).counts["failed"] == 0  # (nothing to do: no worker)


@pytest.mark.parametrize("settings_", [5, "x", {"directory": "/tmp"}, store], ids=repr)
def test_configure_takes_cache_settings_or_none(cache_dir, settings_):
    for call in (fastattn.configure, runtime.open_plan_cache):
        with pytest.raises(InvalidArgumentError, match=r"^settings=.*: must be a fastattn\.store\.CacheSettings"):
            call(settings_)
    assert fastattn.configure(None).settings == store.settings_from_env()
    assert fastattn.configure(store.settings_from_env()).settings.directory == str(cache_dir / "cache")


# -- tensor names ----------------------------------------------------------------------


@pytest.mark.parametrize("tensor", ["zzz", 5, None, ["q"], ("q",), {"q": 1}, b"q", "Q"], ids=repr)
def test_a_tensor_that_is_not_one_is_refused_naming_it(tensor):
    cfg = AttentionConfig(**CFG)
    for call in (cfg.shape, cfg.strides, cfg.dtype_of, cfg.tensor_itemsize, cfg.storage_elements,
                 AttentionConfig.tensor_dtype):
        with pytest.raises(InvalidArgumentError, match=r"^tensor=.*: must be one of q, k, v, o"):
            call(tensor)


def test_tensor_dtype():
    assert AttentionConfig.tensor_dtype("q") == "bf16" and AttentionConfig.tensor_dtype("o", "fp16") == "fp16"
    assert AttentionConfig.tensor_dtype("stats") == "float32" and AttentionConfig.tensor_dtype("seed") == "int64"
    assert AttentionConfig.tensor_dtype("bias") == "bf16"  # (some config's tensor: a config's own is dtype_of)
    for dtype in ("zzz", "bfloat16", None):
        with pytest.raises(InvalidArgumentError, match=r"^dtype=.*: must be one of"):
            AttentionConfig.tensor_dtype("q", dtype)


# -- properties --------------------------------------------------------------------------

_values = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=6), st.binary(max_size=4),
                    st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
                    st.sampled_from(["q", "k", "stats", "d_o", "seed", "bias", "sink", "page_table_k", "descale_q"]))


# (no_start's patches hold for every example: nothing in them changes between examples)
_FIXTURE_OK = [HealthCheck.function_scoped_fixture]


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=_FIXTURE_OK)
@given(device=_values)
def test_any_device_is_refused_naming_it_or_reaches_the_gpu_stack(no_start, device):
    good = device is None or (type(device) is int and device >= 0)
    try:
        fastattn.probe(CFG, device=device)
    except Started:
        assert good
    except InvalidArgumentError as e:
        assert not good and str(e).startswith("device=")


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=_FIXTURE_OK)
@given(timeout=_values)
def test_any_timeout_is_refused_naming_it_or_reaches_a_worker(no_start, timeout):
    try:
        fastattn.warm.warm([CFG], timeout=timeout)
    except Started:
        assert type(timeout) in (int, float) and math.isfinite(timeout) and timeout > 0
    except InvalidArgumentError as e:
        assert str(e).startswith("timeout=")


@settings(max_examples=300, deadline=None, derandomize=True)
@given(tensor=_values, features=st.sampled_from([{}, {"bias": "1hss"}, {"padding": True, "ragged": True},
                                                 {"dtype": "fp8_e4m3"}, {"dropout": 0.1}]))
def test_any_tensor_name_is_an_answer_or_refused_naming_it(tensor, features):
    cfg = AttentionConfig(**CFG, **features)
    for call in (cfg.shape, cfg.strides, cfg.dtype_of, cfg.storage_elements, AttentionConfig.tensor_dtype):
        try:
            call(tensor)
        except InvalidArgumentError as e:
            assert str(e).startswith("tensor="), str(e)
