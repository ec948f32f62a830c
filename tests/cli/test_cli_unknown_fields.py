"""A config field that is not AttentionConfig's (`"bätch"`, a typo) is named, wherever
a config is read from a file or JSON: `probe --config` (a file of one config's fields or
a "configs" list of one, JSON text), `warm FILE` (JSON, TOML, JSON Lines), and the API's
AttentionConfig.from_dict / from_json. It is never reported as the required field it
stands for being missing ("missing --batch"), nor as a file of the wrong shape."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastattn
from fastattn import AttentionConfig, cli
from fastattn.config import FIELD_NAMES
from helpers.cli import run

ENTRY = {"batch": 1, "heads_q": 8, "seqlen_q": 128, "head_dim_qk": 64}


def _toml(entry: dict) -> str:
    return "".join(f"{json.dumps(k, ensure_ascii=False)} = {json.dumps(v)}\n" for k, v in entry.items())  # quoted keys: any name


# How each reader gets a config from a file or text: (argv, file name, file text) for
# an entry; {path} in argv is the file's path.
def _readers(entry: dict) -> dict[str, tuple[list[str], str | None, str | None]]:
    one = json.dumps(entry)
    return {
        "probe --config fields.json": (["probe", "--config", "{path}"], "c.json", one),
        "probe --config configs.json": (["probe", "--config", "{path}"], "c.json", json.dumps({"configs": [entry]})),
        "probe --config c.toml": (["probe", "--config", "{path}"], "c.toml", _toml(entry)),
        "probe --config JSON": (["probe", "--config", one], None, None),
        "warm fields.json": (["warm", "{path}", "--no-torch-ops"], "w.json", one),
        "warm configs.json": (["warm", "{path}", "--no-torch-ops"], "w.json", json.dumps({"configs": [entry]})),
        "warm w.toml": (["warm", "{path}", "--no-torch-ops"], "w.toml", "[[configs]]\n" + _toml(entry)),
        "warm w.jsonl": (["warm", "{path}", "--no-torch-ops"], "w.jsonl", json.dumps(ENTRY) + "\n" + one + "\n"),
    }


def _run_reader(reader: str, entry: dict, tmp_path, capsys) -> tuple[int, str]:
    argv, name, text = _readers(entry)[reader]
    if name is not None:
        (tmp_path / name).write_text(text, encoding="utf-8")
        argv = [a.replace("{path}", str(tmp_path / name)) for a in argv]
    code, out, err = run(argv, capsys)
    return code, err


def _assert_named(message: str, name: str) -> None:
    assert f"{name}=" in message and "is not a field of AttentionConfig" in message, message
    assert "missing" not in message and "required" not in message, message


@pytest.mark.parametrize("reader", sorted(_readers(ENTRY)))
def test_a_misspelt_field_is_named_by_every_reader(reader, tmp_path, capsys, cache_dir, no_work):
    entry = {("bätch" if k == "batch" else k): v for k, v in ENTRY.items()}
    code, err = _run_reader(reader, entry, tmp_path, capsys)
    assert code == cli.EXIT_BAD_INPUT, err
    _assert_named(err, "bätch")
    assert "did you mean 'batch'" in err, err


@pytest.mark.parametrize("reader", sorted(_readers(ENTRY)))
def test_a_config_of_unknown_fields_alone_is_named_too(reader, tmp_path, capsys, cache_dir, no_work):
    code, err = _run_reader(reader, {"bätch": 1}, tmp_path, capsys)
    assert code == cli.EXIT_BAD_INPUT, err
    _assert_named(err, "bätch")


_NAMES = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=12).filter(
    lambda n: n not in FIELD_NAMES and n != "configs")


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=_NAMES, replaces=st.sampled_from(sorted(ENTRY)), reader=st.sampled_from(sorted(_readers(ENTRY))))
def test_any_unknown_field_is_named_in_place_of_any_required_one(name, replaces, reader, tmp_path, capsys,
                                                                  cache_dir, no_work):
    entry = {(name if k == replaces else k): v for k, v in ENTRY.items()}
    code, err = _run_reader(reader, entry, tmp_path, capsys)
    assert code == cli.EXIT_BAD_INPUT, err
    assert "is not a field of AttentionConfig" in err and "missing" not in err, err


def test_the_api_names_it_too():
    entry = {("bätch" if k == "batch" else k): v for k, v in ENTRY.items()}
    for call in (lambda: AttentionConfig.from_dict(entry), lambda: AttentionConfig.from_json(json.dumps(entry))):
        with pytest.raises(fastattn.InvalidArgumentError) as e:
            call()
        _assert_named(str(e.value), "bätch")
        assert "did you mean 'batch'" in str(e.value)
