"""Work that must not grow faster than its input: reading a warm file is linear in its
size, a file past the cap is refused before any config is made, and a warm without a
GPU stops at the first answer that says so. Asserted by counting the work (characters
scanned, configs made, configs sent to workers), never by timing it."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastattn import AttentionConfig, InvalidArgumentError, LibraryError, cli, runtime, config_files, warm
from fastattn.cli._common import exit_code

ENTRY = {"batch": 1, "heads_q": 8, "seqlen_q": 64, "head_dim_qk": 64}


@pytest.fixture(autouse=True)
def _fresh_runtime():
    yield
    runtime.clear()  # (the tests below give this process a GPU, or take it away)


class _Scanned(str):
    """A str that counts the characters its count() and find() calls read."""

    spanned = 0

    def count(self, sub, start=0, end=None):
        end = len(self) if end is None else end
        _Scanned.spanned += max(0, end - start)
        return super().count(sub, start, end)

    def find(self, sub, start=0, end=None):
        found = super().find(sub, start, end)
        stop = (len(self) if end is None else end) if found < 0 else found + len(sub)
        _Scanned.spanned += max(0, stop - start)
        return found


@pytest.mark.parametrize("entries", [10, 1000, 3000])
def test_the_lines_of_a_json_files_entries_are_found_in_one_pass(entries):
    # Each entry's line was counted from the top of the file: a file of n entries made
    # n**2 / 2 characters of work (100,001 configs: 208 s before the cap refused them).
    text = '{"configs": [\n' + ",\n".join(json.dumps({**ENTRY, "seqlen_q": 64 + i}) for i in range(entries)) + "\n]}"
    _Scanned.spanned = 0
    lines = config_files._json_entry_lines(_Scanned(text), entries)
    assert lines == list(range(2, entries + 2))
    assert _Scanned.spanned <= 2 * len(text), (_Scanned.spanned, len(text))


def _made(monkeypatch) -> list[int]:
    made = [0]
    real = AttentionConfig.from_dict.__func__

    def counted(cls, data):
        made[0] += 1
        return real(cls, data)

    monkeypatch.setattr(AttentionConfig, "from_dict", classmethod(counted))
    return made


@pytest.mark.parametrize("name,render", [
    ("w.json", lambda es: json.dumps({"configs": es}, indent=1)),
    ("w.jsonl", lambda es: "\n".join(json.dumps(e) for e in es) + "\n"),
    ("w.toml", lambda es: "".join("[[configs]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in e.items())
                                  for e in es)),
])
def test_a_file_past_the_cap_is_refused_before_any_config_is_made(tmp_path, monkeypatch, name, render):
    # The cap was checked after each entry was expanded and validated: the 100,001st
    # config was refused after 100,000 had been made.
    monkeypatch.setattr(config_files, "MAX_CONFIGS", 50)
    made = _made(monkeypatch)
    entries = [{**ENTRY, "seqlen_q": 64 + i} for i in range(40)] + [{**ENTRY, "batch": [1, 2, 3, 4, 5, 6]}] * 3
    path = tmp_path / name
    path.write_text(render(entries))
    with pytest.raises(InvalidArgumentError, match=r"describes more than 50 configs \(counted up to .*configs\[41\]"):
        config_files.load_configs(str(path))
    assert made[0] == 0
    # At the cap, every config is made once and the file is read.
    path.write_text(render(entries[:40] + [{**ENTRY, "batch": list(range(2, 12))}]))
    assert len(config_files.load_configs(str(path))) == 50 and made[0] == 50


def _no_gpu_here(monkeypatch):
    def no_core():
        raise LibraryError("fastattn cannot use the GPU:\n  - fake: no GPU in this process")

    monkeypatch.setattr(runtime, "_core", no_core)
    runtime.clear()


def _sent(monkeypatch) -> list[AttentionConfig]:
    sent = []
    real = warm._Worker.send

    def send(self, item):
        sent.append(item.config)
        real(self, item)

    monkeypatch.setattr(warm._Worker, "send", send)
    return sent


def _configs(families: int, each: int) -> list[AttentionConfig]:
    return [AttentionConfig(batch=1, heads_q=8, seqlen_q=64 * (i + 1), head_dim_qk=d)
            for d in (32, 64, 128, 256)[:families] for i in range(each)]


@pytest.mark.parametrize("workers", [1, 3])
def test_warm_stops_at_the_first_answer_that_says_there_is_no_gpu(fake_workers, monkeypatch, workers):
    # Without a GPU every config went to a worker to fail alike: 60,000 configs, 26 s.
    monkeypatch.setenv("FAKE_NO_GPU", "1")
    _no_gpu_here(monkeypatch)
    sent = _sent(monkeypatch)
    configs = _configs(3, 20)
    report = warm.warm(configs, workers=workers)
    assert 1 <= len(sent) <= workers, len(sent)  # the first answer, and those already asked
    assert report.counts["failed"] == len(configs) and report.not_tried == len(configs) - len(sent)
    assert {(i.error_type, i.reason) for i in report.items} == {("LibraryError", report.items[0].reason)}
    assert "FAKE_NO_GPU" in report.items[0].reason
    assert exit_code(report) == cli.EXIT_NO_GPU


def test_warm_from_the_command_stops_at_no_gpu_with_exit_3(fake_workers, monkeypatch, capsys):
    from helpers.cli import run

    monkeypatch.setenv("FAKE_NO_GPU", "1")
    _no_gpu_here(monkeypatch)
    sent = _sent(monkeypatch)
    path = fake_workers / "w.json"
    path.write_text(json.dumps({"configs": [{**ENTRY, "seqlen_q": {"from": 64, "to": 64 * 200, "step": 64}}]}))
    code, out, err = run(["warm", str(path), "--workers", "2", "--no-torch-ops"], capsys)
    assert code == cli.EXIT_NO_GPU, (out, err)
    assert 1 <= len(sent) <= 2, sent
    assert "no usable GPU" in err and "FAKE_NO_GPU" in err and f"{200 - len(sent)} not sent to a worker" in err, err


def test_a_worker_without_gpu_does_not_stop_a_warm_where_this_process_has_one(fake_workers, monkeypatch):
    # A LibraryError or CudaError from one config (a graph sub-library it alone needs)
    # is that config's failure where this process reaches the GPU: the others still run.
    import fake_core

    monkeypatch.setenv("FAKE_NO_GPU", "1")  # the workers'
    monkeypatch.setattr(fake_core, "_no_gpu", lambda: None)  # this process's: a GPU
    monkeypatch.setattr(runtime, "_core", lambda: fake_core)
    runtime.clear()
    sent = _sent(monkeypatch)
    configs = _configs(2, 5)
    report = warm.warm(configs, workers=2)
    assert len(sent) == len(configs) and report.not_tried == 0
    assert report.counts["failed"] == len(configs)


# -- the file itself: read with a bound, never waited on ----------------------------------------


def _sparse(path, size):
    with open(path, "wb") as f:
        f.truncate(size)
    return str(path)


@pytest.mark.parametrize("kind", ["fifo", "device", "oversize"])
def test_a_config_file_is_a_bounded_regular_file_whatever_the_caller(tmp_path, kind):
    # Through the API too (the command checks its paths before it reads them): a FIFO is
    # never waited on, a device never read, a file past MAX_FILE_BYTES refused unread (a
    # sparse 8 GiB file: reading it would take 8 GiB of memory).
    import os

    if kind == "fifo":
        path = str(tmp_path / "w.json")
        os.mkfifo(path)
    elif kind == "device":
        path = "/dev/zero"
    else:
        path = _sparse(tmp_path / "w.json", 8 << 30)
    with pytest.raises(InvalidArgumentError, match="not read"):
        config_files.load_configs(path)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(extra=st.integers(-40, 40), text=st.text(max_size=40))
def test_a_config_file_past_the_bound_is_refused_unread_and_within_it_parsed(tmp_path, monkeypatch, extra, text):
    # The bound at a small size: a file of exactly the bound is read (and then parsed or
    # refused for its content, as any file), one byte more is "not read".
    monkeypatch.setattr(config_files, "MAX_FILE_BYTES", 64)
    data = (text.encode() + b" " * 200)[: max(0, 64 + extra)]
    path = tmp_path / "w.toml"
    path.write_bytes(data)
    try:
        config_files.load_configs(str(path))
    except InvalidArgumentError as e:
        assert ("not read" in str(e)) == (len(data) > 64), (len(data), str(e))
    else:
        assert len(data) <= 64
