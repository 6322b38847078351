"""Multi-turn rollouts: each completion is a conversation with a tool environment. The model's turn ends at
its end-of-turn token, at the close of a tool call (`</tool_call>` where the chat template writes one, Llama
3's <|eom_id|>), or when the conversation's token budget runs out; the tool calls it wrote are run and their
answers appended in the chat template's own form, then the model speaks again, up to grpo.max_turns.

A conversation is one token sequence after the prompt, with a mask: 1 on the tokens the model sampled, 0 on
what the environment wrote (tool turns, the next turn's header), which the loss never trains. Every turn of a
conversation is sampled with its own seed, derived from the completion's seed and the turn's number, so a
conversation is the same whichever process and batch it is sampled in. With a vLLM engine the main process
holds the round's conversations, asks the engine for each turn with the same seeds and answers them itself
(the tools run, or the OpenEnv sessions stepped, once), keeping the engine's log-probability of every token
the model sampled (none for the environment's); with grpo.async_rounds the whole round, engine turns and
environment alike, is sent ahead on the sampler's thread while the round before trains.

A turn's environment requests (each conversation's tool calls, or its OpenEnv step) run at once across the
conversations, at most grpo.environment.concurrency at a time. Only the requests leave the calling thread
(the tokenizer and the conversations stay on it) and each touches its own conversation's calls or session
alone, so the conversations come out as one request at a time gives them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import hashlib
import time
from dataclasses import dataclass

import torch

from toolkit.grpo import sampling
from toolkit.grpo.environment import Environment, parse_calls
from toolkit.grpo.pool import each, pooled
from toolkit.grpo.sampled import STAT_NAMES, Conversation, SampledConversations
from toolkit.grpo.template_turns import LLAMA3_END_OF_MESSAGE, TOOL_CALL_CLOSE, appended


@dataclass
class TurnEnds:
    """What ends a model turn: end tokens, and strings (a tool call's close) that end it without one."""

    ids: list[int]
    strings: sampling.StopStrings

    @classmethod
    def of(cls, tokenizer) -> TurnEnds:
        eos = tokenizer.eos_token_id
        ids = list(eos) if isinstance(eos, list) else [eos]
        eom = tokenizer.convert_tokens_to_ids(LLAMA3_END_OF_MESSAGE)
        if isinstance(eom, int) and eom != tokenizer.unk_token_id and eom not in ids:
            ids.append(eom)
        closes = [TOOL_CALL_CLOSE] if TOOL_CALL_CLOSE in str(tokenizer.chat_template or "") else []
        decode = lambda tokens: tokenizer.decode(tokens, skip_special_tokens=False)  # noqa: E731
        return cls(ids, sampling.StopStrings(closes, decode))

    def closed(self, tokens: list[int]) -> str | None:
        """How a sampled turn ended: "token", "string" (a tool call's close), or None (out of budget)."""
        if tokens and tokens[-1] in self.ids:
            return "token"
        return "string" if self.strings and tokens and self.strings.found(tokens) else None


def turn_seed(seed: int, turn: int) -> int:
    """Turn `turn`'s seed of the completion seeded `seed` (turn 0 keeps it)."""
    if turn == 0:
        return seed
    key = f"{seed}/turn/{turn}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def conversations(
    run, model, prompts: list[list[int]], seeds: list[int], cfg, tokenizer, environment: Environment
) -> list[Conversation]:
    """Collective: this process's conversations, one per prompt, sampled with HF generate."""
    grpo = cfg.grpo
    ends = TurnEnds.of(tokenizer)
    with (
        sampling.generating(run.accelerator, model, grpo.gather_for_generation) as (policy, synced),
        _episodes(environment, prompts, seeds, grpo, tokenizer, ends) as answer,
    ):
        return _turns(policy, prompts, seeds, grpo, tokenizer, synced, ends, answer)


def greedy_conversations(
    model, tokenizer, prompts: list[list[int]], environment: Environment | None, grpo, synced: bool
) -> list[Conversation]:
    """Collective when `synced`: each prompt's conversation with the tools decoded greedily (the held-out
    evaluation), turn by turn as `conversations` samples them: the same turn ends, budget
    (grpo.max_new_tokens), turns (grpo.max_turns) and batches (grpo.generation_batch_size). `environment`
    may be None when grpo.max_turns is 1 (one turn, no tool ever runs)."""
    ends = TurnEnds.of(tokenizer)
    with _tool_answers(environment, grpo, tokenizer, ends) as answer:
        return _turns(model, prompts, None, grpo, tokenizer, synced, ends, answer)


def greedy_episodes(
    accelerator, model, tokenizer, prompts: list[list[int]], seeds: list[int], environment, grpo, synced: bool
) -> list[Conversation]:
    """Collective: each prompt's conversation with an OpenEnv environment decoded greedily, as
    `greedy_conversations` decodes tool conversations, each session reset with its seed; the main process
    steps the sessions and every process continues from its conversations (`OpenEnv.held_out_episodes`)."""
    ends = TurnEnds.of(tokenizer)
    with environment.held_out_episodes(accelerator, prompts, seeds, grpo, tokenizer, ends) as (answer, share):
        return _turns(model, prompts, None, grpo, tokenizer, synced, ends, answer, share)


def _turns(policy, prompts, seeds, grpo, tokenizer, synced, ends, answer, share=None) -> list[Conversation]:
    """The conversations, turn by turn: each open one's next model turn, then `answer` ends or continues it,
    and `share` (when given) returns the conversations every process continues from. Sharded models
    generate in lockstep, so every process takes every turn."""
    talks = [Conversation() for _ in prompts]
    for turn in range(grpo.max_turns):
        active = [i for i, talk in enumerate(talks) if not talk.done]
        if not active and not synced:
            break
        sampled = _sample_turn(policy, prompts, seeds, talks, active, turn, grpo, tokenizer, synced, ends)
        answer(turn, [(i, talks[i], tokens, None) for i, tokens in zip(active, sampled, strict=True)])
        if share is not None:
            talks = share(talks)
    return talks


def _episodes(environment, prompts, seeds, grpo, tokenizer, ends):
    """A context giving answer(turn, said), which answers a turn's conversations (`said`: (index, talk,
    tokens, logps) each, logps None without an engine): the tools, or an OpenEnv environment's sessions
    opened for these conversations and closed after them."""
    if isinstance(environment, Environment):
        return _tool_answers(environment, grpo, tokenizer, ends)
    return environment.episodes(prompts, seeds, grpo, tokenizer, ends)


@contextlib.contextmanager
def _tool_answers(environment, grpo, tokenizer, ends):
    """answer(turn, said) with the tools (`environment`; None when no tool can run: one turn), a turn's
    calls run at once across its conversations on threads held while the context is."""
    with pooled(grpo.environment.concurrency) as pool:
        yield functools.partial(
            _answer_turn, grpo=grpo, tokenizer=tokenizer, environment=environment, ends=ends, pool=pool
        )


def engine_conversations(engine, model, requests, cfg, tokenizer, environment, round_index: int):
    """Collective: round `round_index`'s conversations, one per prompt of `requests(r)` (round r's prompt
    ids and seeds), sampled turn by turn on the vLLM engine (`engine`: grpo/engine.py's EngineSampler)
    from the weights synced before it, the same on every process (a SampledConversations); and the seconds
    the sync took. With grpo.async_rounds the round was sent ahead while the one before trained."""
    if cfg.grpo.async_rounds:  # sent ahead, the round decodes on the sampler's thread while this one trains
        # and evaluates: a fast tokenizer switches its truncation in place, so the thread gets its own.
        tokenizer = copy.deepcopy(tokenizer)
    ask = functools.partial(_engine_round, cfg.grpo, tokenizer, environment)
    return engine.sample(model, round_index, requests, [], ask)  # each turn asks with its own ends


def _engine_round(grpo, tokenizer, environment, sampler, round_index, prompts, seeds, version):
    """Main process (its own thread, or the sampler's sending the round ahead): the round's conversations
    from the weights served now, trained `version` rounds."""
    started = time.time()
    sampler.engines.check_alive()
    talks = _engine_turns(sampler, prompts, seeds, grpo, tokenizer, environment)
    return SampledConversations(
        round_index, talks, version, torch.tensor([started, time.time()], dtype=torch.float64)
    )


def _engine_turns(sampler, prompts, seeds, grpo, tokenizer, environment) -> list[Conversation]:
    """Main process: every conversation's turns from the engine, each turn's requests sent at once, and the
    environment's answers (the tools run, or the OpenEnv sessions stepped) here between turns."""
    talks = [Conversation() for _ in prompts]
    ends = TurnEnds.of(tokenizer)
    with _episodes(environment, prompts, seeds, grpo, tokenizer, ends) as answer:
        for turn in range(grpo.max_turns):
            active = [i for i, talk in enumerate(talks) if not talk.done]
            if not active:
                break
            done = sampler.complete(
                [prompts[i] + talks[i].tokens for i in active],
                [turn_seed(seeds[i], turn) for i in active],
                [grpo.max_new_tokens - len(talks[i].tokens) for i in active],
                ends.ids,
                ends.strings.strings,
            )
            answer(turn, [(i, talks[i], c.tokens, c.logps) for i, c in zip(active, done, strict=True)])
    return talks


def logp_table(talks: list[Conversation], width: int) -> torch.Tensor:
    """The conversations' per-token engine log-probs, [N, width] float64, 0 past each one's length."""
    table = torch.zeros(len(talks), width, dtype=torch.float64)
    for i, talk in enumerate(talks):
        table[i, : len(talk.logps)] = torch.tensor(talk.logps, dtype=torch.float64)
    return table


def trajectories(prompts: list[str], answers: list[str], texts: list[str], talks) -> list[dict]:
    """What a trajectory reward reads, one dict per completion: "prompt" (its text), "messages" (the
    model's turns and the tools' answers as chat messages), "answer" (the data's reference answer), and
    the counts turns, tool_calls, tool_errors, tool_timeouts. Single-turn (`talks` None): one message."""
    if talks is None:
        talks = [
            Conversation(answer=t, messages=[{"role": "assistant", "content": t.strip()}], stats=_one_turn())
            for t in texts
        ]
    return [
        {"prompt": prompt, "messages": talk.messages, "answer": answer, **talk.stats}
        for prompt, answer, talk in zip(prompts, answers, talks, strict=True)
    ]


def rewards_by_kind(totals: torch.Tensor, stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """The mean total reward (`totals`, [N]) of the conversations that called a tool, of those that called
    none, and of those with a call that failed (an error or a timeout), from their counts (`stats`: [N]
    each); a kind no conversation is of has no key, as a mean of nothing is no number."""
    called = stats["tool_calls"] > 0
    kinds = {
        "reward_with_tool_calls": called,
        "reward_without_tool_calls": ~called,
        "reward_with_tool_failures": (stats["tool_errors"] + stats["tool_timeouts"]) > 0,
    }
    return {name: float(totals[rows].mean()) for name, rows in kinds.items() if rows.any()}


def _one_turn() -> dict:
    return {**dict.fromkeys(STAT_NAMES, 0), "turns": 1}


def _sample_turn(
    policy, prompts, seeds, talks, active, turn, grpo, tokenizer, synced, ends
) -> list[list[int]]:
    """The active conversations' next model turns, each within its remaining budget, sampled with their
    turn's seeds (greedy when `seeds` is None). Sharded models generate in lockstep: a process with none
    left samples a stand-in row and drops it."""
    rows = active or [0]
    contexts = [prompts[i] + talks[i].tokens for i in rows]
    budgets = [grpo.max_new_tokens - len(talks[i].tokens) for i in rows]
    turn_seeds = [turn_seed(seeds[i], turn) for i in rows] if seeds is not None else None
    # Lockstep needs as many generate calls on every process, whatever its count of active rows: one.
    step = len(rows) if synced else (grpo.generation_batch_size or len(rows))
    sampled = []
    for start in range(0, len(rows), step):
        part = slice(start, start + step)
        limit = dataclasses.replace(grpo, max_new_tokens=max(1, max(budgets[part])))
        pad = tokenizer.pad_token_id
        if turn_seeds is None:
            sampled += sampling.greedy(
                policy, contexts[part], limit.max_new_tokens, pad, ends.ids, synced, ends.strings
            )
        else:
            sampled += sampling.sample(
                policy, contexts[part], turn_seeds[part], limit, pad, ends.ids, synced, ends.strings
            )
    return [tokens[: max(budget, 0)] for tokens, budget in zip(sampled, budgets)] if active else []


def _answer_turn(turn, said, grpo, tokenizer, environment, ends, pool) -> None:
    """Each model turn of `said` ((index, talk, tokens, logps)) added to its conversation; the tool calls
    of the conversations that go on run (a conversation's in order, the conversations at once on `pool`)
    and their answers added (masked). A conversation ends here with no call, no end (the budget ran out),
    or no turn left."""
    going = []
    for _, talk, tokens, logps in said:
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        talk.model_turn(tokens, text, logps)
        calls, closed = parse_calls(text), ends.closed(tokens)
        if calls and closed is not None and turn + 1 < grpo.max_turns:
            going.append((talk, text, calls, closed))
        else:
            talk.stats["tool_calls"] += len(calls) if closed is not None else 0
            talk.done = True
    answered = each(pool, [functools.partial(environment.run_each, calls) for _, _, calls, _ in going])
    for (talk, text, calls, closed), results in zip(going, answered, strict=True):
        _tool_turns(talk, text, calls, results, closed, grpo, tokenizer, environment)


def _tool_turns(talk: Conversation, text, calls, results, closed, grpo, tokenizer, environment) -> None:
    """The tools' `results` of the turn `text` added to `talk`: counted, as messages, and as the tokens the
    chat template writes (masked)."""
    talk.stats["tool_calls"] += len(calls)
    talk.stats["tool_errors"] += sum(r.kind == "error" for r in results)
    talk.stats["tool_timeouts"] += sum(r.kind == "timeout" for r in results)
    talk.messages += [
        {"role": "tool", "name": call.name or "tool", "content": result.content}
        for call, result in zip(calls, results, strict=True)
    ]
    said = environment_turns(tokenizer, text, calls, results, environment.schemas, closed == "string")
    talk.environment_turn(said, grpo.max_new_tokens)


def environment_turns(tokenizer, text: str, calls, results, schemas, at_close: bool = False) -> list[int]:
    """Token ids of what the chat template writes after the model's turn: the tool turns holding `results`
    and the header of the model's next turn; `at_close`: the turn ended at its tool call's close, so what
    the template writes after that close (its end of turn) comes first."""
    readable = [c for c in calls if not c.problem]
    # The text before the calls (a Llama 3 style turn is the call alone).
    before = text.split("<tool_call>")[0].strip() if "<tool_call>" in text else ""
    assistant = {"role": "assistant", "content": before if readable else text.strip()}
    if readable:
        assistant["tool_calls"] = [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in readable
        ]
    tools = [
        {"role": "tool", "name": call.name or "tool", "content": result.content}
        for call, result in zip(calls, results, strict=True)
    ]
    return appended(tokenizer, assistant, tools, schemas, at_close)
