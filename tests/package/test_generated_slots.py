"""The slots' spellings that tools/gen_slots.py writes from their one declaration,
fastattn/_slots.py (fastattn_abi.h's X-macro table, _core.pyx's kSlot* names, forward's
and backward's parameters and _put lines, their stubs in _core.pyi), are what it would
write now: a slot changed in the table and not regenerated, or a generated line edited
by hand, fails here, on CPU."""

import importlib.util
import subprocess
import sys

import pytest

from helpers.paths import ROOT

GEN = ROOT / "tools" / "gen_slots.py"


def _gen():
    spec = importlib.util.spec_from_file_location("gen_slots", GEN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generated_slot_regions_are_current():
    done = subprocess.run([sys.executable, str(GEN), "--check"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("path,line", [
    ("fastattn/_core.pyx", "        _put(self, t, kSlotSeqLenKV, seq_len_kv)\n"),
    ("fastattn/_core.pyi", "        page_table_k: Address = 0,\n"),
    ("fastattn/include/fastattn_abi.h", '    X(SINK, Sink, "sink", "the plan was built with sinks=False") \\\n'),
])
def test_a_generated_line_edited_by_hand_is_stale(path, line):
    gen = _gen()
    text = (ROOT / path).read_text()
    assert line in text
    edited = text.replace(line, line.replace("_kv", "_q").replace("page_table_k", "page_table").replace("Sink,", "Snk,"),
                          1)
    assert edited != text
    assert gen.render(ROOT / path, edited, gen.regions()[ROOT / path]) == text


def test_the_c_names_follow_from_the_slot_names():
    gen = _gen()
    cases = {"q": ("Q", "Q"), "d_o": ("DO", "DO"), "seq_len_kv": ("SEQ_LEN_KV", "SeqLenKV"),
             "d_bias": ("DBIAS", "DBias"), "descale_d_o": ("DESCALE_DO", "DescaleDO"),
             "cu_seqlens_kv": ("CU_SEQLENS_KV", "CuSeqlensKV"), "page_table_k": ("PAGE_TABLE_K", "PageTableK")}
    assert {n: (gen.upper(n), gen.camel(n)) for n in cases} == cases


def test_the_table_says_what_each_direction_takes_once():
    from fastattn._slots import KW, OPT, SLOTS
    gen = _gen()
    slots = gen.check_table()
    assert [s.index for s in slots] == list(range(45))
    # Every slot is a parameter of forward or backward; the parameters without a slot
    # are the workspace, the stream and, last, a shape-override plan's call shape.
    assert all(s.forward or s.backward for s in slots)
    assert [s.name for s in SLOTS if s.index is None] == ["workspace", "stream"]
    assert all(s.forward == s.backward == OPT for s in SLOTS if s.index is None)
    assert gen.params("forward")[gen.params("forward").index("*") + 1:] == [
        f"{s.name}=0" for s in SLOTS if s.forward == KW] + ["at=None"]
