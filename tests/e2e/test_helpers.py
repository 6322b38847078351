"""The test launcher's one retry: only for a rank aborting in gloo's teardown, with the output put back."""

import sys

from helpers import TEARDOWN_ABORT, run_launched

# Fails the first time it runs (appending to out/log.txt first), succeeds the second.
SCRIPT = """
import sys, pathlib
out = pathlib.Path(sys.argv[1]); out.mkdir(exist_ok=True)
log = out / "log.txt"
first = not (out.parent / "ran").exists()
(out.parent / "ran").touch()
log.write_text(log.read_text() + "x" if log.exists() else "x")
if first:
    sys.exit(sys.argv[2])
"""


def test_teardown_abort_runs_again_from_the_same_start(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "log.txt").write_text("before:")
    result = run_launched([sys.executable, "-c", SCRIPT, str(out), TEARDOWN_ABORT], keep=out)
    assert result.returncode == 0
    assert (out / "log.txt").read_text() == "before:x"  # the first try's write was undone
    assert not list(tmp_path.glob(".*"))  # no backup left behind


def test_any_other_failure_stands(tmp_path):
    out = tmp_path / "out"
    result = run_launched([sys.executable, "-c", SCRIPT, str(out), "Traceback: a real error"], keep=out)
    assert result.returncode == 1 and "a real error" in result.stderr
    assert (out / "log.txt").read_text() == "x"
