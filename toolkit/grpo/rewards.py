"""Reward functions: the built-ins and the user's own, named in the grpo section, weighted and summed.

A user's function takes (prompts, completions, answers), three lists of strings of one length, and returns
one float per completion; the built-ins also get each completion's token count. A user's function
(`module:function` or `path/to/file.py:function`) is imported only because the user's own config or command
line names it: that is the user running their own code.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
import sys
from pathlib import Path

from toolkit.errors import UserError


def exact_answer(prompts, completions, answers, lengths) -> list[float]:
    """1 where the completion, stripped, equals the reference answer."""
    return [float(c.strip() == a.strip()) for c, a in zip(completions, answers)]


def format_reward(pattern: str):
    compiled = re.compile(pattern, re.DOTALL)

    def matches(prompts, completions, answers, lengths) -> list[float]:
        """1 where the whole completion matches grpo.format_pattern."""
        return [float(compiled.fullmatch(c.strip()) is not None) for c in completions]

    return matches


def length_penalty(max_new_tokens: int):
    def penalty(prompts, completions, answers, lengths) -> list[float]:
        """Minus the share of grpo.max_new_tokens each completion used."""
        return [-n / max_new_tokens for n in lengths]

    return penalty


class Rewards:
    """The configured functions, by name; `score` gives each one's values and their weighted sum."""

    def __init__(self, functions: dict, weights: list[float]):
        self.functions, self.weights = functions, weights

    @classmethod
    def build(cls, cfg) -> Rewards:
        """From the grpo section; a user's function is imported here, before the model loads."""
        functions = {}
        for name in cfg.rewards:
            if name == "exact_answer":
                functions[name] = exact_answer
            elif name == "format":
                functions[name] = format_reward(cfg.format_pattern)
            elif name == "length":
                functions[name] = length_penalty(cfg.max_new_tokens)
            else:
                short = name.rpartition(":")[2]  # the metric is reward_<function name>
                if short in functions:
                    raise UserError(f"grpo.rewards: two reward functions are called {short}")
                user = load_user_function(name)
                functions[short] = lambda p, c, a, lengths, user=user: user(p, c, a)
        return cls(functions, cfg.reward_weights or [1.0] * len(functions))

    def score(self, prompts: list[str], completions: list[str], answers: list[str], lengths: list[int]):
        """{name: values} for every function, and "total": their weighted sum; `lengths`: each
        completion's tokens."""
        scores = {}
        for name, function in self.functions.items():
            values = [float(v) for v in function(prompts, completions, answers, lengths)]
            if len(values) != len(completions) or not all(math.isfinite(v) for v in values):
                raise UserError(
                    f"grpo.rewards: {name} must return one finite number per completion "
                    f"({len(completions)}), got {len(values)}"
                )
            scores[name] = values
        scores["total"] = [
            sum(w * scores[name][i] for name, w in zip(self.functions, self.weights))
            for i in range(len(completions))
        ]
        return scores


def load_user_function(spec: str):
    """The function `spec` names: `package.module:function`, or `path/to/file.py:function`."""
    where, _, name = spec.rpartition(":")
    if where.endswith(".py"):
        path = Path(where).expanduser()
        if not path.is_file():
            raise UserError(f"grpo.rewards: {where} does not exist")
        module_spec = importlib.util.spec_from_file_location(f"ftkit_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        if str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))  # a module beside where the user launched from
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise UserError(f"grpo.rewards: cannot import {where} for {spec} ({exc})") from exc
    function = getattr(module, name, None)
    if not callable(function):
        raise UserError(f"grpo.rewards: {where} has no function {name}")
    return function
