"""The one exception type for mistakes a user can make; the CLI and recipes print it as one line."""

import os
import sys


class UserError(Exception):
    """Bad input (config, data, paths, launch setup): the message says what and where."""


USER_ERROR_EXIT_CODE = 2


def run_main(main, argv: list[str], prog: str) -> int:
    """Run a recipe's `main`; a UserError becomes one line on stderr and exit code 2.

    Every rank of a launch meets the same mistakes (a config, a path, an agreed check), so only the
    main process (RANK 0, or a lone process) prints it: once per launch, not once per rank.
    """
    try:
        return main(argv)
    except UserError as exc:
        if os.environ.get("RANK", "0") == "0":
            _close_progress_bars()
            print(f"{prog}: error: {exc}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE


def _close_progress_bars() -> None:
    """A bar left open by the error ends its line first, so the message gets a line of its own."""
    bars = sys.modules.get("tqdm.std")
    if bars is not None:
        for bar in list(bars.tqdm._instances):
            bar.close()
