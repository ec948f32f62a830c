"""The `fastattn` command's parser and its one entry point, `main`."""

from __future__ import annotations

import json
import sys
from typing import Sequence

from ..errors import CudaError, CudnnError, FastAttnError, InvalidArgumentError, LibraryError
from . import cache, info, matrix, probe, warm
from ._common import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_NO_GPU, Parser, fail, print_plain

# One module per command group; each adds its parser and runs its command.
_COMMANDS = {"info": info, "probe": probe, "warm": warm, "matrix": matrix, "cache": cache}


def build_parser() -> Parser:
    p = Parser(prog="fastattn", description="cuDNN fused attention with plans built once.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    for module in _COMMANDS.values():
        module.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code, out = _COMMANDS[args.command].run(args)
    except InvalidArgumentError as e:
        return fail(args, EXIT_BAD_INPUT, e)
    except (LibraryError, CudaError, CudnnError) as e:
        return fail(args, EXIT_NO_GPU, e)
    except ConnectionError as e:  # the remote tier, for push and pull
        return fail(args, EXIT_FAILED, e)
    except FastAttnError as e:  # pragma: no cover - a bug; still report it as data
        return fail(args, EXIT_NO_GPU, e)
    text = out.pop("_text", None)  # the human form, when a handler made one
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
    elif text is not None:
        print(text)
    else:
        print_plain(out)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
