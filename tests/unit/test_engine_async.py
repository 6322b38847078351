"""grpo.async_rounds without an engine: its config refusals, and the sampler's bookkeeping against a fake
engine whose completions take a while: round k+1 sent ahead with the weights synced before round k, the
sync waiting for the round in flight, the staleness, and the round in flight kept by a checkpoint."""

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import REPO
from safetensors.torch import load, save

from toolkit.engine import client
from toolkit.errors import UserError
from toolkit.grpo import engine as engine_module
from toolkit.grpo.config import load_grpo_config
from toolkit.grpo.engine import EngineLost, EngineSampler
from toolkit.grpo.rollout import Rollout
from toolkit.grpo.sampled import Conversation, Sampled, SampledConversations

ENGINE = ["model.adapter=null", "grpo.generation=vllm"]


def test_async_rounds_need_the_engine_and_take_multi_turn_rollouts():
    with pytest.raises(
        UserError, match=r"grpo.async_rounds: 1 needs grpo.generation=vllm \(HF generate runs"
    ):
        load_grpo_config(None, ["grpo.async_rounds=1"])
    with pytest.raises(UserError, match="grpo.async_rounds"):
        load_grpo_config(None, [*ENGINE, "grpo.async_rounds=2"])
    tools = f"grpo.environment.tools=[{REPO / 'toolkit' / 'assets' / 'demo' / 'calculator.py'}:calculator]"
    assert load_grpo_config(None, [*ENGINE, "grpo.async_rounds=1", tools]).grpo.async_rounds == 1
    assert load_grpo_config(None, [*ENGINE, "grpo.async_rounds=1"]).grpo.async_rounds == 1
    assert load_grpo_config(None, ENGINE).grpo.async_rounds == 0


class FakeEngine:
    """What the sampler asks of an engine: its completions come back after a while; every call noted."""

    url = "http://fake"
    process = None
    relaunch = ("how it was started",)

    def __init__(self):
        self.calls, self.lock = [], threading.Lock()

    def lost(self, error):
        return "exited (code -9): no reason found in its log; its log: vllm.log"

    def restarted(self):
        self.note("restarted", "")
        return self

    def wait_ready(self, timeout_s, say=None):
        return 1.0

    def note(self, *event):
        with self.lock:
            self.calls.append((*event, time.monotonic()))

    def check_alive(self):
        pass

    def stop(self):
        pass


@pytest.fixture
def sampler(monkeypatch):
    fake = FakeEngine()

    def complete(url, name, prompts, seeds, sampling, stop_ids, max_tokens=None, stop=None, n=1):
        fake.note("sent", name)
        time.sleep(0.2)
        fake.note("back", name)
        # n completions per request, the i-th seeded seed + i (as vLLM's).
        return [client.Completion([(s + i) % 7 + 3, 2], [-1.0, -0.5]) for s in seeds for i in range(n)]

    def load(policy, state, round_index):
        fake.note("sync", f"round-{round_index}")
        built.adapter = (f"round-{round_index}", Path(f"adapter-round-{round_index}"))

    monkeypatch.setattr(client, "complete", complete)
    monkeypatch.setattr(engine_module, "adapter_state", lambda accelerator, model: ({}, 0))
    monkeypatch.setattr(engine_module, "saver", lambda accelerator, model: None)
    accelerator = SimpleNamespace(
        num_processes=1, is_main_process=True, device="cpu", reduce=lambda t, **_: t
    )
    # Three rounds of one step: the last sends none ahead.
    cfg = load_grpo_config(
        None,
        [
            *ENGINE,
            "grpo.async_rounds=1",
            "grpo.max_new_tokens=4",
            "train.max_steps=3",
            "grpo.num_generations=4",
        ],
    )
    built = EngineSampler(accelerator, cfg, fake)
    built.ready, built._load = True, load
    monkeypatch.setattr(client, "load_adapter", lambda url, name, path: fake.note("loaded back", name))
    yield built, fake
    built.close()


def requests(round_index):
    return [[1, 2, 3]] * 4, [100 * round_index + i for i in range(4)]


def test_each_round_is_sampled_ahead_with_the_weights_of_the_round_before(sampler):
    built, fake = sampler
    first, _ = built.sample(None, 0, requests, [2])
    assert (first.round_index, first.version) == (0, 0)  # the first round waited for, fresh
    assert [c[:2] for c in fake.calls[:3]] == [("sync", "round-0"), ("sent", "round-0"), ("back", "round-0")]
    assert built.ahead == (1, 4)  # round 1 in flight while round 0 trains
    second, _ = built.sample(None, 1, requests, [2])
    assert (second.round_index, second.version) == (1, 0)  # sampled with round 0's weights: 1 round stale
    assert second.lengths.tolist() == [2] * 4 and second.tokens[:, 0].tolist() == [
        3 + s % 7 for s in range(100, 104)
    ]
    third, _ = built.sample(None, 2, requests, [2])
    assert (third.round_index, third.version) == (2, 1)
    built.state_dict()  # waits for the round sent ahead
    # Each sync comes after the round in flight has come back, and the next round goes out with it.
    assert [c[:2] for c in fake.calls] == [
        ("sync", "round-0"),
        ("sent", "round-0"),
        ("back", "round-0"),
        ("sent", "round-0"),  # round 1, ahead
        ("back", "round-0"),
        ("sync", "round-1"),
        ("sent", "round-1"),  # round 2, ahead
        ("back", "round-1"),
        ("sync", "round-2"),  # the last round: nothing is sent ahead
    ]
    assert built.ahead is None
    assert third.times[0] < third.times[1]


def test_a_checkpoint_keeps_the_round_in_flight_and_a_resumed_run_trains_on_it(sampler, monkeypatch):
    built, fake = sampler
    built.sample(None, 0, requests, [2])
    state = built.state_dict()  # waits for round 1
    assert built.ahead is None and int(state["ahead.about"][0]) == 1
    resumed = EngineSampler(built.accelerator, built.cfg, fake)
    resumed.ready, resumed._load = True, built._load
    resumed.restore({**state, "round_index": torch.tensor(0)})
    sent = sum(c[0] == "sent" for c in fake.calls)
    again, _ = resumed.sample(None, 1, requests, [2])
    assert (again.round_index, again.version) == (1, 0)
    assert torch.equal(again.tokens, Sampled.from_state_dict(state).tokens)
    assert sum(c[0] == "sent" for c in fake.calls) == sent + 1  # only round 2, sent ahead
    resumed.close()


def conversations_of(fake):
    """An ask (multi-turn's in place of single-turn completions) whose conversations take a while: every
    field a trained round and its rewards read, with log-probs whose last bits matter."""

    def ask(sampler, round_index, prompts, seeds, version):
        fake.note("sent", f"conversations of round {round_index}")
        time.sleep(0.2)
        talks = [
            Conversation(
                [seed % 7 + 3, 9, 2],
                [1, 0, 1],
                [-1 / (seed + 3), 0.0, -(2**-40) * seed],
                f"answer {seed}",
                [{"role": "assistant", "content": f"<tool_call>{seed}"}, {"role": "tool", "content": "é"}],
                True,
                None if seed % 2 else seed / 3,
                {"turns": 2, "tool_calls": 1, "tool_errors": seed % 2, "tool_timeouts": 0},
            )
            for seed in seeds
        ]
        return SampledConversations(
            round_index, talks, version, torch.tensor([1.5, 2.5], dtype=torch.float64)
        )

    return ask


def test_a_multi_turn_round_is_sent_ahead_whole_and_a_checkpoint_keeps_its_conversations_exactly(sampler):
    built, fake = sampler
    ask = conversations_of(fake)
    first, _ = built.sample(None, 0, requests, [], ask)
    assert isinstance(first, SampledConversations) and (first.round_index, first.version) == (0, 0)
    assert built.ahead == (1, None)  # round 1's conversations in flight while round 0 trains
    second, _ = built.sample(None, 1, requests, [], ask)
    assert (second.round_index, second.version) == (1, 0)  # one round stale
    assert [t.answer for t in second.talks] == [f"answer {s}" for s in requests(1)[1]]
    state = load(save(built.state_dict()))  # waits for round 2, kept as a checkpoint keeps it
    assert built.ahead is None and state["ahead.about"].tolist() == [2, 1]
    resumed = EngineSampler(built.accelerator, built.cfg, fake)
    resumed.ready, resumed._load = True, built._load
    resumed.restore({**state, "round_index": torch.tensor(1)})
    sent = sum(c[0] == "sent" for c in fake.calls)
    again, _ = resumed.sample(None, 2, requests, [], ask)
    assert sum(c[0] == "sent" for c in fake.calls) == sent, "the kept round, not sampled again (the last)"
    expected = conversations_of(fake)(None, 2, *requests(2), 1)
    assert again.talks == expected.talks  # every float to the last bit, the missing reward still None
    assert (again.round_index, again.version) == (2, 1) and torch.equal(again.times, expected.times)
    resumed.close()


def dies_once(monkeypatch, seed: int):
    """client.complete fails once, as a killed engine's would, for the round whose first seed is `seed`."""
    answer, died = client.complete, []

    def dying(url, name, prompts, seeds, *args):
        if seeds[0] == seed and not died:
            died.append(name)
            raise client.Unreachable("grpo.vllm: the engine at http://fake is not reachable (reset)")
        return answer(url, name, prompts, seeds, *args)

    monkeypatch.setattr(client, "complete", dying)


def test_an_engine_lost_with_a_round_ahead_is_restarted_and_sent_that_round_again(
    sampler, monkeypatch, capsys
):
    """Round 1, sent ahead with round 0's adapter, meets a killed engine: it is started again, round 0's
    adapter loaded back, round 1 sent again with it (the same completions, one round stale as before)."""
    built, fake = sampler
    dies_once(monkeypatch, 100)
    built.sample(None, 0, requests, [2])
    second, _ = built.sample(None, 1, requests, [2])
    assert (second.round_index, second.version) == (1, 0)
    assert second.tokens[:, 0].tolist() == [3 + s % 7 for s in range(100, 104)]
    assert [c[:2] for c in fake.calls[:8]] == [
        ("sync", "round-0"),
        ("sent", "round-0"),
        ("back", "round-0"),
        ("restarted", ""),
        ("loaded back", "round-0"),
        ("sent", "round-0"),  # round 1 again, with the weights it was first sent with
        ("back", "round-0"),
        ("sync", "round-1"),
    ]
    said = capsys.readouterr().out.strip().splitlines()
    assert said == [
        "grpo.vllm: the engine exited (code -9): no reason found in its log; its log: vllm.log; ftkit "
        "restarted it (1 of grpo.vllm.restarts 2) in 1.0 s with the weights it served, and the round goes on"
    ]


def test_past_its_restarts_a_lost_engine_ends_the_rounds_and_a_checkpoint_keeps_none_ahead(
    sampler, monkeypatch
):
    built, fake = sampler
    built.restarts = 0
    dies_once(monkeypatch, 100)
    built.sample(None, 0, requests, [2])
    with pytest.raises(EngineLost, match=r"^grpo.vllm: the engine exited \(code -9\): no reason .*vllm.log$"):
        built.sample(None, 1, requests, [2])
    assert built.state_dict() == {}  # the round that was ahead is sampled again by the relaunch
    assert not any(c[0] == "restarted" for c in fake.calls)


def test_a_rollout_keeps_its_staleness_and_times_through_a_checkpoint():
    two = torch.zeros(2, dtype=torch.long)
    rollout = Rollout(3, two, two[:, None], two + 1, {"total": two.double()}, two.double(), None, None, two)
    rollout.engine_gap, rollout.staleness, rollout.times = (0.1, 0.2), 1, torch.tensor([1.0, 2.0, 3.0])
    back = Rollout.from_state_dict(rollout.state_dict())
    assert back.staleness == 1 and back.engine_gap == pytest.approx((0.1, 0.2))
    assert back.times.tolist() == [1.0, 2.0, 3.0]
