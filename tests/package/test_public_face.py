"""The runtime keeps the registry; the CLI and warm reach the cache through the public
face (runtime.plan_cache(), fastattn.plan_cache.PlanCache), never a private name.

And the package's boundaries: no module uses another package's private names (a short
list of debts, each with its reason), no import cycles but the known ones, every module
imports on its own, a wheel ships every package and file, fastattn.flash is the adapter's
public name, fastattn.torch.backend_info() is what the CLI asks."""

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
from helpers import paths

ROOT = str(paths.ROOT)
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
    assert failed["built"] is False and failed["build_error"].startswith("RuntimeError: compiling ops.cpp")
    assert failed["path"] == "python" and failed["library"] == info["library"]

    library.write_bytes(b"")  # as `fastattn warm` leaves it: auto mode would load it
    found = fastattn.torch.backend_info(build=True)  # built already: nothing to compile
    assert found["built"] is True and found["build_error"] is None and found["path"] == "native", found
    assert "lib" not in _native._state  # still undecided: nothing was loaded


# -- package boundaries: private names stay in their package; no import cycles ------------------

def _modules() -> dict[str, tuple[str, bool]]:
    """Every module of the source tree: dotted name -> (path, whether it is a package's
    __init__). _core counts by its .pyx (imported as a module, read by no ast)."""
    out = {}
    for folder, dirs, files in os.walk(os.path.join(ROOT, "fastattn")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in sorted(files):
            if name.endswith((".py", ".pyx")):
                dotted = os.path.relpath(os.path.join(folder, name), ROOT).rsplit(".", 1)[0].replace(os.sep, ".")
                package = dotted.endswith(".__init__")
                out[dotted.removesuffix(".__init__")] = (os.path.join(folder, name), package)
    return out


MODULES = _modules()
PACKAGES = sorted(name for name, (_, package) in MODULES.items() if package)


def _package_of(dotted: str) -> str:
    """The package a dotted name belongs to: the longest package it lies in."""
    return max((p for p in PACKAGES if dotted == p or dotted.startswith(p + ".")), key=len)


def _tree(name: str) -> ast.Module:
    with open(MODULES[name][0]) as f:
        return ast.parse(f.read())


def _imports(name: str, tree: ast.Module, package: bool = False):
    """(line, what is imported, local name, what the local name is) for every import in
    module `name`'s tree, at any depth (function-level and TYPE_CHECKING imports too),
    `from a import b` as a.b, relative ones resolved. package: the tree is the package
    `name`'s __init__."""
    here = name if package else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:  # import a.b binds a; import a.b as c binds a.b
                top = alias.name.partition(".")[0]
                yield node.lineno, alias.name, alias.asname or top, alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = here.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}", alias.asname or alias.name, f"{base}.{alias.name}"


def _is_private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _private_owner(dotted: str) -> str | None:
    """The package whose private name `dotted` reaches (fastattn.torch for
    fastattn.torch._native.build, fastattn for fastattn._core), or None: all public."""
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if _is_private(part):
            return _package_of(".".join(parts[:i]))
    return None


def _private_uses(name: str, tree: ast.Module, package: bool = False):
    """(line, what, owner) for each use in module `name` of another package's private
    names: an import of one, or an attribute `x._y` of a name `x` imported from another
    package."""
    mine = _package_of(name)
    bound = {}  # local name -> what it was imported as, where that is another package's
    for line, dotted, local, target in _imports(name, tree, package):
        if dotted.split(".")[0] != "fastattn":
            continue
        owner = _private_owner(dotted)
        if owner is not None and owner != mine:
            yield line, dotted, owner
        elif _package_of(target) != mine:
            bound[local] = target
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            dotted = f"{bound[node.value.id]}.{node.attr}"
            owner = _private_owner(dotted)
            if owner is not None and owner != mine:
                yield node.lineno, dotted, owner


_FIELDS = ("the field registry has no public face yet; _fields.py and config.py are being reshaped "
           "(options declared once)")
_CAPTURING = ("capturing(): fastattn.torch has no public capture check, and fastattn.flash's content is kept "
              "as it was moved while softcap is written into it")
_RESHAPE = "reshape in progress (fastattn/torch: options declared once)"
# (module, the private module it imports from another package) -> why, for now. Each
# entry is a debt: remove it with the import; add one only with a reason that holds.
ALLOWED_PRIVATE_IMPORTS = {
    ("fastattn.cli.matrix", "fastattn._fields"): _FIELDS,
    ("fastattn.cli.probe", "fastattn._fields"): _FIELDS,
    ("fastattn.integrations.flash._common", "fastattn._fields"): _FIELDS,
    ("fastattn.integrations.flash._interface", "fastattn._fields"): _FIELDS,
    ("fastattn.integrations.flash._common", "fastattn.torch._plans"): _CAPTURING,
    ("fastattn.integrations.flash._alibi", "fastattn.torch._plans"): _CAPTURING,
    ("fastattn.integrations.flash._common", "fastattn.torch._api"): (
        "options_for: flash_attn_with_kvcache's paged decode step keeps its checked options across calls "
        "(its host time per step); public, this would be attention_paged taking options made once"),
    ("fastattn.integrations.flash._common", "fastattn.torch._paged"): (
        "run: attention_paged's run with options made once (options_for, above)"),
    ("fastattn.cli.warm", "fastattn._opslib"): (
        "find_built(): a second `fastattn warm` finds the op library without importing torch "
        "(test_cli's test_a_second_warm_finds_the_op_library_without_importing_torch), and importing "
        "fastattn.torch imports torch, so backend_info() cannot answer it"),
    ("fastattn.cli.warm", "fastattn._warm_up"): (
        "suppressed(): warm imports fastattn.torch only to compile its op library, and that import must not "
        "start the warm-up (whose first phase would decide fastattn.torch's path before the build)"),
    ("fastattn.torch", "fastattn._warm_up"): (
        "start(): importing fastattn.torch starts the warm-up with PyTorch's view of the CUDA contexts and the "
        "op library's load; a user starts nothing (FASTATTN_WARM_UP says what it does), so it has no public name"),
    ("fastattn.torch._plans", "fastattn._warm_up"): (
        "nudge(): a fastattn.torch miss tells the warm-up that the process has a CUDA context; not a user's API"),
    ("fastattn.torch._api", "fastattn._fields"): _FIELDS,
    ("fastattn.torch._options", "fastattn._fields"): _FIELDS,
    ("fastattn.torch._specs", "fastattn._fields"): _FIELDS,
    ("fastattn.torch._executor", "fastattn._slots"): (
        "SLOTS: the one slot table, which says which slots Plan.forward and Plan.backward take and how "
        "(positional or by keyword); the executor's source is made from it, and it has no public face"),
    ("fastattn.torch._kernels", "fastattn._slots"): (
        "SLOTS and upper: the one slot table (which slots each direction takes) and a slot's C name; the op "
        "library's kernels are made from it as the executor's source is, and it has no public face"),
    ("fastattn.torch._plans", "fastattn._fields"): _RESHAPE,
    ("fastattn.torch._native", "fastattn._opslib"): _RESHAPE,
    ("fastattn.torch._native", "fastattn._core"): _RESHAPE + "; the C ABI capsule has no public name",
}


def _private_module(dotted: str) -> str:
    """fastattn._opslib for fastattn._opslib.INCLUDE: the name up to its first private part."""
    parts = dotted.split(".")
    return ".".join(parts[:next(i for i, part in enumerate(parts) if _is_private(part)) + 1])


def test_no_module_uses_another_packages_private_names():
    # A package's private modules and names (a leading underscore) are its own: another
    # package (fastattn, fastattn.store, .cli, .torch, .integrations, .flash) goes
    # through its public names, so that a package can change its insides alone.
    found = [f"{MODULES[name][0][len(ROOT) + 1:]}:{line}: {dotted} (private to {owner})"
             for name, (path, package) in sorted(MODULES.items()) if path.endswith(".py")
             for line, dotted, owner in _private_uses(name, _tree(name), package)
             if (name, _private_module(dotted)) not in ALLOWED_PRIVATE_IMPORTS]
    assert found == [], "\n".join(found)


def test_the_boundary_check_sees_each_kind_of_private_use():
    source = ("from .. import _core\nfrom ..torch._native import build\nimport fastattn.store._lazy\n"
              "from .. import runtime\nruntime._entries\nfrom ._common import wrap\nfrom .. import __version__\n"
              "from ..torch import attention\nattention.__doc__\nfrom . import _common\n_common._x\n"
              "import fastattn.torch\nfastattn._core\nimport fastattn.store as s\ns._lazy\n")
    found = [(line, dotted, owner) for line, dotted, owner in _private_uses("fastattn.cli.x", ast.parse(source))]
    assert found == [(1, "fastattn._core", "fastattn"), (2, "fastattn.torch._native.build", "fastattn.torch"),
                     (3, "fastattn.store._lazy", "fastattn.store"), (5, "fastattn.runtime._entries", "fastattn"),
                     (13, "fastattn._core", "fastattn"), (15, "fastattn.store._lazy", "fastattn.store")]


def test_integrations_import_neither_the_store_nor_core():
    # Adapters call fastattn's public API (fastattn.torch counts), never what is under it.
    for name in (n for n in MODULES if n.startswith("fastattn.integrations")):
        for line, dotted, _, _ in _imports(name, _tree(name), MODULES[name][1]):
            assert not dotted.startswith(("fastattn.store", "fastattn._core")), f"{name}:{line} imports {dotted}"


# Import cycles not fixed yet: each is a set of modules that may import each other.
ALLOWED_CYCLES: list[set[str]] = []


def _import_graph() -> dict[str, set[str]]:
    """module -> the fastattn modules it imports (at any depth; `from a import b` is a.b
    where that is a module, else a)."""
    graph = {}
    for name, (path, package) in MODULES.items():
        edges = set()
        for _, dotted, _, _ in (_imports(name, _tree(name), package) if path.endswith(".py") else ()):
            while dotted not in MODULES and "." in dotted:
                dotted = dotted.rpartition(".")[0]
            if dotted in MODULES and dotted != name:
                edges.add(dotted)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        out.append(component)
    return out


def test_no_import_cycles_but_the_known_ones():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]  # the finder itself
    graph = _import_graph()
    assert "fastattn._version" in graph["fastattn.runtime"] and graph["fastattn._version"] == set()
    new = [sorted(c) for c in _cycles(graph) if not any(c <= allowed for allowed in ALLOWED_CYCLES)]
    assert new == [], f"import cycles: {new}"


# Run by a fresh interpreter: torch (a third-party import, when installed) is imported
# once, then each module is imported in a child forked from that state, where no fastattn
# module is imported yet: each module on its own, without paying torch's import each time.
_IMPORT_EACH = r"""
import importlib, json, os, sys, traceback
try:
    import torch  # noqa: F401
except ImportError:
    pass
assert not [m for m in sys.modules if m.split(".")[0] == "fastattn"]
for name in sys.argv[1:]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            importlib.import_module(name)
            code = 0
        except ModuleNotFoundError as e:
            code = 2 if e.name == "torch" else 1
            os.write(write, traceback.format_exc().encode())
        except BaseException:
            code = 1
            os.write(write, traceback.format_exc().encode())
        os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        error = f.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"module": name, "code": os.waitstatus_to_exitcode(status), "error": error}), flush=True)
"""


def test_each_module_imports_on_its_own(tmp_path):
    import json
    import subprocess
    import sys

    # fastattn.__main__ runs the command when imported (test_cli runs `python -m fastattn`).
    names = sorted(n for n in MODULES if n != "fastattn.__main__")
    where = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))  # the fastattn under test
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (where, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-c", _IMPORT_EACH, *names], capture_output=True, text=True,
                          timeout=300, cwd=str(tmp_path), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["module"] for r in results] == names
    try:
        import torch  # noqa: F401
        allowed = {0}
    except ImportError:
        allowed = {0, 2}  # modules of fastattn.torch and the adapters over it need torch
    failed = [f"{r['module']} (exit {r['code']}):\n{r['error']}" for r in results if r["code"] not in allowed]
    assert failed == [], "\n".join(failed)
