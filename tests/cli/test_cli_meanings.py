"""One meaning per exit code and per flag: one config-file
reader for probe and warm; a matrix value that gives no valid config is a usage error
before any GPU is looked for; "no usable GPU" is exit 3 on every command; a pull that
gets nothing but rejected entries fails; no abbreviated flags; paths are never empty
nor `-`; export does not replace a bundle unless told to."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastattn.warm
from fastattn import cli, runtime
from fastattn.store import signing
from fastattn.cli._main import build_parser
from fastattn.config import AttentionConfig
from fastattn.runtime import ProbeResult
from fastattn.warm import WarmItem, WarmReport

from conftest import _gpu_unavailable_reason
from helpers.cli import run  # noqa: E402

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture
def seen(monkeypatch):
    """What probe and warm were asked: probe answers "not supported", warm "built"."""
    asked: dict[str, list] = {"probe": [], "warm": []}

    def probe(cfg, device=None):
        asked["probe"].append(cfg)
        return ProbeResult(cfg, 0, False, "forward: no")

    def warm(configs, **k):
        asked["warm"].extend(configs)
        items = [WarmItem(c, status="built") for c in configs]
        return WarmReport(items, 0.0, 1, {"built": len(items), "loaded": 0, "unsupported": 0, "failed": 0}, 1)

    monkeypatch.setattr(runtime, "probe", probe)
    monkeypatch.setattr(fastattn.warm, "warm", warm)
    monkeypatch.setenv("CXX", "false")
    return asked


# -- one config-file reader -------------------------------------------------------------------

ONE = {"batch": 1, "heads_q": 8, "seqlen_q": 64, "head_dim_qk": 64, "mask": "causal"}


def _toml_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(v)


def _files(tmp_path, entry):
    """One config's fields written every way a config file can hold them."""
    body = "".join(f"{k} = {_toml_value(v)}\n" for k, v in entry.items())
    files = {"flat.json": json.dumps(entry), "configs.json": json.dumps({"configs": [entry]}),
             "list.json": json.dumps([entry]), "flat.toml": body, "configs.toml": "[[configs]]\n" + body}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return [str(tmp_path / name) for name in files]


def test_probe_takes_warms_files_and_warm_takes_probes(cache_dir, capsys, seen):
    for path in _files(cache_dir, ONE):
        seen["probe"].clear(), seen["warm"].clear()
        code, _, err = run(["probe", "--config", path], capsys)
        assert code == cli.EXIT_UNSUPPORTED, (path, err)
        code, _, err = run(["warm", path, "--no-torch-ops"], capsys)
        assert code == cli.EXIT_OK, (path, err)
        assert seen["probe"] == seen["warm"] == [AttentionConfig.from_dict(ONE)], path


def test_probe_refuses_a_file_of_many_configs_naming_warm(cache_dir, capsys, no_work):
    sweep_file = cache_dir / "s.toml"
    sweep_file.write_text("[[configs]]\nbatch = [1, 2]\nheads_q = 8\nseqlen_q = 64\nhead_dim_qk = 64\n")
    code, _, err = run(["probe", "--config", str(sweep_file)], capsys)
    assert code == cli.EXIT_BAD_INPUT and "2 configs" in err and "fastattn warm" in err
    two = cache_dir / "two.json"
    two.write_text(json.dumps([ONE, {**ONE, "batch": 2}]))
    code, _, err = run(["probe", "--config", str(two)], capsys)
    assert code == cli.EXIT_BAD_INPUT and "2 entries" in err and "fastattn warm" in err


_field_values = st.fixed_dictionaries({}, optional={
    "batch": st.sampled_from([1, 2, 0, [1, 2], "x"]), "mask": st.sampled_from(["none", "causal", "diag", ["none"]]),
    "dtype": st.sampled_from(["bf16", "fp16", "int8"]), "training": st.booleans(),
    "window": st.sampled_from([[16, 0], [-1, -1], [[16, 0], [32, 0]]]), "seq_len": st.just(3),
    "heads_kv": st.sampled_from([8, 4, 3])})


@SETTINGS
@given(extra=_field_values, kind=st.sampled_from(["flat.json", "configs.json", "list.json", "flat.toml",
                                                  "configs.toml"]))
def test_probe_and_warm_read_a_file_alike(cache_dir, capsys, seen, extra, kind):
    """Whatever one config file holds, probe and warm agree: the same single config,
    or both exit 2 (probe also when the file sweeps more than one)."""
    entry = {**ONE, **extra}
    path = next(p for p in _files(cache_dir, entry) if p.endswith(kind))
    seen["probe"].clear(), seen["warm"].clear()
    p_code, _, p_err = run(["probe", "--config", path], capsys)
    w_code, _, w_err = run(["warm", path, "--no-torch-ops"], capsys)
    if w_code == cli.EXIT_BAD_INPUT:
        assert p_code == cli.EXIT_BAD_INPUT, (entry, p_err, w_err)
    elif len(seen["warm"]) == 1:
        assert (p_code, seen["probe"]) == (cli.EXIT_UNSUPPORTED, seen["warm"]), (entry, p_err)
    else:
        assert w_code == cli.EXIT_OK and p_code == cli.EXIT_BAD_INPUT and "configs" in p_err, (entry, p_err)


# -- matrix: a value with no valid config is a usage error, before any GPU ---------------------


@pytest.mark.parametrize("argv,named", [
    (["--features", "bias_grad"], "bias_grad"),
    (["--features", "dense,bias_grad"], "--features bias_grad"),
    (["--features", "dense,paged", "--training"], "--features paged"),
])
def test_matrix_values_without_a_valid_config_are_usage_errors(argv, named, cache_dir, capsys, no_work):
    code, _, err = run(["matrix", *argv], capsys)
    assert code == cli.EXIT_BAD_INPUT and named in err, err


MATRIX_AXES = {"--features": ["dense", "bias_grad", "paged", "ragged", "bias", "window_br"],
               "--dtypes": ["bf16", "fp16", "fp8_e4m3"], "--masks": ["none", "causal", "causal_bottom_right"]}


@SETTINGS
@given(axes=st.fixed_dictionaries({flag: st.lists(st.sampled_from(v), min_size=1, max_size=3, unique=True)
                                   for flag, v in MATRIX_AXES.items()}), training=st.booleans())
def test_matrix_never_answers_a_value_that_has_no_config(cache_dir, capsys, seen, axes, training):
    argv = ["matrix", "--head-dims", "64", "--gqa", "1", "--seqlens", "256", "--json"]
    for flag, values in axes.items():
        argv += [flag, ",".join(values)]
    code, out, _ = run(argv + (["--training"] if training else []), capsys)
    body = json.loads(out)
    if code == cli.EXIT_BAD_INPUT:
        return
    assert code == cli.EXIT_OK, body
    for axis, flag in (("feature", "--features"), ("dtype", "--dtypes"), ("mask", "--masks")):
        for value in axes[flag]:
            assert any(r[axis] == value and r["status"] != "invalid" for r in body["configs"]), (flag, value)


# -- "no usable GPU" is exit 3 on every command --------------------------------------------------


@pytest.mark.skipif(not _gpu_unavailable_reason(), reason="this machine has a usable GPU")
def test_no_gpu_is_exit_3_for_every_command_that_needs_one(cache_dir, capsys, monkeypatch):
    empty = str(cache_dir / "empty.tgz")
    assert run(["cache", "export", empty, "--all"], capsys)[0] == cli.EXIT_OK
    for argv in (["cache", "export", str(cache_dir / "b.tgz")], ["cache", "import", empty],
                 ["probe", *"--batch 1 --heads-q 8 --seqlen-q 64 --head-dim-qk 64".split()],
                 ["cache", "verify", "--load"]):
        code, _, err = run(argv, capsys)
        assert code == cli.EXIT_NO_GPU, (argv, err)
        assert "GPU" in err, err
    # info needs no GPU: it reports that there is none (exit 0).
    code, out, _ = run(["info"], capsys)
    assert code == cli.EXIT_OK and "device: none" in out and "gpu_error: fastattn cannot use the GPU" in out
    monkeypatch.setenv("FASTATTN_CACHE_TRUSTED", "1")  # (the bundle is unsigned)
    runtime.clear()
    assert run(["cache", "import", empty, "--force"], capsys)[0] == cli.EXIT_OK


class _Remote:
    """A remote tier whose every entry is rejected (unsigned, signed otherwise)."""

    name, disabled, kind = "redis://fake/0", "", "remote"
    counters: dict = {}
    policy = signing.Policy(b"a secret")

    def keys(self):
        return iter(["a" * 64, "b" * 64])

    def fetch(self, key):
        return None


def test_a_pull_that_gets_only_rejected_entries_fails(cache_dir, capsys, monkeypatch):
    cache = runtime.plan_cache()
    monkeypatch.setattr(cache.store, "remote", _Remote())
    code, out, err = run(["cache", "pull", "--all", "--json"], capsys)
    body = json.loads(out)
    assert code == cli.EXIT_FAILED and body["rejected"] == 2 and body["pulled"] == 0, body
    assert "rejected" in err


# -- one rule for flags: no abbreviations ------------------------------------------------------


def _long_options():
    out = []

    def walk(parser, path):
        for action in parser._actions:
            if action.dest in ("command", "cache_command"):
                for name, sub in action.choices.items():
                    walk(sub, path + [name])
            out.extend((tuple(path), s) for s in action.option_strings if s.startswith("--"))

    walk(build_parser(), [])
    return out


LONG_OPTIONS = _long_options()


@SETTINGS
@given(st.sampled_from(LONG_OPTIONS).flatmap(lambda o: st.tuples(st.just(o), st.integers(3, len(o[1]) - 1))),
       st.booleans())
def test_an_abbreviated_flag_is_a_usage_error_everywhere(cache_dir, capsys, no_work, option_cut, as_json):
    (path, option), cut = option_cut
    prefix = option[:cut]
    known = {o for p, o in LONG_OPTIONS if p == path}
    if prefix in known:
        return
    code, out, err = run([*path, prefix] + (["--json"] if as_json else []), capsys)
    assert code == cli.EXIT_BAD_INPUT, (path, prefix, out, err)
    text = json.loads(out)["message"] if as_json else err
    assert prefix in text or "arguments are required" in text, text


def test_jso_is_not_json_anywhere(cache_dir, capsys, no_work):
    for argv in (["info", "--jso"], ["probe", "--batch", "abc", "--jso"], ["cache", "ls", "--jso"]):
        code, out, err = run(argv, capsys)
        assert code == cli.EXIT_BAD_INPUT and not out and "--jso" in err


# -- paths: never empty, never `-` ------------------------------------------------------------


@pytest.mark.parametrize("argv,named", [
    (["warm", ""], "argument file"), (["probe", "--config", ""], "argument --config"),
    (["cache", "export", ""], "argument bundle"), (["cache", "import", ""], "argument bundle"),
    (["cache", "export", "-"], "argument bundle"), (["cache", "import", "-"], "argument bundle"),
    (["warm", "-"], "argument file"), (["probe", "--config", "-"], "argument --config"),
    (["warm", "--report", "-"], "argument --report"), (["matrix", "--png", "-"], "argument --png"),
])
def test_empty_and_dash_paths_are_usage_errors_naming_the_argument(argv, named, cache_dir, capsys, no_work,
                                                                    monkeypatch):
    monkeypatch.chdir(cache_dir)
    code, out, err = run(argv, capsys)
    assert code == cli.EXIT_BAD_INPUT and f"{named}:" in err and not out, err
    assert not os.path.exists(cache_dir / "-")


def test_export_does_not_replace_a_bundle_unless_forced(cache_dir, capsys):
    bundle = cache_dir / "b.tgz"
    bundle.write_bytes(b"keep me")
    code, _, err = run(["cache", "export", str(bundle), "--all"], capsys)
    assert code == cli.EXIT_BAD_INPUT and str(bundle) in err and "--force" in err
    assert bundle.read_bytes() == b"keep me"
    code, _, err = run(["cache", "export", str(bundle), "--all", "--force"], capsys)
    assert code == cli.EXIT_OK and bundle.read_bytes() != b"keep me", err
