"""fastattn.shape_classes without a GPU: parsing a user's choice, class assignment, the
measured policy's reading of its file (missing, damaged, other GPUs: exact plans) and the
length ranges of `fastattn warm --seqlens`."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastattn
from fastattn import env
from fastattn import shape_classes as sc


def test_off_and_auto_and_boundaries_parse():
    assert sc.parse("off") == sc.OFF and not sc.parse(" OFF ")
    assert sc.parse("Auto") == "auto"
    assert sc.parse("256, 1024,4096").ranges == ((1, 256), (256, 1024), (1024, 4096))
    assert sc.parse((64, 128)).ranges == ((1, 64), (64, 128))
    assert sc.parse(sc.parse("64")) == sc.parse([64])


@pytest.mark.parametrize("value,match", [
    ("", "expected \"auto\""), ("fast", "expected \"auto\""), ("1024,256", "strictly ascending"),
    ((64, 64), "strictly ascending"), ((), "no boundaries"), ((1,), "boundary 1"), ((2**31,), "boundary"),
    ((True, 4), "boundary True"), ((2.5,), "boundary 2.5"), (3, "expected \"auto\""), ("1..8", "expected"),
])
def test_bad_choices_are_named(value, match):
    with pytest.raises(fastattn.InvalidArgumentError, match=r"^shape_classes=") as e:
        sc.parse(value)
    assert match in str(e.value)


def test_the_environment_variable_goes_through_env_and_names_itself():
    assert env.get("FASTATTN_SHAPE_CLASSES", {}) == sc.OFF
    assert env.get("FASTATTN_SHAPE_CLASSES", {"FASTATTN_SHAPE_CLASSES": "auto"}) == "auto"
    assert env.get("FASTATTN_SHAPE_CLASSES", {"FASTATTN_SHAPE_CLASSES": "128,512"}).ranges == ((1, 128), (128, 512))
    with pytest.raises(fastattn.InvalidArgumentError, match=r"^FASTATTN_SHAPE_CLASSES='512,128': .*ascending"):
        env.get("FASTATTN_SHAPE_CLASSES", {"FASTATTN_SHAPE_CLASSES": "512,128"})


def test_class_assignment():
    c = sc.parse((256, 1024))
    assert [c.upper(n) for n in (1, 2, 255, 256, 257, 1024, 1025)] == [1, 256, 256, 256, 1024, 1024, None]
    assert sc.OFF.upper(1) == 1 and sc.OFF.upper(5) is None  # a decode step's query: always its own class
    assert sc.class_of(300, c) == 1024


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.integers(2, 10**6), min_size=1, max_size=8, unique=True), st.integers(1, 2 * 10**6))
def test_a_length_is_served_by_the_least_bound_at_or_above_it(bounds, n):
    bounds.sort()
    got = sc.parse(bounds).upper(n)
    want = 1 if n == 1 else next((b for b in bounds if b >= n), None)
    assert got == want


# -- the measured file -----------------------------------------------------------------------

def _file(tmp_path, rows, fmt=sc.FORMAT):
    p = tmp_path / "shape_classes.json"
    p.write_text(json.dumps({"format": fmt, "rows": rows}))
    return str(p)


def _row(classes, gpu="NVIDIA H200", cudnn=91900):
    return {"gpu": gpu, "cudnn": cudnn, "date": "2026-12-01", "classes": classes}


def _cls(lo, hi, *ratios, backward=None):
    return {"lo": lo, "hi": hi, "lengths": [
        {"n": lo + 1 + i, "forward_class_us": 100 * r, "forward_exact_us": 100.0,
         **({} if backward is None else {"backward_class_us": 100 * backward, "backward_exact_us": 100.0})}
        for i, r in enumerate(ratios)]}


def test_auto_keeps_the_classes_within_tolerance_and_only_for_its_gpu_and_cudnn(tmp_path):
    path = _file(tmp_path, [_row([_cls(1, 64, 1.0, 1.04), _cls(64, 128, 1.01, 1.3), _cls(128, 256, 0.9)]),
                            _row([_cls(1, 64, 1.0)], gpu="NVIDIA B200")])
    assert sc.measured("NVIDIA H200", 91900, path).ranges == ((1, 64), (128, 256))
    assert sc.measured("NVIDIA B200", 91900, path).ranges == ((1, 64),)
    assert sc.measured("NVIDIA H200", 92100, path) is None  # another cuDNN: not measured
    assert sc.measured("NVIDIA H100", 91900, path) is None


def test_training_needs_the_backward_measured_too(tmp_path):
    path = _file(tmp_path, [_row([_cls(1, 64, 1.0, backward=1.02), _cls(64, 128, 1.0, backward=1.5),
                                  _cls(128, 256, 1.0)])])
    assert sc.measured("NVIDIA H200", 91900, path, training=True).ranges == ((1, 64),)
    assert sc.measured("NVIDIA H200", 91900, path).ranges == ((1, 64), (64, 128), (128, 256))


@pytest.mark.parametrize("text", ["", "{", "[]", '{"format": 99, "rows": []}', '{"format": 1, "rows": {}}'])
def test_a_missing_or_damaged_file_is_no_measurement(tmp_path, text):
    assert sc.measured("NVIDIA H200", 91900, str(tmp_path / "absent.json")) is None
    p = tmp_path / "bad.json"
    p.write_text(text)
    assert sc.measured("NVIDIA H200", 91900, str(p)) is None


def test_damaged_classes_are_dropped_not_raised(tmp_path):
    rows = [_row([{"lo": 1}, {"lo": "x", "hi": 5, "lengths": [{}]}, {"lo": 1, "hi": 64, "lengths": []},
                  {"lo": 64, "hi": 32, "lengths": [{"forward_class_us": 1, "forward_exact_us": 1}]},
                  {"lo": 64, "hi": 128, "lengths": [{"forward_class_us": "1", "forward_exact_us": 1}]},
                  {"lo": 64, "hi": 128, "lengths": [{"forward_class_us": 1, "forward_exact_us": 0}]},
                  _cls(128, 256, 1.0), "junk"])]
    assert sc.measured("NVIDIA H200", 91900, _file(tmp_path, rows)).ranges == ((128, 256),)


def test_overlapping_classes_are_not_a_measurement(tmp_path):
    path = _file(tmp_path, [_row([_cls(1, 128, 1.0), _cls(64, 256, 1.0)])])
    assert sc.measured("NVIDIA H200", 91900, path) is None


def test_the_package_file_if_any_is_one_the_policy_reads():
    # No numbers are typed into the package: the file exists only once the benchmark wrote it.
    import os

    if os.path.exists(sc.PATH):
        with open(sc.PATH) as f:
            data = json.load(f)
        assert data["format"] == sc.FORMAT and data["rows"]


# -- ranges -----------------------------------------------------------------------------------

def test_ranges_parse():
    assert sc.parse_range("1..32768") == (1, 32768)
    assert sc.parse_range(" 7 ") == (7, 7)
    for bad in ("", "0..4", "5..4", "1..", "..4", "a..b", "1-4", f"1..{2**31}"):
        with pytest.raises(fastattn.InvalidArgumentError, match=r"^--seqlens="):
            sc.parse_range(bad)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.integers(1, 2**31 - 1), st.integers(0, 2**20))
def test_any_range_round_trips(lo, width):
    hi = min(lo + width, 2**31 - 1)
    assert sc.parse_range(f"{lo}..{hi}") == (lo, hi)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.integers(2, 5000), min_size=1, max_size=6, unique=True), st.integers(1, 6000),
       st.integers(0, 6000), st.booleans())
def test_classes_in_range_cover_every_length_once(bounds, lo, width, gappy):
    bounds.sort()
    classes = sc.parse(bounds)
    if gappy:  # as "auto" keeps only some classes
        classes = sc.Classes(classes.ranges[::2])
    hi = lo + width
    uppers, uncovered = sc.classes_in_range(lo, hi, classes)
    assert uppers == sorted(set(uppers))
    for n in range(lo, min(hi, lo + 300) + 1):
        u = classes.upper(n)
        in_gap = any(a <= n <= b for a, b in uncovered)
        assert (u in uppers) != in_gap, (n, u, uppers, uncovered)
