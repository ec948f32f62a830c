"""Plans for a GPU that is not here (fastattn.target): the GPU file is read as hostile input,
the keys are the GPU's own, and `fastattn warm --for FILE` builds real cuDNN plans on this
machine, without a GPU, through the stand-in libcuda in its workers (never in this process).

tests/warm/data/h100.json is an H100 SXM5 as cuDNN 9.28 describes it (the deviceless probe's
properties, tools/deviceless_probe.cpp); its name, capability and SM count are the H100's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastattn
from fastattn import AttentionConfig, store, target
from fastattn.errors import InvalidArgumentError, LibraryError
from fastattn.plan_cache import PlanCache

import fake_core
from helpers.cli import run

H100 = os.path.join(os.path.dirname(__file__), "data", "h100.json")
CONFIGS = [
    AttentionConfig(batch=1, heads_q=8, seqlen_q=256, head_dim_qk=128, dtype="bf16", mask="causal", training=True),
    AttentionConfig(batch=2, heads_q=16, heads_kv=4, seqlen_q=128, head_dim_qk=64, dtype="fp16"),
]


def h100() -> dict:
    with open(H100) as f:
        return json.load(f)


def write(tmp_path, obj, name="gpu.json") -> str:
    path = tmp_path / name
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(path)


# -- the file ---------------------------------------------------------------------------

def test_the_file_round_trips():
    gpu = target.read(H100)
    assert (gpu.name, gpu.compute_capability, gpu.sm_count) == ("NVIDIA H100 80GB HBM3", (9, 0), 132)
    assert target.parse(gpu.to_dict()) == gpu
    assert gpu.key_fields() == {"name": gpu.name, "compute_capability": (9, 0), "sm_count": 132}


@pytest.mark.parametrize("field,value,words", [
    ("format", "fastattn-bundle", "format='fastattn-bundle'"),
    ("version", 2, "version=2"),
    ("name", "", "name=''"),
    ("name", "H100\nbuilt 3 plans", "name="),  # a line break would forge a line of output
    ("name", 7, "name=7"),
    ("compute_capability", [9], "compute_capability=[9]"),
    ("compute_capability", [0, 0], "compute_capability=[0, 0]"),
    ("compute_capability", [9, True], "compute_capability=[9, True]"),
    ("sm_count", 0, "sm_count=0"),
    ("sm_count", 1.5, "sm_count=1.5"),
    ("sm_count", True, "sm_count=True"),
    ("cudnn_version", -1, "cudnn_version=-1"),
    ("cudnn_properties", {"deviceVer": 900}, "cudnn_properties="),
    ("cudnn_properties", "[1, 2]", "not a JSON object"),
    ("cudnn_properties", "{", "not a JSON object"),
    ("bätch", 1, "unknown field 'bätch'"),
])
def test_a_bad_field_is_named_with_its_value(tmp_path, field, value, words):
    obj = h100()
    obj[field] = value
    with pytest.raises(InvalidArgumentError) as e:
        target.read(write(tmp_path, obj))
    assert words in str(e.value) and "gpu.json" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("field,value", [("sm_count", 114), ("compute_capability", [8, 0])])
def test_the_key_fields_must_describe_the_gpu_cudnns_properties_describe(tmp_path, field, value):
    # Two files spliced, or one edited by hand: one GPU's plans under another GPU's key.
    obj = h100()
    obj[field] = value
    with pytest.raises(InvalidArgumentError, match="does not match"):
        target.read(write(tmp_path, obj))


@pytest.mark.parametrize("content,words", [
    (None, "No such file"),
    ("", "not JSON"),
    ("\xff\xfe", "not JSON"),
    ("[" * 100000 + "]" * 100000, "not JSON"),
    ("[]", "must be a JSON object"),
    (" " * (target.MAX_FILE_BYTES + 1), "larger than"),
])
def test_a_file_that_is_no_gpu_file_is_refused_by_name(tmp_path, content, words):
    path = tmp_path / "gpu.json"
    if content is not None:
        path.write_bytes(content.encode("utf-8", "surrogateescape") if content != "\xff\xfe" else b"\xff\xfe")
    with pytest.raises(InvalidArgumentError, match=words):
        target.read(str(path))


@pytest.mark.parametrize("make", ["folder", "fifo", "device", "nul"])
def test_what_is_no_regular_file_is_refused_at_once(tmp_path, make):
    # A FIFO would wait for a writer forever, /dev/zero never end: never read.
    path = str(tmp_path / "gpu.json")
    if make == "folder":
        os.mkdir(path)
    elif make == "fifo":
        os.mkfifo(path)
    elif make == "device":
        path = "/dev/zero"
    else:
        path += "\0"
    with pytest.raises(InvalidArgumentError):
        target.read(path)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3),
                    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from(sorted(h100())), value=JSON)
def test_any_value_in_any_field_is_read_or_refused_by_name(field, value):
    obj = h100()
    obj[field] = value
    try:
        gpu = target.parse(obj, "F")
    except InvalidArgumentError as e:
        assert str(e).startswith("F: ")
    else:
        assert target.parse(gpu.to_dict()) == gpu


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=400))
def test_any_bytes_are_read_or_refused_by_name(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("bytes") / "gpu.json"
    path.write_bytes(data)
    with pytest.raises(InvalidArgumentError, match="gpu.json"):
        target.read(str(path))


# -- the keys ---------------------------------------------------------------------------

def test_a_plan_built_for_a_gpu_has_the_key_that_gpus_own_process_computes(tmp_path, monkeypatch):
    gpu = target.read(H100)
    monkeypatch.setattr(fake_core, "GPU_NAME", [gpu.name])
    monkeypatch.setattr(fake_core, "get_device_info", lambda device: {
        "name": gpu.name, "compute_capability": gpu.compute_capability, "sm_count": gpu.sm_count,
        "driver_version": 13000, "runtime_version": 13000})
    settings_ = store.CacheSettings(directory=str(tmp_path))
    on_the_gpu = PlanCache(settings_, core=lambda: fake_core)
    elsewhere = PlanCache(settings_, core=lambda: fake_core, gpu=gpu.key_fields())
    for cfg in CONFIGS:
        assert elsewhere.key(cfg, 0) == on_the_gpu.key(cfg, 0)
    other = PlanCache(settings_, core=lambda: fake_core, gpu={**gpu.key_fields(), "sm_count": 114})
    assert other.key(CONFIGS[0], 0) != on_the_gpu.key(CONFIGS[0], 0)


# -- the build process -----------------------------------------------------------------

def test_a_process_with_the_driver_loaded_cannot_become_a_build_process(monkeypatch):
    monkeypatch.setattr(target, "_driver_loaded", lambda: "/usr/lib/libcuda.so.1")
    with pytest.raises(LibraryError, match="already loaded"):
        target.enter_build_process()
    assert target._standin is None


def test_building_needs_a_build_process():
    with pytest.raises(LibraryError, match="enter_build_process"):
        target.build(CONFIGS[0], target.read(H100), None)


# -- the commands -----------------------------------------------------------------------

def test_warm_for_refuses_a_bad_file_and_the_flags_that_need_a_gpu_here(tmp_path, capsys):
    code, out, err = run(["warm", "--for", str(tmp_path / "missing.json")], capsys)
    assert code == 2 and "missing.json" in err
    code, out, err = run(["warm", "--for", write(tmp_path, {"format": "x"})], capsys)
    assert code == 2 and "format='x'" in err
    for flags, named in ((["--device", "0"], "--device"), (["--verify"], "--verify")):
        code, out, err = run(["warm", "--for", H100, *flags], capsys)
        assert code == 2 and named in err and "--for" in err, err


def test_info_export_gpu_writes_the_file_on_a_gpu_and_exit_3_without_one(tmp_path, capsys):
    path = tmp_path / "gpu.json"
    code, out, err = run(["info", "--export-gpu", str(path)], capsys)
    try:
        here = fastattn.device_info()
    except fastattn.FastAttnError:
        here = None
    if here is None:
        assert code == 3 and not path.exists() and "nothing was written" in err
    else:
        assert code == 0 and target.read(str(path)).name == here["name"]


def test_info_export_gpu_checks_its_path_before_any_work(tmp_path, capsys):
    code, out, err = run(["info", "--export-gpu", str(tmp_path / "no" / "gpu.json")], capsys)
    assert code == 2 and "does not exist" in err


def _installed_cudnn() -> int:
    """The version of the cuDNN wheel warm's workers load (this process loads none where
    there is no driver): torch's pinned one where torch is installed, else fastattn's."""
    return fastattn.runtime.installed_cudnn_version()


def _warm_for(cache_dir, *argv):
    # The H100 as the installed cuDNN describes it (the file's cuDNN is the builder's).
    gpu_file = cache_dir.parent / "h100.json"
    gpu_file.write_text(json.dumps({**h100(), "cudnn_version": _installed_cudnn()}))
    env = {**os.environ, "FASTATTN_CACHE_DIR": str(cache_dir)}
    env.pop("FASTATTN_TEST_FAKE_CORE", None)
    return subprocess.run([sys.executable, "-m", "fastattn", "warm", "--for", str(gpu_file), *argv, "--no-torch-ops",
                           "--json"], capture_output=True, text=True, env=env, cwd=cache_dir.parent, timeout=600)


def test_warm_for_builds_that_gpus_plans_here_with_real_cudnn(tmp_path):
    """Real cuDNN, real plans, on whatever machine runs the suite (a GPU or none): the
    workers have the stand-in in the driver's place."""
    configs = tmp_path / "configs.json"
    configs.write_text(json.dumps({"configs": [c.to_dict() for c in CONFIGS]}))
    first = _warm_for(tmp_path / "cache", str(configs))
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    report = json.loads(first.stdout)
    assert report["counts"]["built"] == len(CONFIGS) and report["not_saved"] == 0, report
    assert all(item["forward_engine"] for item in report["items"]), report["items"]

    gpu = target.read(H100)
    entries = list(store.DiskStore(str(tmp_path / "cache")).entries(with_headers=True))
    assert len(entries) == len(CONFIGS) and all(e.problem == "" for e in entries)
    for e in entries:
        desc = e.header["description"]
        assert desc["gpu"] == {"name": gpu.name, "compute_capability": [9, 0], "sm_count": 132}
        assert e.key == store.key_of(desc)

    second = _warm_for(tmp_path / "cache", str(configs))
    assert second.returncode == 0 and json.loads(second.stdout)["counts"]["loaded"] == len(CONFIGS), second.stderr
    assert "warning" not in second.stderr  # (the file's cuDNN is the one building)


def test_warm_for_by_shape_class_and_another_cudnns_file(tmp_path):
    """Class plans for that GPU, with the installed cuDNN's shape override where it has one
    and fastattn.defects does not refuse it there (this process cannot load cuDNN without
    a driver: the wheel's version decides, the one the workers load); and a warning where
    the file came from another cuDNN."""
    from fastattn import defects
    from fastattn import shape_classes as sc

    obj = h100()
    obj["cudnn_version"] = 91900  # (a file exported with 9.19)
    path = write(tmp_path, obj)
    env = {**os.environ, "FASTATTN_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("FASTATTN_TEST_FAKE_CORE", None)
    r = subprocess.run([sys.executable, "-m", "fastattn", "warm", "--for", path, "--no-torch-ops", "--json",
                        "--seqlens", "1..128", "--heads", "2", "--head-dim", "64", "--mask", "causal",
                        "--shape-classes", "128"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    report = json.loads(r.stdout)
    warmed = {item["config"].get("shape_override", False) for item in report["items"]}
    installed = _installed_cudnn()
    prefill = sc.class_config(upper_q=128, upper_kv=128, override=True, batch=1, heads_q=2, heads_kv=2,
                              head_dim_qk=64, head_dim_v=64, dtype="bf16", mask="causal", alignment="top_left",
                              training=False)
    override = installed >= 92100 and not defects.decide(prefill, installed, (9, 0)).refusal
    assert warmed == ({False, True} if override else {False}), (installed, report["items"])
    assert r.returncode == 0, r.stderr
    if installed // 100 == 919:
        return  # (the file's cuDNN: no warning)
    assert "exported with cuDNN 91900" in r.stderr, r.stderr


@pytest.mark.parametrize("text,number", [("9.24.0.43", 92400), ("9.28.1.4", 92801), ("9.19.0", 91900), (None, None),
                                         ("9.x.0", None), ("9.24", None), ("٩.24.0", None)])
def test_a_wheels_version_as_cudnns_number(text, number):
    from fastattn._loader import version_number, version_text

    assert version_number(text) == number
    if number is not None:
        assert version_number(version_text(number)) == number
