"""A tiny OpenEnv environment for the tests (openenv-core's server): an episode lasts 2 or 3 steps (its seed
chooses), each step answers how many characters the message had and rewards a message of even length.
A message with "boom" makes the step raise; one with "sleep" makes it take 3 s. Serve it with
`uvicorn openenv_countdown:app` (from tests/) or in a thread; `COUNTS` tallies what this process served,
`CLOSED` the sessions it closed."""

from __future__ import annotations

import time
from collections import Counter

from openenv.core.env_server import Environment, create_app
from openenv.core.env_server.types import Action, Observation, State

COUNTS: Counter = Counter()
"""Requests served by this process, by kind (reset, step)."""
CLOSED: Counter = Counter()
"""Sessions closed by this process (sessions), counted when the server ends them."""
SEEDS: list = []
"""The seeds and prompts resets got."""


class Say(Action):
    message: str


class Heard(Observation):
    text: str = ""
    left: int = 0


class Countdown(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self.left, self._state = 0, State()

    def reset(self, seed: int | None = None, prompt: str = "", **kwargs) -> Heard:
        COUNTS["reset"] += 1
        SEEDS.append((seed, prompt))
        self.left = 2 + (seed or 0) % 2
        return Heard(text=f"{self.left} turns", left=self.left)

    def step(self, action: Say, **kwargs) -> Heard:
        COUNTS["step"] += 1
        if "boom" in action.message:
            raise RuntimeError("the countdown exploded")
        if "sleep" in action.message:
            time.sleep(3)
        self.left -= 1
        text = f"you wrote {len(action.message)} characters; {self.left} left"
        reward = float(len(action.message) % 2 == 0)
        return Heard(text=text, left=self.left, reward=reward, done=self.left <= 0)

    def close(self) -> None:
        CLOSED["sessions"] += 1

    @property
    def state(self) -> State:
        return self._state


app = create_app(Countdown, Say, Heard, env_name="countdown", max_concurrent_envs=64)
