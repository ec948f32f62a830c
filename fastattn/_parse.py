"""How fastattn reads what a person types as a list or a number, in a flag or a
FASTATTN_* variable: one parser per kind, so that a kind means the same wherever it is
written (fastattn.env, fastattn.cli._common and fastattn.shape_classes build on these).

Each parser raises ValueError with the rule the text broke, without the text or the
name it was given under: the caller says which flag or variable, and quotes the value
in its own way (argparse's "argument --x: ...", env's "NAME=value: ...").
"""

from __future__ import annotations

__all__ = ["items"]

# Python's str.strip() also strips Unicode spaces (U+3000, U+00A0) that no shell or
# other program reading the same text treats as a separator.
SPACES = " \t\n\r\x0b\x0c"


def items(text: str) -> list[str]:
    """The items of a comma-separated list, each stripped of the spaces around it. An
    empty item, wherever it stands (`64,,128`, `,64`, `64,`, or nothing at all), is
    refused, naming its place: dropping it would read a list the user did not write."""
    out = [part.strip(SPACES) for part in text.split(",")]
    for i, item in enumerate(out, 1):
        if not item:
            raise ValueError("an empty list" if len(out) == 1 else f"item {i} is empty (of {len(out)} items)")
    return out
