"""The parallel encoder never hangs: workers ignore the run's stop handler, pools end without killing a
worker that holds a lock, and a worker that dies is reported instead of waited for."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from helpers import REPO

from toolkit.data.parallel import WorkerLost, ordered_map

# As the recipe's stop handler does, the parent catches SIGTERM; before the fix, a forked worker inherited
# the handler, Pool.terminate() could not end it, and most runs of this loop hung in Pool.__exit__.
MANY_MAPS = textwrap.dedent(
    """
    import signal
    from toolkit.data.parallel import ordered_map

    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    for _ in range(150):
        assert list(ordered_map(abs, range(-20, 20), 2)) == [abs(x) for x in range(-20, 20)]
    print("done")
    """
)


def test_many_parallel_maps_finish_while_the_parent_catches_sigterm():
    run = subprocess.run(
        [sys.executable, "-c", MANY_MAPS], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0 and run.stdout.strip() == "done", run.stderr[-2000:]


def _dispositions(_item):
    return signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_workers_start_with_default_signal_dispositions(signal_handlers_restored):
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    for term, int_default in ordered_map(_dispositions, range(4), 2):
        assert term == signal.SIG_DFL and int_default


def _die_on_three(item):
    if item == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return item


def test_a_worker_killed_mid_task_is_reported_not_waited_for():
    with pytest.raises(WorkerLost, match="worker process ended"):
        list(ordered_map(_die_on_three, range(8), 2))


def test_results_keep_input_order_with_more_items_than_the_window():
    assert list(ordered_map(abs, range(-50, 50), 2)) == [abs(x) for x in range(-50, 50)]
