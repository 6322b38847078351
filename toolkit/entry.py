"""A recipe's entry point: its command line (`recipe_args`) and its end (`exit_with`), shared by every
recipe in recipes/."""

from __future__ import annotations

import argparse
import sys

from toolkit import console, distributed
from toolkit.errors import leave_at_once, run_main


def exit_with(main, prog: str):
    """A recipe's entry point: known third-party noise quieted, `main(sys.argv[1:])` run (a UserError or a
    stop becomes its line and exit code); a run that ends well leaves at once, any other ending closes the
    process group first (toolkit/distributed.py `close`), so the code gets out."""
    console.quiet_third_party()
    try:
        code = run_main(main, sys.argv[1:], prog)
    except BaseException:
        distributed.close()
        raise
    if code == 0:
        leave_at_once(code)
    distributed.close()
    sys.exit(code)


def recipe_args(argv: list[str], doc: str, default_config: str, example: str) -> argparse.Namespace:
    """A recipe's command line: `--config` (else `default_config`) and dotted.key=value overrides."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--config", help=f"recipe config YAML (default: {default_config})")
    parser.add_argument("overrides", nargs="*", help=f"dotted.key=value overrides, e.g. {example}")
    return parser.parse_args(argv)
