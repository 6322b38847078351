"""OpenEnv environments for multi-turn GRPO: a server speaking OpenEnv's session protocol (a WebSocket at
/ws: reset, then steps, each answered with an observation, a reward and whether the episode is done), one
session per conversation. A conversation opens with the data's prompt; its session is reset with the
completion's seed (and the prompt's text, for an environment whose reset takes `prompt`); each model turn is
one step, the turn's text the action; the observation is the next user turn, masked like any environment
text; the steps' rewards add up to the conversation's reward. The sessions are held by the process that
samples the conversations: each process its share with HF generate, the main process the whole round with
the vLLM engine (grpo/multiturn.py answers both through `OpenEnv.episodes`); the held-out conversations,
which every process decodes, by the main process alone, which hands its conversations to the others after
each turn (`OpenEnv.held_out_episodes`).

Requests are bounded: one reset and at most grpo.max_turns steps per conversation, each with a timeout. A
server that cannot be reached at start is one line; one that fails mid-run (an error it reports, a timeout,
an answer that is not an observation, a lost connection) becomes an error turn the model reads, and a lost
session answers the rest of its conversation's turns without another request.

The server is yours (grpo.environment.openenv.url) or ftkit's (openenv.app: an ASGI app served with uvicorn
on 127.0.0.1, one per process, stopped with the run). The client needs only `websockets`; the extra
`ftkit[openenv]` installs it with openenv-core, which the environments themselves are written with.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.machinery
import json
import math
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from toolkit.distributed import from_main
from toolkit.errors import UserError
from toolkit.grpo.pool import each, pooled
from toolkit.grpo.template_turns import appended

KEY = "grpo.environment.openenv"


@dataclass
class Reply:
    text: str = ""
    """The error the model reads ("" for an observation)."""
    observation: dict | None = None
    reward: float | None = None
    done: bool = False
    kind: str = "ok"
    """ok | error (the server reported one, or its answer was not an observation) | timeout."""


class Session:
    """One conversation's session on the server's /ws; every request waits at most `timeout_s`."""

    def __init__(self, url: str, timeout_s: float):
        self.url, self.timeout_s = url, timeout_s
        self.socket, self.lost, self.requests = None, "", 0
        self.held = contextlib.ExitStack()  # the connection, closed by close()

    def reset(self, seed: int, prompt: str) -> Reply:
        from websockets.sync.client import connect

        try:
            self.socket = self.held.enter_context(
                connect(ws_url(self.url), open_timeout=self.timeout_s, max_size=None)
            )
        except Exception as exc:  # refused, timed out, a failed handshake: websockets' errors share no base
            self.lost = f"error: the environment at {self.url} is not reachable ({exc})"
            return Reply(self.lost, kind="error")
        reply = self._request({"type": "reset", "data": {"seed": seed, "prompt": prompt}})
        if reply.kind != "ok":  # no episode to step: the conversation's turns read this error
            self._lose(reply.text, reply.kind)
        return reply

    def step(self, action: dict) -> Reply | None:
        """The observation after `action`; None without a request when the session was lost before."""
        if self.lost:
            return None
        return self._request({"type": "step", "data": action})

    def _request(self, message: dict) -> Reply:
        self.requests += 1
        try:
            self.socket.send(json.dumps(message))
            raw = self.socket.recv(timeout=self.timeout_s)
        except TimeoutError:
            return self._lose(f"error: the environment did not answer within {self.timeout_s:g} s", "timeout")
        except Exception as exc:  # a closed connection, a broken pipe: the session is gone
            raw = self._last_word()
            if raw is None:
                return self._lose(f"error: the environment's session ended ({type(exc).__name__}: {exc})")
        return read_reply(raw)

    def _last_word(self):
        """What a server that closed the connection sent before it (a refusal for want of sessions comes
        so, and may close before the request is even sent), or None."""
        try:
            return self.socket.recv(timeout=0)
        except Exception:
            return None

    def _lose(self, text: str, kind: str = "error") -> Reply:
        self.lost = text
        self.close()
        return Reply(text, kind=kind)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.held.close()
        self.socket = None


def read_reply(raw) -> Reply:
    """A reply from the server's answer: an observation, or an error the model reads; a refusal for want of
    sessions is the user's to fix (the server's max_concurrent_envs), so it is one line."""
    try:
        answer = json.loads(raw)
        kind, data = answer["type"], answer["data"]
    except (ValueError, TypeError, KeyError):
        kind, data = None, None
    if kind == "error" and isinstance(data, dict):
        if data.get("code") == "CAPACITY_REACHED":
            raise UserError(
                f"{KEY}: the server refused a session ({data.get('message')}); each conversation a process "
                "samples at once holds one: serve the environment with a larger max_concurrent_envs"
            )
        return Reply(f"error: the environment refused: {data.get('message', data)}", kind="error")
    observed = kind == "observation" and isinstance(data, dict) and isinstance(data.get("observation"), dict)
    reward, done = (data.get("reward"), data.get("done", False)) if observed else (None, False)
    if not observed or not isinstance(done, bool):
        return Reply(f"error: the environment's answer is not an observation: {str(raw)[:200]}", kind="error")
    if reward is not None and not (isinstance(reward, (int, float)) and math.isfinite(reward)):
        return Reply(f"error: the environment's reward is not a finite number: {reward!r}", kind="error")
    return Reply("", data["observation"], None if reward is None else float(reward), done)


def ws_url(url: str) -> str:
    scheme, _, rest = url.rstrip("/").partition("://")
    return f"{ {'http': 'ws', 'https': 'wss'}.get(scheme, scheme) }://{rest}/ws"


def http_url(url: str) -> str:
    scheme, _, rest = url.rstrip("/").partition("://")
    return f"{ {'ws': 'http', 'wss': 'https'}.get(scheme, scheme) }://{rest}"


class OpenEnv:
    """The environment's server and how a conversation talks to it; `episodes` opens the sessions of one
    batch of conversations."""

    def __init__(self, settings, url: str):
        self.settings, self.url = settings, http_url(url)
        self.requests = 0
        """Requests sent so far (resets and steps)."""

    def check(self) -> None:
        """One line at start when the server does not answer, or its schema lacks the configured fields."""
        problem = _unhealthy(self.url, self.settings.request_timeout_s)
        if problem:
            raise UserError(f"{KEY}: no OpenEnv server answers at {self.url} ({problem})")
        schema = _schema(self.url, self.settings.request_timeout_s)
        wanted = {"action": self.settings.action_field, "observation": self.settings.observation_field}
        for part, name in wanted.items():
            fields = schema.get(part, {}).get("properties") if isinstance(schema.get(part), dict) else None
            if name and isinstance(fields, dict) and name not in fields:
                raise UserError(
                    f"{KEY}.{part}_field: the environment's {part} has no field {name!r} "
                    f"(it has {', '.join(fields) or 'none'})"
                )

    @contextlib.contextmanager
    def episodes(self, prompts, seeds, grpo, tokenizer, ends):
        """answer(turn, said) for these conversations (`said`: (index, talk, tokens, logps) each), each
        session reset with its seed; the resets, and a turn's steps, are sent at once across the sessions
        (at most grpo.environment.concurrency, a session only ever one request at a time), and the sessions
        are closed however the conversations end."""
        sessions = [Session(self.url, self.settings.request_timeout_s) for _ in prompts]
        try:
            with pooled(grpo.environment.concurrency) as pool:
                texts = [tokenizer.decode(prompt, skip_special_tokens=True) for prompt in prompts]
                resets = zip(sessions, seeds, texts, strict=True)
                each(pool, [functools.partial(session.reset, seed, text) for session, seed, text in resets])
                yield functools.partial(self._answer_turn, sessions, grpo, tokenizer, ends, pool)
        finally:
            for session in sessions:
                session.close()
            self.requests += sum(session.requests for session in sessions)

    @contextlib.contextmanager
    def held_out_episodes(self, accelerator, prompts, seeds, grpo, tokenizer, ends):
        """(answer, share) for the held-out conversations, which every process decodes alike: the main
        process alone holds their sessions and answers their turns, and share(talks), called by every
        process after each turn, returns the main process's conversations, so each request is sent once and
        every process continues from the same observations. An error that stops the main process (a full
        server) is one line on every process, at the next share."""
        error = ""
        with contextlib.ExitStack() as stack:
            answered = None
            if accelerator.is_main_process:
                try:
                    answered = stack.enter_context(self.episodes(prompts, seeds, grpo, tokenizer, ends))
                except UserError as exc:
                    error = str(exc)

            def answer(turn, said):
                nonlocal error
                if answered is None or error:
                    return
                try:
                    answered(turn, said)
                except UserError as exc:
                    error = str(exc)

            def share(talks):
                return from_main(accelerator, talks, UserError(error) if error else None)

            yield answer, share

    def _answer_turn(self, sessions, grpo, tokenizer, ends, pool, turn, said) -> None:
        """Each model turn of `said` ((index, talk, tokens, logps)) added to its conversation (with the
        engine's log-probs of its tokens when it sampled them) and sent as its session's step, the steps at
        once on `pool`; each observation (or error) then added to its conversation in order."""
        texts = [tokenizer.decode(tokens, skip_special_tokens=True) for _, _, tokens, _ in said]
        for (_, talk, tokens, logps), text in zip(said, texts, strict=True):
            talk.model_turn(tokens, text, logps)
        steps = [functools.partial(self._step, sessions[i], text) for (i, *_), text in zip(said, texts)]
        for (_, talk, tokens, _), reply in zip(said, each(pool, steps), strict=True):
            self._observed(talk, tokens, reply, turn, grpo, tokenizer, ends)

    def _step(self, session: Session, text: str) -> Reply:
        """The session stepped with the model's turn `text` (its error when it was lost before)."""
        return session.step({self.settings.action_field: text}) or Reply(session.lost, kind="error")

    def _observed(self, talk, tokens, reply: Reply, turn, grpo, tokenizer, ends) -> None:
        """The step's `reply` to the model's turn (`tokens`) added as the next user turn (masked) unless the
        conversation ends: done, no end token (the budget ran out), or no turn left."""
        talk.stats["tool_calls"] += 1
        talk.stats["tool_errors"] += reply.kind == "error"
        talk.stats["tool_timeouts"] += reply.kind == "timeout"
        if reply.reward is not None:
            talk.reward = (talk.reward or 0.0) + reply.reward
        closed = ends.closed(tokens)
        if reply.done or closed is None or turn + 1 == grpo.max_turns:
            talk.done = True
            return
        turn_text = reply.text or self.observation_text(reply.observation)
        talk.messages.append(user(turn_text))
        # A turn ended at a tool call's close: the template's end of turn, which the model never wrote, first.
        assistant = {"role": "assistant", "content": talk.answer}
        said = appended(tokenizer, assistant, [user(turn_text)], at_close=closed == "string")
        talk.environment_turn(said, grpo.max_new_tokens)

    def observation_text(self, observation: dict) -> str:
        name = self.settings.observation_field
        if not name:
            return json.dumps(observation)
        if name not in observation:
            return f"error: the observation has no field {name!r} (it has {', '.join(observation)})"
        value = observation[name]
        return value if isinstance(value, str) else json.dumps(value)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def _unhealthy(url: str, timeout_s: float) -> str:
    """Why the server's /health does not answer ("" when it does)."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s):
            return ""
    except (OSError, urllib.error.URLError) as exc:
        return str(getattr(exc, "reason", exc))


def _schema(url: str, timeout_s: float) -> dict:
    """The server's /schema ({} when it serves none: the fields are then checked by its answers)."""
    try:
        with urllib.request.urlopen(f"{url}/schema", timeout=timeout_s) as answer:
            schema = json.loads(answer.read())
    except (OSError, urllib.error.URLError, ValueError):
        return {}
    return schema if isinstance(schema, dict) else {}


def configured(grpo) -> bool:
    return bool(grpo.environment.openenv.url or grpo.environment.openenv.app)


def add_reward(scores: dict, talks, weight: float) -> dict:
    """`scores` with the environment's reward per conversation (0 where it gave none) as "environment",
    added to "total" with `weight`."""
    values = [talk.reward or 0.0 for talk in talks]
    total = [t + weight * v for t, v in zip(scores["total"], values, strict=True)]
    return {**{k: v for k, v in scores.items() if k != "total"}, "environment": values, "total": total}


def check_before_run(settings) -> None:
    """What can be checked before the run writes anything: the openenv extra installed, the server at
    `settings.url` answering with the configured fields, or the app ftkit would serve found."""
    try:
        import websockets.sync.client  # noqa: F401
    except ImportError:
        raise UserError(f"{KEY}: needs the openenv extra: pip install 'ftkit[openenv]'") from None
    if settings.url:
        OpenEnv(settings, settings.url).check()
        return
    where = settings.app.rpartition(":")[0]
    if where.endswith(".py"):
        if not Path(where).expanduser().is_file():
            raise UserError(f"{KEY}.app: {where} does not exist")
    elif importlib.machinery.PathFinder.find_spec(where.split(".")[0], [os.getcwd(), *sys.path]) is None:
        raise UserError(f"{KEY}.app: no module {where.split('.')[0]} where the run is launched from")


@contextlib.contextmanager
def served(settings, log: Path):
    """The environment for the run (`check_before_run` passed): the server at `settings.url`, or
    `settings.app` served on 127.0.0.1 for the run (its output in `log`) and stopped at the end, however the
    run ends."""
    if settings.url:
        yield OpenEnv(settings, settings.url)
        return
    from toolkit.engine.server import Engine, _end_with_parent, free_port

    port = free_port("127.0.0.1")
    where, _, name = settings.app.rpartition(":")
    app = [settings.app]
    if where.endswith(".py"):  # a file: its folder is where uvicorn imports it from
        path = Path(where).expanduser()
        app = [f"{path.stem}:{name}", "--app-dir", str(path.resolve().parent)]
    command = [sys.executable, "-m", "uvicorn", *app, "--host", "127.0.0.1", "--port", str(port)]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_end_with_parent
        )
    server = Engine(f"http://127.0.0.1:{port}", process, log)
    try:
        environment = OpenEnv(settings, server.url)
        _wait_ready(environment, process, log, settings.start_timeout_s)
        yield environment
    finally:
        server.stop(grace_s=10.0)


def _wait_ready(environment: OpenEnv, process, log: Path, timeout_s: float) -> None:
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        if process.poll() is not None:
            lines = log.read_text(errors="replace").strip().splitlines()
            said = lines[-1] if lines else "no output"
            raise UserError(f"{KEY}.app: the server exited (code {process.returncode}): {said}; log: {log}")
        if not _unhealthy(environment.url, 2.0):
            environment.check()
            return
        time.sleep(0.3)
    raise UserError(f"{KEY}.app: the server did not answer within {timeout_s:g} s; log: {log}")
