"""Every benchmark's ``--quick`` flag: its smallest mode, seconds to a minute on 2 cores.

A quick run goes through the same code and prints the same figures on small sizes and single
repeats; it shows that the benchmark works (tests/test_bench.py runs each so), not how fast the
code is: quote figures of full runs only.
"""

from __future__ import annotations

import argparse


def parse_arguments(parser: argparse.ArgumentParser, quick: dict) -> argparse.Namespace:
    """The command line's arguments, ``--quick`` added: with it, ``quick`` gives the defaults
    (an option given explicitly still wins)."""
    parser.add_argument("--quick", action="store_true",
                        help="smallest mode, to check that the benchmark runs: "
                             + ", ".join(f"--{name.replace('_', '-')} {_words(value)}"
                                         for name, value in quick.items()))
    if parser.parse_known_args()[0].quick:
        parser.set_defaults(**quick)
    return parser.parse_args()


def _words(value) -> str:
    """A default as it is typed: 2, or 2 3 for a list."""
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)
