"""The GPU suite's own checks (tests/conftest.py), on the CPU: FASTATTN_TEST_ORDER, the
orders a suite can run in (one process each, to find a test that depends on what ran
before it), and the check after each GPU test of fastattn's kept length tensors."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILE = "tests/config/test_fields.py"


def collected(order: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "FASTATTN_TEST_ORDER": order, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "pytest", FILE, "--collect-only", "-q", "-p", "no:cacheprovider"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def ids(r: subprocess.CompletedProcess) -> list[str]:
    return [line for line in r.stdout.splitlines() if "::" in line]


def test_orders_file_reverse_shuffle_and_list(tmp_path):
    file_order = ids(collected(""))
    assert len(file_order) >= 4
    assert ids(collected("reverse")) == file_order[::-1]
    shuffled = ids(collected("shuffle:13"))
    assert sorted(shuffled) == sorted(file_order) and shuffled == ids(collected("shuffle:13"))
    wanted = [file_order[3], file_order[0], file_order[2]]  # a bisection's list: any subset, any order
    (tmp_path / "order.txt").write_text("\n".join(wanted) + "\n\n")
    r = collected(f"list:{tmp_path / 'order.txt'}")
    assert r.returncode == 0 and ids(r) == wanted, r.stdout + r.stderr
    assert f"{len(file_order) - 3} deselected" in r.stdout


def test_a_list_naming_an_uncollected_test_or_no_file_is_a_usage_error(tmp_path):
    (tmp_path / "order.txt").write_text(f"{FILE}::test_no_such_test\n")
    r = collected(f"list:{tmp_path / 'order.txt'}")
    assert r.returncode == 4 and "1 node ids not collected" in r.stderr + r.stdout and "test_no_such_test" in r.stderr
    r = collected(f"list:{tmp_path / 'missing.txt'}")
    assert r.returncode == 4 and "No such file" in r.stderr
    r = collected("sideways")
    assert r.returncode == 4 and "'reverse', 'shuffle:SEED' or 'list:FILE'" in r.stderr


def test_the_kept_lengths_check_names_a_tensor_that_changed(monkeypatch):
    # conftest's check after each GPU test: a kept full-length tensor whose elements no
    # longer hold its key's length is named, with its values.
    torch = pytest.importorskip("torch")
    import conftest
    from fastattn.torch import _paged

    monkeypatch.setattr(_paged, "_full_lengths", {(0, 3, 1): torch.ones(3, dtype=torch.int32)})
    assert conftest._kept_lengths_problem() is None
    _paged._full_lengths[(0, 3, 1)][1] = 0
    assert conftest._kept_lengths_problem() == "fastattn.torch._paged._full_lengths[(0, 3, 1)] = [1, 0, 1]"
