"""A tool environment for multi-turn GRPO: the user's Python functions the model may call, their JSON
schemas, the calls parsed from a model turn in the form chat templates write them, and each call run with a
timeout. Whatever goes wrong in a call (an unknown tool, arguments that do not fit, an exception, a timeout)
becomes the text of the tool turn the model reads next, never an error of the run.

A tool (`module:function` or `path/to/file.py:function`) is imported only because the user's own config or
command line names it: that is the user running their own code.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
from dataclasses import dataclass

from toolkit.errors import UserError
from toolkit.grpo.rewards import load_user_function

# Hermes/Qwen/ChatML (and the tools demo): each call a JSON object inside <tool_call> tags.
TAGGED_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass
class Call:
    name: str | None
    """The tool named (None when the call could not be read)."""
    arguments: dict
    problem: str = ""
    """Why the call could not be read ("" when it could)."""


@dataclass
class Result:
    content: str
    """What the tool turn says: the tool's return value as text, or the error."""
    kind: str = "ok"
    """ok | error (unknown tool, bad arguments, an exception) | timeout."""


def parse_calls(text: str) -> list[Call]:
    """The tool calls a model turn writes: <tool_call> blocks (ChatML, Qwen, Hermes, the tools demo), or a
    turn that is one JSON object with "name" and "parameters" or "arguments" (Llama 3's form)."""
    blocks = TAGGED_CALL.findall(text)
    if blocks:
        return [_call(block) for block in blocks]
    stripped = text.strip()
    if stripped.startswith("{") and stripped.endswith("}"):
        call = _call(stripped)
        if call.name is not None:
            return [call]
    return []


def _call(body: str) -> Call:
    try:
        data = json.loads(body.strip())
    except json.JSONDecodeError as exc:
        return Call(None, {}, f"the tool call is not JSON ({exc.msg})")
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return Call(None, {}, 'the tool call has no "name"')
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # some templates write the arguments as a JSON string
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        return Call(data["name"], {}, f"the arguments of {data['name']} are not a JSON object")
    return Call(data["name"], arguments)


class Environment:
    """The configured tools by name, their schemas, and the calls run with a timeout."""

    def __init__(self, tools: dict, timeout_s: float):
        self.tools, self.timeout_s = tools, timeout_s
        self.schemas = [tool_schema(name, function) for name, function in tools.items()]

    @classmethod
    def build(cls, grpo) -> Environment | None:
        """From the grpo section (None without tools); the user's functions are imported here, before
        the model loads."""
        if not grpo.environment.tools:
            return None
        tools = {}
        for spec in grpo.environment.tools:
            if ":" not in spec:
                raise UserError(
                    f"grpo.environment.tools: {spec!r} is not module:function or file.py:function"
                )
            function = load_user_function(spec, "grpo.environment.tools")
            if function.__name__ in tools:
                raise UserError(f"grpo.environment.tools: two tools are called {function.__name__}")
            tools[function.__name__] = function
        return cls(tools, grpo.environment.tool_timeout_s)

    def run(self, call: Call) -> Result:
        if call.problem:
            return Result(f"error: {call.problem}", "error")
        function = self.tools.get(call.name)
        if function is None:
            return Result(f"error: no tool {call.name}; the tools are {', '.join(self.tools)}", "error")
        return run_with_timeout(function, call.arguments, self.timeout_s, call.name)

    def run_each(self, calls: list[Call]) -> list[Result]:
        """One conversation's calls of a turn, one after another in the order it wrote them."""
        return [self.run(call) for call in calls]


def run_with_timeout(function, arguments: dict, timeout_s: float, name: str) -> Result:
    """`function(**arguments)` on a daemon thread: a call that runs past `timeout_s` is left behind (a
    thread cannot be stopped) and reported as a timeout; the run goes on and exits without waiting for it."""
    outcome: list[Result] = []

    def target():
        try:
            outcome.append(Result(str(function(**arguments))))
        except TypeError as exc:
            outcome.append(Result(f"error: bad arguments for {name} ({exc})", "error"))
        except Exception as exc:  # the user's tool failing is the model's feedback, not the run's failure
            outcome.append(Result(f"error: {name} raised {type(exc).__name__}: {exc}", "error"))

    worker = threading.Thread(target=target, daemon=True, name=f"tool-{name}")
    worker.start()
    worker.join(timeout_s)
    if not outcome:
        return Result(f"error: {name} timed out after {timeout_s:g} s", "timeout")
    return outcome[0]


def tool_schema(name: str, function) -> dict:
    """The JSON schema transformers' chat templates take for `function` (from its type hints and its
    docstring's Args section); one line naming the tool when they are missing."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(function)
    except Exception as exc:  # transformers' own parsing errors: no type hint, no docstring, ...
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"grpo.environment.tools: {name}: no JSON schema from its signature ({reason})"
        ) from None


@contextlib.contextmanager
def started(run, cfg):
    """Collective: the run's environment: the tools (imported here, before the model loads), an OpenEnv
    server (yours, or ftkit's started on each process and stopped however the run ends), or None
    (single-turn GRPO)."""
    from toolkit.grpo import openenv

    if not openenv.configured(cfg.grpo):
        yield Environment.build(cfg.grpo)
        return
    from toolkit.distributed import agreed_error

    log = run.output_dir / f"openenv-{run.accelerator.process_index}.log"
    with contextlib.ExitStack() as stack:
        error = ""
        try:
            environment = stack.enter_context(openenv.served(cfg.grpo.environment.openenv, log))
        except UserError as exc:
            error = str(exc)
        error = agreed_error(run.accelerator, error)
        if error:
            raise UserError(error)
        yield environment
