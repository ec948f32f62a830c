"""tools/other_cudnn.sh's CPU side: a wheel split into parts and manifested (pack), the parts
kept and counted as they arrive (receive), and a reassembled wheel checked against the
manifest before anything is installed from it. (`run`, a mount namespace over the GPU
machine's cuDNN, needs that machine.)"""

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VERSION = "9.99.0.1"
WHEEL = f"nvidia_cudnn_cu13-{VERSION}-py3-none-manylinux_2_27_x86_64.whl"


@pytest.fixture
def tree(tmp_path):
    """A copy of the tool in a tree of its own, a fake wheel of 2.5 MiB where `pack` looks
    first (so nothing is downloaded), and a work folder in place of the machine's /tmp."""
    (tmp_path / "tools").mkdir()
    shutil.copy(ROOT / "tools" / "other_cudnn.sh", tmp_path / "tools")
    (tmp_path / ".cudnn" / "wheels").mkdir(parents=True)
    data = os.urandom(5 << 19)
    (tmp_path / ".cudnn" / "wheels" / WHEEL).write_bytes(data)
    return tmp_path, hashlib.sha256(data).hexdigest()


def tool(tree, *args):
    env = dict(os.environ, PART_MIB="1", OTHER_CUDNN_WORK=str(tree / "work"))
    return subprocess.run(["bash", str(tree / "tools" / "other_cudnn.sh"), *args], capture_output=True, text=True,
                          env=env, timeout=60)


def test_pack_splits_the_wheel_and_manifests_it(tree):
    root, digest = tree
    r = tool(root, "pack", VERSION)
    assert r.returncode == 0, r.stderr
    parts = sorted((root / ".cudnn" / VERSION).glob("part-*"))
    assert [p.name for p in parts] == ["part-00", "part-01", "part-02"]
    assert max(p.stat().st_size for p in parts) <= 1 << 20
    assert (root / ".cudnn" / VERSION / "MANIFEST").read_text() == f"wheel {WHEEL}\nsha256 {digest}\nparts 3\n"
    assert r.stdout.count("call: carry") == 3


def test_receive_counts_the_parts_that_arrived(tree):
    root, _ = tree
    assert tool(root, "pack", VERSION).returncode == 0
    here = root / ".cudnn" / VERSION
    kept = {p.name: p.read_bytes() for p in here.glob("part-*")}
    for name in ("part-01", "part-02"):
        (here / name).unlink()  # a call carries one part
    r = tool(root, "receive", VERSION)
    assert r.returncode == 0 and "1 of 3 parts here; missing: 01 02" in r.stdout, r.stdout
    (here / "part-02").write_bytes(kept["part-02"])
    (here / "part-00").unlink()
    assert "2 of 3 parts here; missing: 01" in tool(root, "receive", VERSION).stdout


def test_a_damaged_part_is_found_before_anything_is_installed(tree):
    root, _ = tree
    assert tool(root, "pack", VERSION).returncode == 0
    assert tool(root, "receive", VERSION).returncode == 0
    part = root / "work" / VERSION / "part-01"
    part.write_bytes(b"\0" + part.read_bytes()[1:])
    r = tool(root, "run", VERSION, "--", "true")
    assert r.returncode == 1 and "sha256 differs" in r.stderr, (r.returncode, r.stderr)
    assert not list((root / "work").glob("*.whl*"))  # the partial file is removed, not kept as the wheel


@pytest.mark.parametrize("args", [["pack", "9.24"], ["receive", ""], ["run", "9.28.1.4.5", "--", "true"],
                                  ["run", "9.28.1.4"]])
def test_bad_arguments_are_refused_with_usage(tree, args):
    root, _ = tree
    r = tool(root, *args)
    assert r.returncode == 2 and ("usage" in r.stderr or "no parts" in r.stderr), r.stderr


def test_runs_started_together_unpack_the_wheel_once(tree):
    # A background run beside a foreground one, both before the wheel was reassembled: each
    # reassembled it and one lost its .partial to the other's mv (seen on the GPU machine).
    # A stand-in python records each pip install (slow, as a real one is) and fails the
    # question that follows (where torch's cuDNN is installed), which needs that machine.
    root, digest = tree
    assert tool(root, "pack", VERSION).returncode == 0
    assert tool(root, "receive", VERSION).returncode == 0
    fake = root / "python"
    fake.write_text('#!/usr/bin/env bash\n'
                    'if [ "$1 $2 $3" = "-m pip install" ]; then\n'
                    '  for a in "$@"; do [ "$prev" = --target ] && t=$a; prev=$a; done\n'
                    f'  echo install >> "{root}/installs"; sleep 0.5; mkdir -p "$t/nvidia/cudnn/lib"; exit 0\n'
                    'fi\n'
                    'echo "stand-in python: no nvidia-cudnn-cu13 here" >&2; exit 1\n')
    fake.chmod(0o755)
    env = dict(os.environ, PART_MIB="1", OTHER_CUDNN_WORK=str(root / "work"), PYTHON=str(fake))
    runs = [subprocess.Popen(["bash", str(root / "tools" / "other_cudnn.sh"), "run", VERSION, "--", "true"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(4)]
    errors = [r.communicate(timeout=60)[1] for r in runs]
    assert not [e for e in errors if "cannot stat" in e or "sha256 differs" in e], errors
    assert (root / "installs").read_text() == "install\n"
    wheel = root / "work" / WHEEL
    assert hashlib.sha256(wheel.read_bytes()).hexdigest() == digest
