"""Shared plumbing of the model tools' command lines (`model.summary`, `model.flops`).

Every bad input ends in one line `error: <problem>` on stderr and exit code 2
(docs/architecture.md): argparse's own errors (missing flag, bad choice, a float flag that is
not a finite number: `finite_float`) and the `ValueError`s of `load_config`, which name the
offending field.
"""

import argparse
import math
import sys
from typing import NoReturn, Sequence

from model.config import ModelConfig, load_config


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line, without the usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {' '.join(message.split())}\n")


def finite_float(text: str) -> float:
    """`type=` of a float flag: argparse turns `float()`'s inf and nan, which every later range
    check would let through or fail on without naming the flag, into its one-line error
    naming the flag (`argument --x: must be a finite number, got 'nan'`)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def report_error(err: BaseException) -> int:
    """Prints `err` as one line `error: ...` on stderr; returns the exit code 2."""
    print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
    return 2


def config_parser(module: str, doc: str) -> ArgumentParser:
    """Parser for `python -m <module>` with `--config PATH`, `key=value` overrides and `--json`;
    `doc` becomes the --help text."""
    parser = ArgumentParser(prog=f"python -m {module}", description=doc,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, metavar="PATH", help="YAML model preset")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted config overrides, e.g. moe.top_k=4 layout='SSSF*12'")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def parse_config(parser: ArgumentParser,
                 argv: Sequence[str] | None) -> tuple[argparse.Namespace, ModelConfig]:
    """-> (args, ModelConfig); exits with code 2 on bad flags or a bad config."""
    args = parser.parse_intermixed_args(argv)
    try:
        return args, load_config(args.config, args.overrides)
    except ValueError as err:
        parser.error(str(err))


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned first column, right-aligned others, widths fitted to the content."""
    table = [list(header), *[list(r) for r in rows]]
    widths = [max(len(r[c]) for r in table) for c in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if c == 0 else cell.rjust(w)
                       for c, (cell, w) in enumerate(zip(r, widths))) for r in table]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def human(n: float, unit: str = "") -> str:
    """1.96e11 -> '196.00 G' (+ unit); powers of 1000."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}{unit}"
    return f"{n:.0f} {unit}".rstrip()
