"""GRPO's held-out evaluation with an OpenEnv environment (toolkit/grpo/held_out.py): greedy episodes of the
held-out rows against the countdown environment served on localhost (tests/openenv_countdown.py), each reset
with its row's seed, scored by their summed rewards, turns, failed steps and exact match; the same every
time; every session closed, a full server one line. The server, the embedded model and the helpers are
test_grpo_openenv.py's."""

from __future__ import annotations

import contextlib
import time

import pytest
import test_grpo_openenv as served
from helpers import trained_runs
from test_grpo_openenv import Run, countdown, prompts, recipe, serve

from toolkit.errors import UserError
from toolkit.grpo import held_out, multiturn, openenv, sampling
from toolkit.grpo.prompts import PromptSet

# The server, the tokenizer and the model of test_grpo_openenv.py, made again for this module.
url, tokenizer, model = served.url, served.tokenizer, served.model


def held_out_eval(url, tokenizer, references: list[str], **overrides) -> held_out.ConversationEval:
    """The held-out evaluation of len(`references`) countdown conversations on the server at `url`."""
    cfg = recipe(url, **overrides)
    environment = openenv.OpenEnv(cfg.grpo.environment.openenv, url)
    asked = prompts(tokenizer, len(references))
    texts = [tokenizer.decode(p, skip_special_tokens=True) for p in asked]
    return held_out.ConversationEval(
        Run().accelerator, tokenizer, PromptSet(asked, references, texts), environment, cfg.grpo
    )


def greedy_talks(measure, model):
    """`measure`'s conversations, as its `measure(model)` decodes them."""
    seeds = [held_out.episode_seed(row) for row in range(len(measure.held_out))]
    return multiturn.greedy_episodes(
        measure.accelerator,
        model,
        measure.tokenizer,
        measure.held_out.ids,
        seeds,
        measure.environment,
        measure.grpo,
        False,
    )


def wait_closed(before: int, count: int) -> int:
    """Sessions the server closed since it had closed `before`, once `count` are (or 10 s passed)."""
    deadline = time.monotonic() + 10
    while countdown.CLOSED["sessions"] - before < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return countdown.CLOSED["sessions"] - before


def test_the_held_out_episodes_are_greedy_reset_by_row_scored_and_the_same_every_time(url, model, tokenizer):
    measure = held_out_eval(url, tokenizer, [""] * 4)
    countdown.SEEDS.clear()
    before, closed = countdown.COUNTS.copy(), countdown.CLOSED["sessions"]
    talks = greedy_talks(measure, model)
    served = countdown.COUNTS - before
    rows = [held_out.episode_seed(row) for row in range(4)]
    assert sorted(seed for seed, _ in countdown.SEEDS) == sorted(rows) and len(set(rows)) == 4
    turns = [talk.stats["turns"] for talk in talks]
    assert served == {"reset": 4, "step": sum(turns)} and wait_closed(closed, 4) == 4
    ends = multiturn.TurnEnds.of(tokenizer)
    for seed, prompt, talk in zip(rows, measure.held_out.ids, talks, strict=True):
        # Greedy: the first turn is the model's most likely one; the episode (its seed's) runs to its end.
        (first,) = sampling.greedy(
            model, [prompt], 128, tokenizer.pad_token_id, ends.ids, False, ends.strings
        )
        assert talk.tokens[: len(first)] == first and talk.trained[: len(first)] == [1] * len(first)
        assert talk.done and talk.stats["turns"] == 2 + seed % 2
        model_turns = [
            tokenizer.decode(ids, skip_special_tokens=True) for kept, ids in trained_runs(talk) if kept
        ]
        assert talk.reward == sum(float(len(text) % 2 == 0) for text in model_turns)
    assert {2, 3} <= set(turns)
    # The scores: the summed rewards and turns per conversation; no exact match without references.
    scores = measure.measure(model)
    assert scores == {
        "eval_reward_environment": sum(t.reward for t in talks) / 4,
        "eval_turns": sum(turns) / 4,
        "eval_environment_errors": 0.0,
    }
    # The same every time: the same episodes (seeds), conversations and scores; exact match on the rows
    # with a reference answer alone.
    countdown.SEEDS.clear()
    again = greedy_talks(measure, model)
    assert sorted(seed for seed, _ in countdown.SEEDS) == sorted(rows)  # the resets sent at once
    assert [(t.tokens, t.trained, t.reward) for t in again] == [
        (t.tokens, t.trained, t.reward) for t in talks
    ]
    measure.held_out.answers = [talks[0].answer, "nothing like it", "", ""]
    assert measure.measure(model) == {**scores, "exact_match": 0.5}


def greedy_script(monkeypatch, tokenizer, turns: list[str]):
    """sampling.greedy replaced by a model that writes `turns[k]` as every row's k-th turn, then its end."""
    calls = []

    def greedy(policy, contexts, max_new_tokens, pad_id, end_ids, synced, stops=None):
        calls.append(1)
        tokens = tokenizer(turns[len(calls) - 1], add_special_tokens=False)["input_ids"] + [end_ids[0]]
        return [tokens[:max_new_tokens] for _ in contexts]

    monkeypatch.setattr(sampling, "greedy", greedy)
    monkeypatch.setattr(sampling, "generating", lambda *a: contextlib.nullcontext((None, False)))


def test_the_held_out_reward_is_each_episodes_steps_summed_and_averaged(monkeypatch, url, tokenizer):
    """Every row's turns are "ab", "abc", "abcd" (rewarded 1, 0, 1): an episode of 2 steps earns 1, one of 3
    earns 2, and each row's seed says which."""
    greedy_script(monkeypatch, tokenizer, ["ab", "abc", "abcd"])
    lengths = [2 + held_out.episode_seed(row) % 2 for row in range(6)]
    assert set(lengths) == {2, 3}
    assert held_out_eval(url, tokenizer, ["abcd"] * 6).measure(None) == {
        "eval_reward_environment": sum(length - 1 for length in lengths) / 6,
        "eval_turns": sum(lengths) / 6,
        "eval_environment_errors": 0.0,
        "exact_match": lengths.count(3) / 6,
    }


def test_held_out_failures_are_turns_counted_in_the_scores_and_the_sessions_are_closed(
    monkeypatch, url, tokenizer
):
    greedy_script(monkeypatch, tokenizer, ["boom", "sleep", "abc", "abcd"])
    measure = held_out_eval(url, tokenizer, ["abcd"], request_timeout_s=0.5)
    before, closed = countdown.COUNTS.copy(), countdown.CLOSED["sessions"]
    assert measure.measure(None) == {
        "eval_reward_environment": 0.0,
        "eval_turns": 4.0,
        "eval_environment_errors": 1.0,
        "exact_match": 1.0,
    }
    assert countdown.COUNTS - before == {"reset": 1, "step": 2} and wait_closed(closed, 1) == 1


def test_a_server_full_at_the_held_out_reset_is_one_line_and_the_opened_sessions_are_closed(
    monkeypatch, tokenizer
):
    greedy_script(monkeypatch, tokenizer, ["ab"] * 4)
    small = countdown.create_app(
        countdown.Countdown, countdown.Say, countdown.Heard, env_name="countdown", max_concurrent_envs=1
    )
    address, stop = serve(small)
    try:
        closed = countdown.CLOSED["sessions"]
        with pytest.raises(UserError, match="refused a session .* larger max_concurrent_envs") as caught:
            held_out_eval(address, tokenizer, ["", ""]).measure(None)
        assert "\n" not in str(caught.value) and wait_closed(closed, 1) == 1
    finally:
        stop()
