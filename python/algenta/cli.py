"""The ``algenta`` command line (also ``python -m algenta``).

Each subcommand lives in its own module listed in ``_SUBCOMMANDS``; the module exposes
``register(subparsers)``, which adds its parser and sets ``handler=<callable(args) -> int>``.

Exit status: what the handler returns (0 success; a subcommand may use 1 for a negative answer),
2 for bad input. Bad input is one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

_SUBCOMMANDS = ["algenta.cli_plan", "algenta.cli_generate", "algenta.cli_serve"]


class CliError(Exception):
    """Bad input to a subcommand: reported as one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    # argparse's own errors print the usage block and then the message; one line is easier to
    # read in a script's log, and --help still shows the usage.
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = _Parser(
        prog="algenta",
        description="Size resident decode sessions and chunked training losses before running them.",
    )
    parser.add_argument("--version", action="version", version=f"algenta {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _SUBCOMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    prog = f"algenta {args.command}"
    try:
        return int(handler(args) or 0)
    except CliError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `algenta plan ... | head`: the reader left, not an error of ours
        # Point stdout at /dev/null so the interpreter's final flush does not complain.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:  # a file that cannot be read is bad input too
        where = f": {e.filename}" if getattr(e, "filename", None) else ""
        print(f"{prog}: error: {e.strerror or e}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
