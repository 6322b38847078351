"""The stop request: what a stop during loading or encoding raises, and the line it carries."""

import signal

import pytest

from toolkit.launch.preemption import Stopped, StopRequest

LINE = "stopped by SIGTERM before step 1; nothing new to save"


@pytest.fixture
def stop():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield StopRequest()
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_a_stop_inside_interruptible_names_what_it_interrupts(stop):
    with pytest.raises(Stopped, match=LINE), stop.interruptible("step 1"):
        stop._handle(signal.SIGTERM, None)


def test_a_stop_wrapped_by_a_library_still_names_what_it_interrupts(stop):
    # A loader that catches everything and raises its own error must not lose the "before step 1".
    with pytest.raises(Stopped, match=LINE), stop.interruptible("step 1"):
        try:
            stop._handle(signal.SIGTERM, None)
        except Exception as exc:
            raise RuntimeError("could not load the model") from exc


def test_a_failure_without_a_stop_is_left_alone(stop):
    with pytest.raises(RuntimeError, match="plain failure"), stop.interruptible("step 1"):
        raise RuntimeError("plain failure")


def test_outside_interruptible_a_stop_is_only_recorded(stop):
    stop._handle(signal.SIGTERM, None)
    assert stop.requested and stop.signal_name == "SIGTERM"
