"""Reward functions: the built-ins, the user's own and a trained reward model, named in the grpo section,
weighted and summed.

A user's function takes (prompts, completions, answers), three lists of strings of one length, and returns
one float per completion; the built-ins also get each completion's token count. A user's function whose one
parameter is named `trajectories` scores whole conversations instead: `f(trajectories) -> list[float]`, each
trajectory a dict (grpo/multiturn.py's `trajectories`: the prompt, the turns as chat messages, the reference
answer, the counts of turns and tool calls). A user's function
(`module:function` or `path/to/file.py:function`) is imported only because the user's own config or command
line names it: that is the user running their own code. A reward model (a folder `recipes/reward_llm.py`
exported) scores each completion's tokens after its prompt's, on every process.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import re
import sys
from pathlib import Path

from toolkit.errors import UserError
from toolkit.model import scalar


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


class ModelReward:
    """A trained reward model at `path`, whole on this process's `device` (a frozen scorer, outside any
    sharding): the score of each row of token ids. It reads the policy's tokens as its own, so their
    tokenizers must be the same (`check_tokenizer`)."""

    def __init__(self, path: str, device=None, batch_size: int = 32):
        from toolkit.checkpoint.export import outside_zero3
        from toolkit.model.for_generation import load_for_generation

        self.path, self.device, self.batch_size = path, device, batch_size
        with outside_zero3():  # whole on each process: a ZeRO-3 run would partition it as it loads
            self.model, self.tokenizer = load_for_generation(Path(path))
        self.model.to(device).requires_grad_(False)

    def check_tokenizer(self, tokenizer) -> None:
        if self.tokenizer.get_vocab() != tokenizer.get_vocab():
            raise UserError(
                f"grpo.rewards: {self.path}: the reward model's tokenizer differs from the policy's "
                "(model.path); it scores the policy's tokens, so train it from the same tokenizer"
            )

    def score(self, rows: list[list[int]]) -> list[float]:
        from toolkit.reward.score import score_rows

        return [
            value
            for start in range(0, len(rows), self.batch_size)
            for value in score_rows(
                self.model, rows[start : start + self.batch_size], self.tokenizer.pad_token_id, self.device
            )
        ]


class Rewards:
    """The configured functions, by name; `score` gives each one's values and their weighted sum."""

    def __init__(self, functions: dict, weights: list[float]):
        self.functions, self.weights = functions, weights

    @classmethod
    def build(cls, cfg, device=None) -> Rewards:
        """From the grpo section; a user's function is imported here, before the model loads, and a
        reward model loaded onto `device`."""
        functions = {}
        for name in cfg.rewards:
            if scalar.saved_scalar(name):
                if "model" in functions:
                    raise UserError("grpo.rewards: name one reward model (its metric is reward_model)")
                functions["model"] = ModelReward(name, device)
            elif name == "exact_answer":
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
                if takes_trajectories(user):
                    functions[short] = TrajectoryReward(user)
                else:
                    functions[short] = lambda p, c, a, lengths, user=user: user(p, c, a)
        return cls(functions, cfg.reward_weights or [1.0] * len(functions))

    def check_tokenizer(self, tokenizer) -> None:
        """Refuse a reward model that reads tokens other than the policy's `tokenizer` writes."""
        for function in self.functions.values():
            if isinstance(function, ModelReward):
                function.check_tokenizer(tokenizer)

    def score(
        self,
        prompts: list[str],
        completions: list[str],
        answers: list[str],
        lengths: list[int],
        rows=None,
        trajectories=None,
    ):
        """{name: values} for every function, and "total": their weighted sum; `lengths`: each
        completion's tokens; `rows`: each prompt's token ids followed by its completion's (what a reward
        model scores); `trajectories`: each whole conversation (what a trajectory reward scores)."""
        scores = {}
        for name, function in self.functions.items():
            if isinstance(function, ModelReward):
                values = function.score(rows)
            elif isinstance(function, TrajectoryReward):
                values = [float(v) for v in function.function(trajectories)]
            else:
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


class TrajectoryReward:
    """A user's reward on whole conversations: `function(trajectories) -> list[float]`."""

    def __init__(self, function):
        self.function = function


def takes_trajectories(function) -> bool:
    """Whether a user's reward declares it scores conversations: its one parameter is `trajectories`."""
    try:
        parameters = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: the three-list form
        return False
    return parameters == ["trajectories"]


# A user's file.py, run once per process: the config's checks import it, then the recipe uses the same module.
_USER_FILES: dict[Path, object] = {}


def load_user_function(spec: str, key: str = "grpo.rewards"):
    """The function `spec` names: `package.module:function`, or `path/to/file.py:function` (`key`: the
    config key that names it, for the one-line errors)."""
    where, _, name = spec.rpartition(":")
    if where.endswith(".py"):
        path = Path(where).expanduser()
        if not path.is_file():
            raise UserError(f"{key}: {where} does not exist")
        module = _USER_FILES.get(path.resolve())
        if module is None:
            module_spec = importlib.util.spec_from_file_location(f"ftkit_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
            _USER_FILES[path.resolve()] = module
    else:
        if str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))  # a module beside where the user launched from
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise UserError(f"{key}: cannot import {where} for {spec} ({exc})") from exc
    function = getattr(module, name, None)
    if not callable(function):
        raise UserError(f"{key}: {where} has no function {name}")
    return function
