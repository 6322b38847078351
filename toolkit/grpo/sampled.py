"""One round's completions from the generation engine (grpo/engine.py), single-turn or conversations
(grpo/multiturn.py), as the sampler shares them and a checkpoint keeps the round sent ahead."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

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


STAT_NAMES = ("turns", "tool_calls", "tool_errors", "tool_timeouts")
"""What a conversation counts: its model turns, its tool calls (OpenEnv: steps), their errors and timeouts."""


@dataclass
class Conversation:
    """One completion of a multi-turn round: the model's turns and the environment's between them."""

    tokens: list[int] = field(default_factory=list)
    """Everything after the prompt: the model's turns and the environment's."""
    trained: list[int] = field(default_factory=list)
    """Per token: 1 where the model sampled it, 0 where the environment wrote it."""
    logps: list[float] = field(default_factory=list)
    """Per token: the engine's log-probability of a token it sampled, 0.0 elsewhere (HF generate: all 0.0)."""
    answer: str = ""
    """The model's last turn as text (what the rewards score)."""
    messages: list[dict] = field(default_factory=list)
    """The turns as chat messages: the model's (role assistant) and the tools' answers (role tool)."""
    done: bool = False
    reward: float | None = None
    """The environment's reward for the conversation (OpenEnv: the sum of its steps'; None: none given)."""
    stats: dict = field(default_factory=lambda: dict.fromkeys(STAT_NAMES, 0))

    def add(self, tokens: list[int], trained: int, logps: list[float] | None = None) -> None:
        self.tokens += tokens
        self.trained += [trained] * len(tokens)
        self.logps += list(logps) if logps is not None else [0.0] * len(tokens)

    def model_turn(self, tokens: list[int], text: str, logps: list[float] | None = None) -> None:
        """The model's turn (`text`: its tokens decoded), trained, and the conversation's answer so far."""
        self.add(tokens, 1, logps)
        self.stats["turns"] += 1
        self.answer = text.strip()
        self.messages.append({"role": "assistant", "content": self.answer})

    def environment_turn(self, tokens: list[int], budget: int) -> None:
        """What the environment wrote after the model's turn (masked), cut at the conversation's `budget`
        (grpo.max_new_tokens); with no room left for another model turn, the conversation ends."""
        room = budget - len(self.tokens)
        self.add(tokens[:room], 0)
        self.done = len(tokens) >= room


@dataclass
class SampledConversations:
    """One multi-turn round from the engine: its conversations, as the main process sampled them."""

    round_index: int
    talks: list[Conversation]
    version: int
    """Rounds trained into the weights that sampled it."""
    times: torch.Tensor
    """Unix times its first request went out and its last answer came back, [2] float64."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The conversations whole (tokens, masks, log-probs, answers, messages, counts, the environment's
        rewards) as JSON bytes: Python writes a float's shortest exact form, so they come back bit for bit."""
        text = json.dumps([dataclasses.asdict(talk) for talk in self.talks]).encode()
        tensors = {
            "about": torch.tensor([self.round_index, self.version], dtype=torch.long),
            "times": self.times.double(),
            "talks": torch.frombuffer(bytearray(text), dtype=torch.uint8),
        }
        return {AHEAD + name: value.contiguous() for name, value in tensors.items()}

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor]) -> SampledConversations:
        round_index, version = state[AHEAD + "about"].tolist()
        talks = json.loads(state[AHEAD + "talks"].numpy().tobytes())
        return cls(round_index, [Conversation(**talk) for talk in talks], version, state[AHEAD + "times"])


def ahead_round(state: dict[str, torch.Tensor]) -> Sampled | SampledConversations:
    """The round a checkpoint kept ahead (its recipe state holds one)."""
    if AHEAD + "talks" in state:
        return SampledConversations.from_state_dict(state)
    return Sampled.from_state_dict(state)
