"""A recipe's entry point: its command line (`recipe_args`) and its end (`exit_with`), shared by every
recipe in recipes/."""

from __future__ import annotations

import argparse
import atexit
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import NoReturn

from toolkit import console
from toolkit.errors import leave_at_once, run_main
from toolkit.typed_yaml import Sources

# The exit status of a process that Ctrl-C ended (Python dies of SIGINT; a shell reports 128 + 2).
INTERRUPTED = -signal.SIGINT


def exit_with(main, prog: str) -> NoReturn:
    """A recipe's entry point: known third-party noise quieted, `main(sys.argv[1:])` run (a UserError or a
    stop becomes its line and exit code), then out on every path as `leave` does."""
    console.quiet_third_party()
    leave(lambda: run_main(main, sys.argv[1:], prog))


def leave(body) -> NoReturn:
    """Run `body()` and end the process with the code it returns (None: 0), or the one Python would give
    its ending (a crash: the traceback as Python prints it, then 1; `sys.exit(x)`: x), never through
    Python's teardown.

    A process with a gloo process group has no safe way through that teardown: with the group alive, a gloo
    thread still joinable as C++ destroys it aborts the process ("terminate called without an active
    exception", SIGABRT in place of the exit code); destroying the group first takes gloo's work lock with
    the GIL held while a gloo worker may hold that lock and wait for the GIL to release the last
    collective's tensors (a deadlock, caught in a rank's stacks). So the group stays alive and the process
    leaves with os._exit once its streams are flushed; a run that failed still runs the atexit handlers
    first (a tracker marks its run failed, the data loaders' workers are told to end)."""
    try:
        code = exit_code(body())
    except SystemExit as exc:
        code = exit_code(exc.code)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code = INTERRUPTED
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    if code != 0:
        atexit._run_exitfuncs()
    if code == INTERRUPTED:
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    leave_at_once(code)


def exit_code(code) -> int:
    """What Python makes of `sys.exit(code)`: None is 0, a number itself, anything else printed and 1."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def lost_line(reason: str, output_dir, saved_step: int) -> str:
    """The line ending a run that `reason` stopped mid-run: where its steps are (the checkpoint of
    `saved_step`; 0: none) and this recipe's command line as the one that continues it, train.resume=auto
    in place of train.overwrite and train.resume."""
    script, *args = sys.argv
    kept = [arg for arg in args if not arg.startswith(("train.overwrite=", "train.resume="))]
    again = "accelerate launch <launch options> " + shlex.join([script, *kept, "train.resume=auto"])
    saved = f"checkpoint of step {saved_step} in {Path(output_dir) / 'checkpoints' / f'step-{saved_step}'}"
    return f"{reason}; {saved if saved_step else 'no step trained to save'}; continue: {again}"


def config_sources(args: argparse.Namespace, default) -> Sources:
    """Where the recipe config's values came from: `args.config` (else `default`), but for the keys its
    overrides set on the command line."""
    return Sources.given(args.config or str(default), args.overrides)


def recipe_args(argv: list[str], doc: str, default_config: str, example: str) -> argparse.Namespace:
    """A recipe's command line: `--config` (else `default_config`) and dotted.key=value overrides."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--config", help=f"recipe config YAML (default: {default_config})")
    parser.add_argument("overrides", nargs="*", help=f"dotted.key=value overrides, e.g. {example}")
    return parser.parse_args(argv)
