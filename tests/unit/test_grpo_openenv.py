"""Multi-turn GRPO over an OpenEnv environment served on localhost (tests/openenv_countdown.py): the embedded
model's conversations with it, each reset with its seed and stopping by itself, a bounded number of
requests, the environment's text masked, its rewards summed; failures as turns; the server ftkit starts.
The held-out evaluation's episodes: tests/unit/test_grpo_openenv_held_out.py."""

from __future__ import annotations

import contextlib
import re
import threading
import time

import pytest
import torch
from helpers import REPO, trained_runs
from transformers import AutoModelForCausalLM, AutoTokenizer

countdown = pytest.importorskip(
    "openenv_countdown", reason="openenv-core is not installed (pip install 'ftkit[openenv]')"
)
import uvicorn  # noqa: E402  (installed with openenv-core)
from accelerate import Accelerator  # noqa: E402

from toolkit.data.chat import ensure_chat_template  # noqa: E402
from toolkit.engine import client  # noqa: E402
from toolkit.engine.server import free_port  # noqa: E402
from toolkit.errors import UserError  # noqa: E402
from toolkit.grpo import multiturn, openenv, sampling  # noqa: E402
from toolkit.grpo.config import GrpoConfig, GrpoRecipeConfig, OpenEnvConfig, load_grpo_config  # noqa: E402
from toolkit.grpo.engine import EngineSampler  # noqa: E402
from toolkit.grpo.template_turns import TOOL_CALL_CLOSE  # noqa: E402

TINY = REPO / "toolkit" / "assets" / "tiny-llama"
MAX_TURNS = 4


@pytest.fixture(scope="module")
def url():
    """The countdown environment on a free port of 127.0.0.1, in a thread of this process."""
    address, stop = serve(countdown.app)
    yield address
    stop()


def serve(app):
    """`app` on a free port of 127.0.0.1, in a thread of this process: (its url, a stop())."""
    port = free_port("127.0.0.1")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)

    def stop():
        server.should_exit = True
        thread.join(10)

    return f"http://127.0.0.1:{port}", stop


@pytest.fixture(scope="module")
def tokenizer():
    tok = AutoTokenizer.from_pretrained(TINY)
    ensure_chat_template(tok)
    return tok


@pytest.fixture(scope="module")
def model(tokenizer):
    """The embedded model, its end token made likely (the bare model rarely ends a turn by itself). One
    thread: token by token, a model this small waits on its threads more than it computes."""
    tiny = AutoModelForCausalLM.from_pretrained(TINY)
    bias = tiny.lm_head.weight.new_zeros(tiny.config.vocab_size)
    bias[tokenizer.eos_token_id] = 10.0
    tiny.lm_head.register_forward_hook(lambda module, args, out: out + bias)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny
    torch.set_num_threads(threads)


class Run:
    def __init__(self):
        self.accelerator = Accelerator(cpu=True)


def recipe(url: str, **overrides) -> GrpoRecipeConfig:
    grpo = GrpoConfig(max_new_tokens=128, max_turns=MAX_TURNS, temperature=1.0)
    grpo.environment.openenv = OpenEnvConfig(url=url, observation_field="text", **overrides)
    return GrpoRecipeConfig(grpo=grpo)


def prompts(tokenizer, count: int) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Count down from {n}."}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
        for n in range(count)
    ]


def talk_with(url, model, tokenizer, seeds, engine=None, **overrides):
    """The conversations for `seeds` with HF generate, or on the EngineSampler `engine(cfg)` when given."""
    cfg = recipe(url, **overrides)
    environment = openenv.OpenEnv(cfg.grpo.environment.openenv, url)
    environment.check()
    before = countdown.COUNTS.copy()
    asked = prompts(tokenizer, len(seeds))
    if engine is None:
        talks = multiturn.conversations(Run(), model, asked, seeds, cfg, tokenizer, environment)
    else:
        requests = lambda round_index: (asked, seeds)  # noqa: E731
        sampled, _ = multiturn.engine_conversations(
            engine(cfg), model, requests, cfg, tokenizer, environment, 0
        )
        talks = sampled.talks
    served = countdown.COUNTS - before
    return talks, served, environment.requests


def fake_engine(monkeypatch, model, tokenizer):
    """engine(cfg): an EngineSampler whose engine is `model` answering client.post as vLLM would (each
    request's seed, budget, end ids and stop strings; made-up log-probs, -1 - token/100); and the requests
    it got."""
    payloads = []

    def post(url, path, payload):
        payloads.append(payload)
        decode = lambda tokens: tokenizer.decode(tokens, skip_special_tokens=False)  # noqa: E731
        (tokens,) = sampling.sample(
            model,
            [payload["prompt"]],
            [payload["seed"]],
            GrpoConfig(max_new_tokens=payload["max_tokens"], temperature=payload["temperature"]),
            tokenizer.pad_token_id,
            payload["stop_token_ids"],
            False,
            sampling.StopStrings(payload.get("stop", []), decode),
        )
        logps = [-1.0 - 0.01 * t for t in tokens]
        return {"choices": [{"token_ids": tokens, "logprobs": {"token_logprobs": logps}}]}

    monkeypatch.setattr(client, "post", post)
    held = type("Engine", (), {"url": "http://engine", "check_alive": lambda self: None})()

    def engine(cfg):
        sampler = EngineSampler(Run().accelerator, cfg, held)
        monkeypatch.setattr(sampler, "sync", lambda model, round_index: 0.0)
        return sampler

    return engine, payloads


def test_the_embedded_model_plays_an_episode_per_conversation_and_each_stops_by_itself(url, model, tokenizer):
    seeds = [10, 11, 12, 13]
    countdown.SEEDS.clear()
    talks, served, requests = talk_with(url, model, tokenizer, seeds)
    # Each conversation was reset once, with its own seed and its prompt's text.
    assert sorted(seed for seed, _ in countdown.SEEDS) == seeds  # sent at once: in any order
    assert all("Count down from" in prompt for _, prompt in countdown.SEEDS)
    # Bounded: one reset per conversation, one step per model turn, nothing else.
    turns = [talk.stats["turns"] for talk in talks]
    assert served == {"reset": len(seeds), "step": sum(turns)} and requests == len(seeds) + sum(turns)
    assert all(1 <= t <= MAX_TURNS for t in turns)
    by_episode = 0
    for seed, talk in zip(seeds, talks, strict=True):
        episode = 2 + seed % 2  # the countdown's length for this seed
        assert talk.done and talk.stats["turns"] <= episode, "a finished episode gets no further turn"
        runs = trained_runs(talk)
        model_turns = [tokenizer.decode(ids, skip_special_tokens=True) for trained, ids in runs if trained]
        said = [tokenizer.decode(ids) for trained, ids in runs if not trained]
        assert len(model_turns) == talk.stats["turns"] and runs[0][0] == 1
        # Only the model's tokens train: every masked run is the environment's answer to the turn before it,
        # in the chat template's user turn, and every model turn but the last ends with its end token.
        for k, text in enumerate(said):
            assert text == (
                f"\n<|im_start|>user\nyou wrote {len(model_turns[k])} characters; {episode - k - 1} left"
                "<|im_end|>\n<|im_start|>assistant\n"
            )
        for trained, ids in runs[:-1]:
            assert not trained or ids[-1] == tokenizer.eos_token_id
        # The environment's reward: one point per turn of even length, summed over the conversation.
        assert talk.reward == sum(float(len(text) % 2 == 0) for text in model_turns)
        assert talk.stats["tool_errors"] == talk.stats["tool_timeouts"] == 0
        by_episode += talk.stats["turns"] == episode
    assert by_episode >= 2, "some conversations must end because their episode ended"
    assert any(t > 1 for t in turns), "the environment's answers must lead to further model turns"
    # The same seeds give the same conversations (the environment's episodes included).
    again, _, _ = talk_with(url, model, tokenizer, seeds)
    assert [(t.tokens, t.trained, t.reward) for t in again] == [
        (t.tokens, t.trained, t.reward) for t in talks
    ]


def test_on_the_engine_the_main_process_drives_the_sessions_as_hf_generate_does(
    monkeypatch, url, model, tokenizer
):
    """The same seeds on the engine path: the same resets, steps, conversations, masks and rewards as HF
    generate's, each turn asked with its own seed, the engine's log-probs kept on the model's tokens only."""
    seeds = [10, 11, 12, 13]
    expected, hf_served, _ = talk_with(url, model, tokenizer, seeds)
    countdown.SEEDS.clear()
    engine, payloads = fake_engine(monkeypatch, model, tokenizer)
    talks, served, requests = talk_with(url, model, tokenizer, seeds, engine)
    assert sorted(seed for seed, _ in countdown.SEEDS) == seeds  # sent at once: in any order
    assert all("Count down from" in prompt for _, prompt in countdown.SEEDS)
    assert served == hf_served and requests == served["reset"] + served["step"]
    assert [(t.tokens, t.trained, t.reward, t.stats, t.messages, t.done) for t in talks] == [
        (t.tokens, t.trained, t.reward, t.stats, t.messages, t.done) for t in expected
    ]
    assert any(t.stats["turns"] > 1 for t in talks) and any(not all(t.trained) for t in talks)
    assert len(payloads) == sum(t.stats["turns"] for t in talks), "one engine request per model turn"
    turn_seeds = {multiturn.turn_seed(s, k) for s in seeds for k in range(MAX_TURNS)}
    assert {p["seed"] for p in payloads} <= turn_seeds and {p["seed"] for p in payloads} > set(seeds)
    table = multiturn.logp_table(talks, 128)
    for i, talk in enumerate(talks):
        wanted = [-1.0 - 0.01 * t if kept else 0.0 for t, kept in zip(talk.tokens, talk.trained, strict=True)]
        assert table[i, : len(wanted)].tolist() == pytest.approx(wanted) and not table[i, len(wanted) :].any()


def scripted(monkeypatch, tokenizer, turns: list[str]):
    """sampling.sample replaced by a model that writes `turns[k]` as its k-th turn, then its end token
    unless the turn ends at a tool call's close."""
    calls = []

    def sample(policy, contexts, seeds, cfg, pad_id, end_ids, synced, stops=None):
        calls.append(1)
        text = turns[len(calls) - 1]
        end = [] if text.endswith(TOOL_CALL_CLOSE) else [end_ids[0]]
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"] + end
        return [tokens[: cfg.max_new_tokens] for _ in contexts]

    monkeypatch.setattr(sampling, "sample", sample)
    monkeypatch.setattr(sampling, "generating", lambda *a: contextlib.nullcontext((None, False)))


@pytest.mark.parametrize("on_engine", [False, True], ids=["hf", "engine"])
def test_an_error_a_timeout_and_a_lost_session_are_turns_the_model_reads(
    monkeypatch, url, tokenizer, on_engine
):
    scripted(monkeypatch, tokenizer, ["boom", "sleep", "abc", "abcd"])
    engine = fake_engine(monkeypatch, None, tokenizer)[0] if on_engine else None
    (talk,), served, requests = talk_with(url, None, tokenizer, [11], engine, request_timeout_s=0.5)
    said = [
        tokenizer.decode(ids, skip_special_tokens=True) for trained, ids in trained_runs(talk) if not trained
    ]
    assert len(said) == 3 and "error: the environment refused: the countdown exploded" in said[0]
    assert "error: the environment did not answer within 0.5 s" in said[1]
    assert "error: the environment did not answer within 0.5 s" in said[2], "a lost session sends nothing"
    assert talk.stats == {"turns": 4, "tool_calls": 4, "tool_errors": 3, "tool_timeouts": 1}
    assert served == {"reset": 1, "step": 2} and requests == 3 and talk.reward is None


@pytest.mark.parametrize("on_engine", [False, True], ids=["hf", "engine"])
def test_a_turn_ended_at_a_tool_calls_close_gets_the_templates_end_of_turn_masked(
    monkeypatch, url, tokenizer, on_engine
):
    scripted(monkeypatch, tokenizer, ['<tool_call>{"name": "x"}</tool_call>', "ab"])
    engine = fake_engine(monkeypatch, None, tokenizer)[0] if on_engine else None
    (talk,), served, _ = talk_with(url, None, tokenizer, [10], engine)
    runs = trained_runs(talk)
    assert [trained for trained, _ in runs] == [1, 0, 1] and served == {"reset": 1, "step": 2}
    assert tokenizer.decode(runs[0][1]).endswith(TOOL_CALL_CLOSE)
    assert tokenizer.decode(runs[1][1]) == (
        "<|im_end|>\n<|im_start|>user\nyou wrote 36 characters; 1 left<|im_end|>\n<|im_start|>assistant\n"
    )


def test_answers_that_are_not_observations_are_error_turns_and_a_full_server_is_one_line():
    ok = openenv.read_reply('{"type": "observation", "data": {"observation": {"a": 1}, "reward": 2}}')
    assert (ok.kind, ok.observation, ok.reward, ok.done) == ("ok", {"a": 1}, 2.0, False)
    for raw, said in [
        ("not json", "not an observation: not json"),
        ('{"type": "observation", "data": {"observation": "a"}}', "not an observation"),
        ('{"type": "observation", "data": {"observation": {}, "done": "yes"}}', "not an observation"),
        ('{"type": "observation", "data": {"observation": {}, "reward": NaN}}', "not a finite number: nan"),
        ('{"type": "error", "data": {"message": "no", "code": "EXECUTION_ERROR"}}', "refused: no"),
    ]:
        reply = openenv.read_reply(raw)
        assert reply.kind == "error" and said in reply.text and reply.text.startswith("error: ")
    full = '{"type": "error", "data": {"message": "Server at capacity (1/1)", "code": "CAPACITY_REACHED"}}'
    with pytest.raises(UserError, match="refused a session .* larger max_concurrent_envs") as caught:
        openenv.read_reply(full)
    assert "\n" not in str(caught.value)


def test_the_environments_reward_joins_the_total_with_its_weight():
    talks = [multiturn.Conversation(reward=2.0), multiturn.Conversation()]
    scores = openenv.add_reward({"exact_answer": [1.0, 0.0], "total": [1.0, 0.0]}, talks, 0.5)
    assert scores == {"exact_answer": [1.0, 0.0], "environment": [2.0, 0.0], "total": [2.0, 0.0]}


def test_a_server_that_does_not_answer_or_lacks_the_fields_is_one_line(url):
    closed = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    cases = [
        (OpenEnvConfig(url=closed), closed, "grpo.environment.openenv: no OpenEnv server answers at"),
        (
            OpenEnvConfig(url=url, action_field="msg"),
            url,
            r"openenv.action_field: the environment's action has no field 'msg' \(it has metadata, message\)",
        ),
        (OpenEnvConfig(url=url, observation_field="txt"), url, "observation has no field 'txt'"),
    ]
    for settings, where, message in cases:
        with pytest.raises(UserError, match=message) as caught:
            openenv.OpenEnv(settings, where).check()
        assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["grpo.environment.openenv.url=http://127.0.0.1:1", "grpo.environment.tools=[m:f]"],
            "name tools or an OpenEnv environment",
        ),
        (
            ["grpo.environment.openenv.url=http://127.0.0.1:1", "grpo.environment.openenv.app=m:app"],
            "name url .* or app",
        ),
        (["grpo.environment.openenv.url=127.0.0.1:8000"], "is not http://host:port"),
        (["grpo.environment.openenv.app=server.py"], "is not module:app or file.py:app"),
    ],
)
def test_bad_openenv_settings_are_one_line(overrides, message):
    with pytest.raises(UserError, match=message) as caught:
        load_grpo_config(None, ["model.adapter=null", *overrides])
    assert "\n" not in str(caught.value)


def test_openenv_on_the_vllm_engine_is_a_valid_config():
    settings = ["model.adapter=null", "grpo.environment.openenv.app=m:app", "grpo.generation=vllm"]
    cfg = load_grpo_config(None, settings)
    assert cfg.grpo.generation == "vllm" and cfg.grpo.environment.openenv.app == "m:app"
    assert load_grpo_config(None, [*settings, "grpo.async_rounds=1"]).grpo.async_rounds == 1


def test_ftkit_serves_the_app_for_the_run_and_stops_it(monkeypatch, tmp_path):
    monkeypatch.chdir(REPO / "tests")  # where the app's module is, as a user launches beside theirs
    settings = OpenEnvConfig(app="openenv_countdown:app", start_timeout_s=60)
    with openenv.served(settings, tmp_path / "openenv.log") as environment:
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", environment.url)
        session = openenv.Session(environment.url, 10)
        assert session.reset(3, "").observation == {"text": "3 turns", "left": 3}
        session.close()
    assert openenv._unhealthy(environment.url, 2), "the server is stopped with the run"
    with (
        pytest.raises(UserError, match=r"openenv.app: the server exited \(code \d+\): .*nowhere") as caught,
        openenv.served(OpenEnvConfig(app="nowhere:app"), tmp_path / "bad.log"),
    ):
        pass
    assert "\n" not in str(caught.value)


class NappingSession:
    """A session on a made-up server that answers later the lower its episode's seed (so a turn's steps
    sent at once end in reverse); its episode lasts 1 + seed % 3 steps. Every request is noted: how many
    were in flight at once, over all sessions and per session."""

    lock = threading.Lock()
    busy = {"all": 0, "peak": 0, "peak per session": 0}
    ended: list[tuple[int, int]] = []

    def __init__(self, url, timeout_s):
        self.lost, self.requests, self.in_flight, self.seed, self.steps = "", 0, 0, None, 0

    def reset(self, seed: int, prompt: str) -> openenv.Reply:
        self.seed = seed
        self._wait()
        return openenv.Reply("", {"text": "go"})

    def step(self, action: dict) -> openenv.Reply:
        self._wait()
        self.steps += 1
        self.ended.append((self.seed, self.steps))
        text = f"seed {self.seed} step {self.steps} read {len(action['message'])} characters"
        done = self.steps == 1 + self.seed % 3
        return openenv.Reply("", {"text": text}, reward=self.seed / 4 + self.steps, done=done)

    def _wait(self) -> None:
        self.requests += 1
        with self.lock:
            self.in_flight += 1
            self.busy["all"] += 1
            self.busy["peak"] = max(self.busy["peak"], self.busy["all"])
            self.busy["peak per session"] = max(self.busy["peak per session"], self.in_flight)
        time.sleep(0.06 * (8 - self.seed))
        with self.lock:
            self.in_flight -= 1
            self.busy["all"] -= 1

    def close(self) -> None:
        pass


def test_a_turns_steps_go_at_once_and_give_the_conversations_of_one_at_a_time(monkeypatch, tokenizer):
    """With grpo.environment.concurrency the resets, and each turn's steps, are sent at once across the
    sessions (they end out of order), a session never more than one request at a time, and the
    conversations are those of one request at a time: tokens, masks, observations, rewards, counts."""
    monkeypatch.setattr(openenv, "Session", NappingSession)
    seeds = list(range(8))
    runs = {}
    for concurrency in (1, 8):
        scripted(monkeypatch, tokenizer, ["one", "three", "five!", "seven"])
        cfg = recipe("http://127.0.0.1:1")
        cfg.grpo.environment.concurrency = concurrency
        environment = openenv.OpenEnv(cfg.grpo.environment.openenv, "http://127.0.0.1:1")
        NappingSession.ended.clear()
        NappingSession.busy.update({"peak": 0, "peak per session": 0})
        talks = multiturn.conversations(
            Run(), None, prompts(tokenizer, 8), seeds, cfg, tokenizer, environment
        )
        runs[concurrency] = talks, list(NappingSession.ended), dict(NappingSession.busy), environment.requests
    (one, in_turn, alone, sent), (at_once, as_they_ended, together, sent_at_once) = runs[1], runs[8]
    assert at_once == one and sent_at_once == sent == 8 + sum(t.stats["turns"] for t in one)
    assert sorted(as_they_ended) == sorted(in_turn) and as_they_ended != in_turn
    assert alone["peak"] == 1 and together["peak"] > 1 and together["peak per session"] == 1
    for seed, talk in zip(seeds, at_once, strict=True):  # each its own episode: its seed's steps, rewards
        assert talk.stats["turns"] == 1 + seed % 3 and talk.done
        assert talk.reward == sum(seed / 4 + step for step in range(1, talk.stats["turns"] + 1))
        observed = [m["content"] for m in talk.messages if m["role"] == "user"]
        steps = [text.split(" read ")[0] for text in observed]
        assert steps == [f"seed {seed} step {k}" for k in range(1, talk.stats["turns"])]
