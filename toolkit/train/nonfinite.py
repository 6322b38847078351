"""What to do when a step's loss or gradient norm is NaN or infinite: skip it (counted) or stop."""

from __future__ import annotations

import math

from toolkit.errors import UserError


class NonFiniteGuard:
    """Decides per step whether to apply the update. After `patience` non-finite steps in a row with
    `policy="stop"`, `failure` says why the run must end; `skip` never ends it.

    Where the backend has applied the update before the loss is known (DeepSpeed steps inside
    backward), nothing can be skipped: the first non-finite step is a failure and the weights are
    no longer worth saving.
    """

    def __init__(self, policy: str, patience: int, can_skip: bool = True):
        self.policy = policy
        self.patience = patience if can_skip else 1
        self.can_skip = can_skip
        self.in_a_row = 0
        self.skipped = 0
        self.failure = ""

    def allows_update(self, step: int, loss: float, grad_norm: float) -> bool:
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        self.skipped += 1
        if (self.policy == "stop" or not self.can_skip) and self.in_a_row >= self.patience:
            self.failure = (
                f"step {step}: loss {loss}, grad_norm {grad_norm}: {self.in_a_row} non-finite in a row; "
                "lower train.learning_rate or check the data"
                + (
                    ""
                    if self.can_skip
                    else " (this backend updates inside backward, so no step can be skipped)"
                )
            )
        return False

    @property
    def weights_intact(self) -> bool:
        """False once a non-finite update reached the weights."""
        return self.can_skip or not self.skipped


def nonfinite_names(tensors) -> list[str]:
    """Names of the floating tensors in `tensors` ((name, tensor) pairs) holding a NaN or an infinity."""
    return [name for name, t in tensors if t.is_floating_point() and t.numel() and not t.isfinite().all()]


def refuse_nonfinite(source, names: list[str]) -> None:
    """Stop before anything trains on or exports weights that are not finite."""
    if names:
        raise UserError(nonfinite_message(source, names))


def nonfinite_message(source, names: list[str]) -> str:
    """The refusal for `names` (non-finite tensors read from `source`), or "" when there are none."""
    if not names:
        return ""
    return (
        f"{source}: weights are not finite (NaN or inf) in {len(names)} tensors, first {names[0]}; "
        "refusing to use them"
    )
