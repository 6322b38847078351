"""The one exception type for mistakes a user can make; the CLI and recipes print it as one line."""


class UserError(Exception):
    """Bad input (config, data, paths, launch setup): the message says what and where."""


USER_ERROR_EXIT_CODE = 2


def run_main(main, argv: list[str], prog: str) -> int:
    """Run a recipe's `main`; a UserError becomes one line (see console.finish) and exit code 2, a stop
    before the first step its line and the preemption exit code."""
    from toolkit import console
    from toolkit.launch.preemption import PREEMPTED_EXIT_CODE, Stopped

    try:
        code, message = main(argv), ""
    except UserError as exc:
        code, message = USER_ERROR_EXIT_CODE, str(exc)
    except Stopped as exc:
        code, message = PREEMPTED_EXIT_CODE, ""
        console.say_once(str(exc))
    return console.finish(prog, code, message)


def leave_at_once(code: int) -> None:
    """End a process whose work is done and whose files are closed (the trackers ended with the run, the
    metrics appended line by line): the log handlers and the console flushed, then out, without Python's
    teardown of the thousands of modules a run imported (2 to 4 seconds a process on a CPU box, spent
    before the launcher can see the run ended). Any other ending goes through the full teardown."""
    import logging
    import os
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
