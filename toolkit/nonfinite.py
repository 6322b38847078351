"""What to do when a step's loss or gradient norm is NaN or infinite: skip it (counted) or stop."""

from __future__ import annotations

import math

from toolkit.errors import UserError


class NonFiniteGuard:
    """Skips non-finite steps; raises once `patience` of them come in a row (never, with `policy="skip"`)."""

    def __init__(self, policy: str, patience: int):
        self.policy = policy
        self.patience = patience
        self.in_a_row = 0
        self.skipped = 0

    def should_skip(self, step: int, loss: float, grad_norm: float) -> bool:
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.in_a_row = 0
            return False
        self.in_a_row += 1
        self.skipped += 1
        if self.policy == "stop" and self.in_a_row >= self.patience:
            raise NonFiniteStop(
                f"step {step}: loss {loss}, grad_norm {grad_norm} — {self.in_a_row} non-finite step(s) in a row; "
                "lower train.learning_rate, check the data, or set train.nonfinite=skip"
            )
        return True


class NonFiniteStop(UserError):
    """Training diverged; the last checkpoint is still valid."""
