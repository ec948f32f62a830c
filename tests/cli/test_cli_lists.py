"""Comma-separated lists (matrix's grid flags, warm --shape-classes,
FASTATTN_SHAPE_CLASSES) are read by one parser: items separated by commas, spaces
around an item allowed, an empty item refused wherever it stands (`64,,128`, `,64`,
`64,`), naming its place: a dropped item would be a grid or a class set the user did not
write."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastattn
from fastattn import cli, env, shape_classes
from fastattn.cli._main import build_parser
from helpers.cli import run

# Every list flag, with items it takes (in ascending order, as --shape-classes needs).
LIST_FLAGS = {
    ("matrix", "--head-dims"): ["64", "128", "256"],
    ("matrix", "--gqa"): ["1", "2", "4"],
    ("matrix", "--seqlens"): ["128", "1024", "4096"],
    ("matrix", "--masks"): ["none", "causal", "causal_bottom_right"],
    ("matrix", "--dtypes"): ["fp16", "bf16", "fp8_e4m3"],
    ("matrix", "--features"): ["dense", "padding", "bias"],
    ("warm", "--shape-classes"): ["256", "1024", "4096"],
}


def _parser_of(command: str, flag: str):
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return next(a for a in sub.choices[command]._actions if flag in a.option_strings).type


def test_every_list_flag_is_here():
    found = {(name, o) for name, p in next(a for a in build_parser()._actions
                                            if isinstance(a, argparse._SubParsersAction)).choices.items()
             for a in p._actions for o in a.option_strings if isinstance(a.metavar, str) and "," in a.metavar}
    assert found | {("warm", "--shape-classes")} == set(LIST_FLAGS)


def _with_empty(items: list[str], at: int) -> str:
    return ",".join(items[:at] + [""] + items[at:])


@pytest.mark.parametrize("command,flag", sorted(LIST_FLAGS))
def test_an_empty_item_is_refused_by_every_list_flag(command, flag, capsys, cache_dir, no_work):
    items = LIST_FLAGS[(command, flag)]
    for at in range(len(items) + 1):  # inside, first, last
        text = _with_empty(items, at)
        code, out, err = run([command, flag, text], capsys)
        assert code == cli.EXIT_BAD_INPUT and flag in err, (text, err)
        assert f"item {at + 1} is empty" in err, (text, err)


def test_the_environments_list_refuses_an_empty_item_alike():
    for at in range(4):
        with pytest.raises(fastattn.InvalidArgumentError, match=f"item {at + 1} is empty"):
            env.get("FASTATTN_SHAPE_CLASSES", {"FASTATTN_SHAPE_CLASSES": _with_empty(["256", "1024", "4096"], at)})


@settings(max_examples=80, deadline=None, derandomize=True)
@given(key=st.sampled_from(sorted(LIST_FLAGS)), data=st.data())
def test_every_list_flag_reads_what_was_written(key, data):
    """Any non-empty run of valid items, with spaces around them, reads as those items
    in order; with an empty item put anywhere, it is refused with that item's place."""
    items = LIST_FLAGS[key]
    chosen = data.draw(st.lists(st.sampled_from(items), min_size=1, max_size=3, unique=True))
    chosen.sort(key=items.index)
    spaced = [data.draw(st.sampled_from(["", " "])) + i + data.draw(st.sampled_from(["", " "])) for i in chosen]
    parse = _parser_of(*key)
    got = parse(",".join(spaced))
    if key[1] == "--shape-classes":
        assert got == shape_classes.parse(",".join(chosen))
    else:
        assert [str(v) for v in got] == chosen
    at = data.draw(st.integers(0, len(spaced)))
    with pytest.raises(argparse.ArgumentTypeError, match=f"item {at + 1} is empty"):
        parse(_with_empty(spaced, at))
