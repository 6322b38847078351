"""The waiter a studio launch runs under: `python -m toolkit.studio.detach RECORD_DIR -- COMMAND...`.

It leads the launch's own session (so closing the browser or the studio leaves the run training), runs
COMMAND unchanged with its output in RECORD_DIR/output.log, and writes COMMAND's exit code to RECORD_DIR/exit,
which a restarted studio reads. A stop signal sent to the group is the run's to handle: the waiter only waits.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    record, command = Path(argv[0]), argv[argv.index("--") + 1 :]
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: None)  # reset to default in the child by exec
    with (record / "output.log").open("ab") as log:
        code = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    partial = record / "exit.tmp"
    partial.write_text(f"{code}\n")
    os.replace(partial, record / "exit")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
