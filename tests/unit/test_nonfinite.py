import math

from toolkit.train.nonfinite import NonFiniteGuard


def test_stop_policy_skips_then_fails_after_patience():
    guard = NonFiniteGuard("stop", patience=2)
    assert guard.allows_update(1, 1.0, 1.0)
    assert not guard.allows_update(2, math.nan, 1.0) and not guard.failure
    assert guard.allows_update(3, 1.0, 1.0)  # a finite step resets the count
    assert not guard.allows_update(4, 1.0, math.inf) and not guard.failure
    assert not guard.allows_update(5, math.nan, math.nan)
    assert guard.failure.startswith("step 5:") and guard.skipped == 3 and guard.weights_intact


def test_skip_policy_never_fails():
    guard = NonFiniteGuard("skip", patience=1)
    assert not any(guard.allows_update(step, math.nan, 1.0) for step in range(10))
    assert guard.skipped == 10 and not guard.failure


def test_backends_that_update_inside_backward_fail_at_once():
    guard = NonFiniteGuard("skip", patience=5, can_skip=False)
    assert guard.weights_intact
    assert not guard.allows_update(7, math.nan, 1.0)
    assert "step 7" in guard.failure and "no step can be skipped" in guard.failure
    assert not guard.weights_intact
