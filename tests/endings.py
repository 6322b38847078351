"""How multi-process runs end, counted over many launches: `python tests/endings.py --launches 200`.

Alternates two DDP launches of the SFT recipe on two gloo processes (warm-started as the launched tests are;
FTKIT_TEST_LAUNCH=real for the real launcher): one that trains a step and ends well (exit 0), and one whose
output_dir another process holds, so every rank raises the same mistake after the process group is up
(each rank exits 2 with one line; accelerate's launcher then exits 1, and `ftkit train` passes the 2 on).
A launch that hangs (guard: LAUNCH_TIMEOUT), aborts in gloo's teardown, has a rank end by a signal other
than the launcher's SIGTERM, or ends with another code is a wrong ending: printed with its stderr. Prints one
line per launch and a closing count."""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import (  # noqa: E402
    LAUNCH_TIMEOUT,
    TEARDOWN_ABORT,
    LaunchTimedOut,
    free_port,
    launch,
    recipe_command,
    run_command,
)

from toolkit.checkpoint import rundir  # noqa: E402

# torchrun's report of each failed rank (-15: stopped by the launcher's SIGTERM once another had failed).
RANK_EXIT = re.compile(r"exitcode\s*:\s*(-?\d+)")


def one_launch(root: Path, failing: bool) -> tuple[str, str]:
    """('ok' or what went wrong, the stderr's end) for one launch."""
    out = root / ("held" if failing else "run")
    shutil.rmtree(out, ignore_errors=True)
    held = rundir.hold_lock(out) if failing else None
    overrides = ["train.max_steps=1", "eval.max_batches=0", "train.overwrite=true"]
    command, env = recipe_command(
        out, *overrides, launch=[*launch("ddp"), "--main_process_port", str(free_port())]
    )
    try:
        result = run_command(command, env, LAUNCH_TIMEOUT)
    except LaunchTimedOut as hung:
        return "hung", str(hung)[-4000:]
    finally:
        if held is not None:
            held.close()
    expected = 1 if failing else 0
    ranks = [int(code) for code in RANK_EXIT.findall(result.stderr)]
    if TEARDOWN_ABORT in result.stderr:
        return f"aborted in gloo's teardown (exit {result.returncode})", result.stderr[-4000:]
    if result.returncode != expected:
        return f"exit {result.returncode}, expected {expected}", result.stderr[-4000:]
    if failing and (result.stderr.count("is in use by another run") != 1 or 2 not in ranks):
        return "no rank exited 2 with the held output_dir's one line", result.stderr[-4000:]
    if failing and not set(ranks) <= {2, -15}:
        return f"ranks exited {ranks}", result.stderr[-4000:]
    return "ok", ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=200, help="launches in all, half of each case")
    args = parser.parse_args()
    wrong = 0
    with tempfile.TemporaryDirectory(prefix="endings-") as folder:
        for index in range(args.launches):
            failing = index % 2 == 1
            begun = time.monotonic()
            verdict, stderr = one_launch(Path(folder), failing)
            case = "held output_dir" if failing else "ends well"
            print(f"{index + 1:4d} {case:16s} {verdict} ({time.monotonic() - begun:.1f} s)", flush=True)
            if verdict != "ok":
                wrong += 1
                print(stderr, flush=True)
    print(f"{args.launches - wrong} right endings, {wrong} wrong, in {args.launches} launches")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
