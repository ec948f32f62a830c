"""The runtime keeps the registry; the CLI and warm reach the cache through the public
face (runtime.plan_cache(), fastattn.plan_cache.PlanCache), never a private name."""

from __future__ import annotations

import ast
import os
import warnings
from pathlib import Path

import pytest

import fastattn
from fastattn import runtime, store
from fastattn.plan_cache import PlanCache, config_of

import fake_core

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTSIDE_RUNTIME = [os.path.join("fastattn", "warm.py")] + [
    os.path.join("fastattn", "cli", name) for name in sorted(os.listdir(os.path.join(ROOT, "fastattn", "cli")))
    if name.endswith(".py")]


@pytest.mark.parametrize("path", OUTSIDE_RUNTIME)
def test_no_private_runtime_names_outside_it(path):
    with open(os.path.join(ROOT, path)) as f:
        tree = ast.parse(f.read())
    private = [f"{node.value.id}.{node.attr}" for node in ast.walk(tree)
               if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
               and node.value.id in ("runtime", "store") and node.attr.startswith("_")]
    assert private == [], f"{path} uses {private}"


def test_plan_cache_is_the_processs_and_answers_from_entries(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(runtime, "_core", lambda: fake_core)
    runtime.clear()
    try:
        cache = runtime.plan_cache()
        assert isinstance(cache, PlanCache) and runtime.plan_cache() is cache and cache.store.main.root == str(tmp_path)
        cfg = fastattn.AttentionConfig(batch=1, heads_q=8, seqlen_q=128, head_dim_qk=64)
        assert cache.stored_answer(cfg) is None and cache.configs() == []
        fastattn.plan(cfg)
        known = cache.stored_answer(cfg)
        assert known.supported and known.source == "disk" and known.forward_engine == "fake_fwd"
        assert cache.configs() == [cfg] and store.key_of(cache.describe(cfg)) == cache.key(cfg)
        found, tier = cache.store.get(cache.key(cfg))
        assert tier.kind == "disk" and cache.load_entry(found).output() == fastattn.plan(cfg).output()
        other = runtime.open_plan_cache()
        assert other is not runtime.plan_cache() and other.stored_answer(cfg) == known
    finally:
        runtime.clear()


def test_config_of_takes_anything():
    for junk in (None, "x", [], {"config": "x"}, {"config": {"batch": "many"}}, {"config": {"window": {"a": 1}}}):
        assert config_of(junk) is None
    assert config_of({"config": {"batch": 1, "heads_q": 8, "seqlen_q": 128, "head_dim_qk": 64}}).batch == 1


# -- what a wheel ships ------------------------------------------------------------------------

# Files under fastattn/ that a wheel leaves out on purpose, and why. Build outputs (the
# extension, Cython's C++ and bytecode) are not source files and are not listed.
NOT_SHIPPED = {
    os.path.join("fastattn", "_measured", "README.md"): "how the file beside it is made: for the repository",
}


def _source_files() -> set[str]:
    out = set()
    for folder, dirs, files in os.walk(os.path.join(ROOT, "fastattn")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith((".so", ".pyc")) or name == "_core.cpp":  # built, not shipped as source
                continue
            out.add(os.path.relpath(os.path.join(folder, name), ROOT))
    return out


def test_a_wheel_ships_every_package_and_every_file_the_package_reads(tmp_path, monkeypatch):
    # setuptools' own build_py, on pyproject.toml's configuration (package discovery and
    # package data): what `pip install .` copies besides the extension, without building it.
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    monkeypatch.chdir(ROOT)  # setuptools reads pyproject's paths from the current directory
    with warnings.catch_warnings():  # it warns that csrc/, include/ and _measured/ could be packages
        warnings.simplefilter("ignore")
        dist = Distribution({"script_name": "setup.py"})
        apply_configuration(dist, "pyproject.toml")
        # egg_info lists the package data; in tmp_path, so that it neither writes into the
        # checkout nor reads a list an earlier build left there.
        dist.get_command_obj("egg_info").egg_base = str(tmp_path)
        build = dist.get_command_obj("build_py")
        build.build_lib = str(tmp_path / "lib")
        build.ensure_finalized()
        build.run()
    packages = sorted(os.path.relpath(folder, ROOT).replace(os.sep, ".")
                      for folder, _, files in os.walk(os.path.join(ROOT, "fastattn")) if "__init__.py" in files)
    assert sorted(dist.packages) == packages and "fastattn.integrations" in packages
    assert dist.metadata.version == fastattn.__version__  # pyproject reads fastattn/_version.py
    shipped = {os.path.relpath(os.path.join(folder, name), tmp_path / "lib")
               for folder, _, files in os.walk(tmp_path / "lib") for name in files}
    assert shipped == _source_files() - set(NOT_SHIPPED), "pyproject.toml's package data misses or adds files"


# -- fastattn.torch's backend, as the CLI sees it -----------------------------------------------

def test_backend_info_says_which_path_runs_builds_only_when_asked_and_reports_a_failed_build(monkeypatch, tmp_path):
    torch = pytest.importorskip("torch", reason="PyTorch is an optional extra")
    import json

    import fastattn.torch
    from fastattn.torch import _native

    monkeypatch.setattr(_native, "_state", {})  # undecided in this process, whatever ran before
    monkeypatch.setenv("FASTATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FASTATTN_TORCH_OPS_DIR", raising=False)
    monkeypatch.setenv("FASTATTN_TORCH_PATH", "auto")
    assert "backend_info" in fastattn.torch.__all__
    info = fastattn.torch.backend_info()
    assert json.loads(json.dumps(info)) == info
    assert info["path"] == "python" and "not built for this torch yet" in info["reason"], info
    assert info["torch"] == torch.__version__ and info["built"] is False and info["build_error"] is None
    library = Path(info["library"])
    assert library.is_relative_to(tmp_path) and not library.parent.exists()  # asking builds nothing

    monkeypatch.setenv("CXX", "false")  # a compiler that fails: reported, not raised
    failed = fastattn.torch.backend_info(build=True)
    assert failed["built"] is False and failed["build_error"].startswith("RuntimeError: compiling ops.cpp failed")
    assert failed["path"] == "python" and failed["library"] == info["library"]

    library.write_bytes(b"")  # as `fastattn warm` leaves it: auto mode would load it
    found = fastattn.torch.backend_info(build=True)  # built already: nothing to compile
    assert found["built"] is True and found["build_error"] is None and found["path"] == "native", found
    assert "lib" not in _native._state  # still undecided: nothing was loaded
