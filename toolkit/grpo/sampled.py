"""One round's completions from the generation engine (grpo/engine.py), as the sampler shares them and a
checkpoint keeps the round sent ahead."""

from __future__ import annotations

from dataclasses import dataclass

import torch

AHEAD = "ahead."
"""The prefix of the round sent ahead in a checkpoint's recipe state."""


@dataclass
class Sampled:
    """One round's completions from the engine."""

    round_index: int
    tokens: torch.Tensor
    """[N, max_new_tokens], padded with 0 after each one's length."""
    lengths: torch.Tensor
    """[N]"""
    logps: torch.Tensor
    """The engine's log-prob of each sampled token, [N, max_new_tokens] float64."""
    version: int
    """Rounds trained into the weights that sampled it."""
    times: torch.Tensor
    """Unix times its requests went out and its last answer came back, [2] float64."""

    @classmethod
    def empty(cls, round_index: int, count: int, width: int, version: int) -> Sampled:
        zeros = torch.zeros(count, width, dtype=torch.long)
        return cls(
            round_index,
            zeros,
            torch.zeros(count, dtype=torch.long),
            zeros.double(),
            version,
            torch.zeros(2).double(),
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        about = torch.tensor([self.round_index, self.version], dtype=torch.long)
        tensors = {"about": about, "tokens": self.tokens, "lengths": self.lengths, "logps": self.logps}
        tensors["times"] = self.times.double()
        return {AHEAD + name: value.contiguous() for name, value in tensors.items()}

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor]) -> Sampled:
        round_index, version = state[AHEAD + "about"].tolist()
        fields = (state[AHEAD + name] for name in ("tokens", "lengths", "logps"))
        return cls(round_index, *fields, version, state[AHEAD + "times"])
