"""One generation round: its prompts, G sampled completions each, their rewards and group-normalised
advantages, and the log-probs the loss compares with (the policy before the round's first update, and the
reference). Every process generates and scores its share, then holds the whole round: which completions an
optimizer step trains on, and how they split into processes, never changes what was sampled.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np
import torch

from toolkit.data.collate import Collator
from toolkit.data.encode import IGNORE
from toolkit.distributed import data_shard, tensor_parallel_size
from toolkit.grpo import multiturn, openenv, samples, sampling
from toolkit.grpo import prompts as prompt_sets
from toolkit.grpo.config import prompts_per_round, steps_per_round
from toolkit.grpo.engine import logprob_gap
from toolkit.grpo.loss import completion_logps, normaliser
from toolkit.train import truncation

STD_EPS = 1e-4


@dataclass
class Rollout:
    round_index: int
    prompt: torch.Tensor
    """Index of each completion's prompt in the PromptSet, [N]."""
    completions: torch.Tensor
    """Completion token ids, [N, max_new_tokens], padded with 0 after each one's length."""
    lengths: torch.Tensor
    """Tokens of each completion, [N]."""
    rewards: dict[str, torch.Tensor]
    """Each reward function's values and "total", [N] each."""
    advantages: torch.Tensor
    """[N]"""
    old_logps: torch.Tensor | None
    """Per-token log-probs under the policy that sampled them, [N, max_new_tokens]; None when every
    completion is trained on once, right away (the ratio is then exactly 1)."""
    ref_logps: torch.Tensor | None
    """Per-token log-probs under the reference, [N, max_new_tokens]; None without a KL term."""
    order: torch.Tensor
    """The round's completions in the order the optimizer steps take them, [N]."""
    generation_seconds: float = 0.0
    engine_logps: torch.Tensor | None = None
    """Per-token log-probs the engine gave its samples, [N, max_new_tokens]; None with HF generate."""
    engine_gap: tuple[float, float] | None = None
    """(mean, max) |engine log-prob - trainer log-prob| over the round's sampled tokens (engine rounds)."""
    sync_seconds: float = 0.0
    """Seconds the round's weight sync to the engine took."""
    sync_gathered_mb: float = 0.0
    """Megabytes the round's weight sync gathered onto the main process."""
    rest_seconds: tuple[float, float] | None = None
    """(wake_s, sleep_s): the engine's wake-up before the round's sync and its sleep after its completions
    (grpo.vllm.sleep); None when it does not sleep."""
    mask: torch.Tensor | None = None
    """Multi-turn: 1 on the tokens the model sampled, 0 on the environment's, [N, max_new_tokens]; None
    when every completion token is the model's."""
    turn_stats: dict[str, torch.Tensor] | None = None
    """Multi-turn: each conversation's turns, tool calls, tool errors and timeouts, [N] each."""
    teacher_gap: torch.Tensor | None = None
    """Distillation: the teacher's log-prob minus the policy's of every sampled token, [N, max_new_tokens]
    (grpo/teacher.py); None without grpo.teacher."""
    staleness: int = 0
    """Engine rounds: rounds trained between the weights that sampled it and those it trains from."""
    times: torch.Tensor | None = None
    """Engine rounds: unix times its generation started and ended and its training started, [3]."""
    policy_logps: torch.Tensor | None = None
    """The trainer's log-probs of the round's tokens as it starts training, when scored for the engine's
    gap but not kept as old_logps: the teacher's gap reuses them (not part of a checkpoint: the gap is)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors only (safetensors in a checkpoint): what resuming mid-round needs."""
        state = {
            "round_index": torch.tensor(self.round_index),
            "prompt": self.prompt,
            "completions": self.completions,
            "lengths": self.lengths,
            "advantages": self.advantages,
            "order": self.order,
        }
        state.update({f"rewards.{name}": values for name, values in self.rewards.items()})
        state.update({f"turns.{name}": values for name, values in (self.turn_stats or {}).items()})
        for name in ("old_logps", "ref_logps", "engine_logps", "mask", "teacher_gap", "times"):
            if getattr(self, name) is not None:
                state[name] = getattr(self, name)
        if self.engine_gap is not None:  # (gap mean, gap max, staleness): the resumed steps log them too
            state["engine_gap"] = torch.tensor([*self.engine_gap, self.staleness], dtype=torch.float64)
        return {key: value.contiguous() for key, value in state.items()}

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor]) -> Rollout:
        rewards = {key[8:]: value for key, value in state.items() if key.startswith("rewards.")}
        turns = {key[6:]: value for key, value in state.items() if key.startswith("turns.")}
        gap = state["engine_gap"].tolist() if "engine_gap" in state else None
        return cls(
            int(state["round_index"]),
            state["prompt"],
            state["completions"],
            state["lengths"],
            rewards,
            state["advantages"],
            state.get("old_logps"),
            state.get("ref_logps"),
            state["order"],
            engine_logps=state.get("engine_logps"),
            mask=state.get("mask"),
            turn_stats=turns or None,
            teacher_gap=state.get("teacher_gap"),
            engine_gap=tuple(gap[:2]) if gap else None,
            staleness=int(gap[2]) if gap else 0,
            times=state.get("times"),
        )

    def step_rows(self, step: int, cfg) -> torch.Tensor:
        """Indices of the completions optimizer `step` trains on (all processes together)."""
        part = (step - 1) % steps_per_round(cfg) % cfg.grpo.steps_per_generation
        size = cfg.train.global_batch_size
        return self.order[part * size : (part + 1) * size]

    def micro_batches(self, rows: torch.Tensor, prompts, cfg, pad_id: int, rank: int, world: int, device):
        """This process's share of `rows` (see `share_of`) as padded micro-batches of prompt + completion,
        with what the loss needs per row."""
        share = share_of(rows, cfg.train.micro_batch_size, rank, world)
        collate = Collator(pad_id)
        batches = []
        for chunk in share.split(cfg.train.micro_batch_size):
            records, starts = [], []
            for i in chunk.tolist():
                prompt_ids = prompts.ids[int(self.prompt[i])]
                completion = self.completions[i, : self.lengths[i]].tolist()
                labels = completion
                if self.mask is not None:  # the environment's tokens are context, never a target
                    labels = [t if keep else IGNORE for t, keep in zip(completion, self.mask[i].tolist())]
                records.append(
                    {"input_ids": prompt_ids + completion, "labels": [IGNORE] * len(prompt_ids) + labels}
                )
                starts.append(len(prompt_ids))
            batch = {key: value.to(device) for key, value in collate(records).items()}
            batch["starts"] = torch.tensor(starts, device=device)
            batch["lengths"] = self.lengths[chunk].to(device)
            batch["advantages"] = self.advantages[chunk].to(device)
            for name in ("old_logps", "ref_logps", "engine_logps", "mask", "teacher_gap"):
                values = getattr(self, name)
                batch[name] = values[chunk].to(device) if values is not None else None
            batches.append(batch)
        return batches


def share_of(rows: torch.Tensor, micro: int, rank: int, world: int) -> torch.Tensor:
    """Process `rank`'s rows of `rows`: each run of micro x world rows split evenly over the processes, so
    the processes' k-th micro-batches together hold what one process's k-th micro-batch of micro x world
    rows holds (a mixture of experts' pooled router balance then sees the same tokens whatever the split)."""
    return torch.cat([run.tensor_split(world)[rank] for run in rows.split(micro * world)])


def round_of(step: int, cfg) -> int:
    return (step - 1) // steps_per_round(cfg)


def generate(
    run, model, prompts, rewards, cfg, tokenizer, round_index: int, reference, engine=None, environment=None
) -> Rollout:
    """Collective: round `round_index`'s rollout, the same on every process; sampled with HF generate, or by
    `engine` (grpo/engine.py's EngineSampler) when given; conversations with `environment`'s tools when
    given (grpo/multiturn.py), their final answers rewarded."""
    started = time.perf_counter()
    accelerator, grpo = run.accelerator, cfg.grpo
    rank, world = data_shard(accelerator)
    picked, slots, seeds, ids = round_request(prompts, cfg, round_index)
    begin, end = len(slots) * rank // world, len(slots) * (rank + 1) // world
    mine = slots[begin:end]
    talks = sampled = engine_logps = None
    requests = functools.partial(engine_request, prompts, cfg)
    if environment is not None and engine is not None:  # the main process holds the round's conversations
        sampled, sync_seconds = multiturn.engine_conversations(
            engine, model, requests, cfg, tokenizer, environment, round_index
        )
        engine_logps = multiturn.logp_table(sampled.talks, grpo.max_new_tokens)
        talks = sampled.talks[begin:end]
        completions = [talk.tokens for talk in talks]
    elif environment is not None:
        talks = multiturn.conversations(
            run, model, ids[begin:end], seeds[begin:end], cfg, tokenizer, environment
        )
        completions = [talk.tokens for talk in talks]
    elif engine is None:
        completions = _generated(run, model, ids[begin:end], seeds[begin:end], cfg, tokenizer)
    else:  # the main process asks for the whole round, every process gets it all and keeps its share
        sampled, sync_seconds = engine.sample(model, round_index, requests, _end_ids(tokenizer))
        completions = [sampled.tokens[i, : sampled.lengths[i]].tolist() for i in range(begin, end)]
        engine_logps = sampled.logps
    if sampled is not None:  # the round's training starts once it is back: rewards, log-probs, its steps
        times = torch.cat([sampled.times, torch.tensor([time.time()], dtype=torch.float64)])
    texts = (
        [t.answer for t in talks] if talks else tokenizer.batch_decode(completions, skip_special_tokens=True)
    )
    scores = rewards.score(
        [prompts.texts[picked[s]] for s, _ in mine],
        texts,
        [prompts.answers[picked[s]] for s, _ in mine],
        [len(tokens) for tokens in completions],
        [prompts.ids[picked[s]] + tokens for (s, _), tokens in zip(mine, completions, strict=True)],
        multiturn.trajectories(
            [prompts.texts[picked[s]] for s, _ in mine],
            [prompts.answers[picked[s]] for s, _ in mine],
            texts,
            talks,
        ),
    )
    if talks is not None and openenv.configured(grpo):  # the environment's own rewards, beside grpo.rewards
        scores = openenv.add_reward(scores, talks, grpo.environment.openenv.reward_weight)
    names = list(scores)
    padded = torch.zeros(len(mine), grpo.max_new_tokens, dtype=torch.long)
    for i, tokens in enumerate(completions):
        padded[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    lengths = torch.tensor([len(t) for t in completions], dtype=torch.long)
    table = torch.tensor([scores[name] for name in names], dtype=torch.float64).T
    padded, lengths, table = (gather_shares(accelerator, t) for t in (padded, lengths, table))
    rewards_by_name = {name: table[:, i].contiguous() for i, name in enumerate(names)}
    group_advantages = advantages(rewards_by_name["total"], grpo.num_generations, grpo.scale_rewards)
    rollout = Rollout(
        round_index, torch.tensor([picked[s] for s, _ in slots]), padded, lengths, rewards_by_name,
        group_advantages, None, None, round_order(len(slots), cfg.seed, round_index),
    )  # fmt: skip
    if talks is not None:
        rollout.mask, rollout.turn_stats = conversation_tables(accelerator, talks, grpo.max_new_tokens)
    if steps_per_round(cfg) > 1:
        rollout.old_logps = scored(run, model, rollout, prompts, cfg, tokenizer.pad_token_id, None)
    if grpo.beta > 0:
        rollout.ref_logps = scored(run, model, rollout, prompts, cfg, tokenizer.pad_token_id, reference)
    if engine_logps is not None:
        rollout.engine_logps, rollout.sync_seconds = engine_logps, sync_seconds
        rollout.rest_seconds = engine.rest_seconds()
        rollout.sync_gathered_mb = engine.gathered_mb
        rollout.staleness = round_index - sampled.version
        # The trainer's log-probs of the sampled tokens as the round starts training: their gap to the
        # engine's (its weights one round older with grpo.async_rounds) is what the loss's TIS corrects.
        pad = tokenizer.pad_token_id
        own = rollout.old_logps
        if own is None:
            own = rollout.policy_logps = scored(run, model, rollout, prompts, cfg, pad, None)
        if truncation.truncates(grpo.top_k, grpo.top_p):
            # The engine's log-probs are of its top-k / top-p cut; plus the log of the mass the trainer's own
            # cut keeps (own - cut) they are of the whole softmax, as `own`: the gap compares samplers alone.
            cut = scored(run, model, rollout, prompts, cfg, pad, None, cut=True)
            rollout.engine_logps = engine_logps = engine_logps + (own - cut)
        rollout.engine_gap = logprob_gap(engine_logps, own, rollout.lengths, rollout.mask)
        rollout.times = times
    rollout.generation_seconds = time.perf_counter() - started
    samples.record(run, rollout, prompts, tokenizer, grpo.num_generations)  # what the studio shows
    return rollout


def engine_request(prompts, cfg, round_index: int) -> tuple[list[list[int]], list[int]]:
    """Round `round_index`'s (prompt ids, seeds) as the engine is asked for them: a group's seeds
    consecutive (sampling.group_seed), so one request can ask for the group (grpo.vllm.n_per_prompt)."""
    picked, slots, _, ids = round_request(prompts, cfg, round_index)
    seeds = [sampling.group_seed(cfg.seed, round_index, s, picked[s]) + g for s, g in slots]
    return ids, seeds


def round_request(prompts, cfg, round_index: int):
    """Round `round_index`'s (prompt indices, (prompt slot, sample) pairs, seeds, prompt ids), the slots in
    the one fixed order every layout samples them in."""
    grpo = cfg.grpo
    picked = prompt_sets.round_prompts(len(prompts), prompts_per_round(cfg), round_index, cfg.seed)
    slots = [(slot, sample) for slot in range(len(picked)) for sample in range(grpo.num_generations)]
    seeds = [sampling.completion_seed(cfg.seed, round_index, s, picked[s], g) for s, g in slots]
    return picked, slots, seeds, [prompts.ids[picked[s]] for s, _ in slots]


def _generated(run, model, ids: list[list[int]], seeds: list[int], cfg, tokenizer) -> list[list[int]]:
    """Collective: this process's completions sampled with HF generate on the training weights."""
    grpo, completions = cfg.grpo, []
    batch = grpo.generation_batch_size or len(ids)
    with sampling.generating(run.accelerator, model, grpo.gather_for_generation) as (policy, synced):
        for start in range(0, len(ids), batch):
            completions += sampling.sample(
                policy,
                ids[start : start + batch],
                seeds[start : start + batch],
                grpo,
                tokenizer.pad_token_id,
                tokenizer.eos_token_id,
                synced,
            )
    return completions


def conversation_tables(accelerator, talks, width: int):
    """Collective: the round's token masks [N, width] and per-conversation counts from every process's
    share of conversations."""
    mask = torch.zeros(len(talks), width, dtype=torch.long)
    for i, talk in enumerate(talks):
        mask[i, : len(talk.trained)] = torch.tensor(talk.trained, dtype=torch.long)
    counts = torch.tensor(
        [[talk.stats[n] for n in multiturn.STAT_NAMES] for talk in talks], dtype=torch.float64
    )
    mask, counts = gather_shares(accelerator, mask), gather_shares(accelerator, counts.view(len(talks), -1))
    return mask, {name: counts[:, i].contiguous() for i, name in enumerate(multiturn.STAT_NAMES)}


def _end_ids(tokenizer) -> list[int]:
    eos = tokenizer.eos_token_id
    return list(eos) if isinstance(eos, list) else [eos]


def advantages(totals: torch.Tensor, group: int, scale: str) -> torch.Tensor:
    """Each reward minus its group's mean, divided by the group's std (`group`), the round's (`batch`),
    or nothing (`none`)."""
    grouped = totals.view(-1, group)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).flatten()
    if scale == "group":
        return centred / (grouped.std(dim=1).repeat_interleave(group) + STD_EPS)
    if scale == "batch":
        return centred / (totals.std() + STD_EPS)
    return centred


def round_order(count: int, seed: int, round_index: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng([seed, round_index, 1]).permutation(count))


def gather_shares(accelerator, tensor: torch.Tensor) -> torch.Tensor:
    """Collective: every data-parallel group's `tensor` (equal shapes) concatenated in rank order; the
    tensor-parallel ranks of a group hold the same one, so each group's is taken once."""
    gathered = accelerator.gather(tensor.to(accelerator.device)).cpu()
    tp = tensor_parallel_size(accelerator)
    if tp == 1:
        return gathered
    return gathered.view(-1, tp, *tensor.shape)[:, 0].reshape(-1, *tensor.shape[1:])


def scored(run, model, rollout: Rollout, prompts, cfg, pad_id: int, reference, cut=False) -> torch.Tensor:
    """Collective: per-token log-probs of every completion of the round, [N, max_new_tokens], under the
    current policy (`reference` None; `cut`: over the tokens grpo.top_k / top_p keep, as an engine's log-probs
    are) or under the reference; each process scores its share."""
    accelerator = run.accelerator
    cuts = (cfg.grpo.top_k, cfg.grpo.top_p) if cut else ()
    rank, world = data_shard(accelerator)
    rows = torch.arange(len(rollout.prompt))
    width = cfg.grpo.max_new_tokens
    tables = [torch.zeros(0, width, dtype=torch.float64)]
    for batch in rollout.micro_batches(rows, prompts, cfg, pad_id, rank, world, accelerator.device):
        with torch.no_grad():
            temperature = cfg.grpo.temperature  # every log-prob is of the distribution sampled from
            logps = (
                reference.logps(batch, temperature)
                if reference is not None
                else completion_logps(model, batch, temperature, *cuts)
            )
        # A micro-batch is as wide as its longest completion; the round's table is max_new_tokens wide.
        tables.append(torch.nn.functional.pad(logps.double().cpu(), (0, width - logps.size(1))))
    gathered = gather_shares(accelerator, torch.cat(tables))  # the processes' shares in rank order
    order = torch.cat([share_of(rows, cfg.train.micro_batch_size, r, world) for r in range(world)])
    return torch.empty_like(gathered).index_copy_(0, order, gathered)


def resumed(state: dict, start_step: int, cfg, engine=None) -> Rollout | None:
    """The round a checkpoint was saved in, when its next step still belongs to it; else None. `engine`
    (grpo/engine.py's EngineSampler) takes back the round it had sent ahead, if the checkpoint kept it."""
    if engine is not None:
        engine.restore(state)
    if "round_index" not in state:
        return None
    rollout = Rollout.from_state_dict(state)
    return rollout if rollout.round_index == round_of(start_step + 1, cfg) else None


def recipe_state(rollout: Rollout | None, engine=None) -> dict[str, torch.Tensor] | None:
    """Collective: what a checkpoint keeps to resume exactly: the round in progress and, with
    grpo.async_rounds, the round the engine sampled ahead (waited for)."""
    state = rollout.state_dict() if rollout is not None else {}
    if engine is not None:
        state.update(engine.state_dict())
    return state or None


def step_counts(rollout: Rollout, rows: torch.Tensor, prompts) -> tuple[int, int]:
    """(trained completion tokens, all tokens) of the step's completions."""
    completion = int(rollout.lengths[rows].sum())
    trained = int(rollout.mask[rows].sum()) if rollout.mask is not None else completion
    prompt = sum(len(prompts.ids[int(rollout.prompt[i])]) for i in rows.tolist())
    return trained, completion + prompt


class StepStats:
    """A step's metrics from the rollout (the same on every process) and the summed loss terms."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.generation_seconds, self.started = 0.0, time.perf_counter()
        self.counted_round = None

    def metrics(self, rollout: Rollout, rows: torch.Tensor, sums: torch.Tensor, tokens: int) -> dict:
        """`sums`: the step's (objective, KL, clipped tokens, engine importance weight, tokens it truncated
        or masked) summed over every process."""
        objective, kl, clipped, is_weight, is_outside = sums.tolist()
        fresh = self.counted_round != rollout.round_index
        self.counted_round = rollout.round_index
        generated = rollout.generation_seconds if fresh else 0.0
        self.generation_seconds += generated
        groups = rollout.rewards["total"].view(-1, self.cfg.grpo.num_generations)
        values = {
            "loss": objective / max(normaliser(self.cfg.grpo, len(rows), tokens), 1),
            "reward": float(rollout.rewards["total"][rows].mean()),
            **{
                f"reward_{name}": float(v[rows].mean())
                for name, v in rollout.rewards.items()
                if name != "total"
            },
            "advantage_std": float(rollout.advantages[rows].std()),
            "zero_std_frac": float((groups.std(dim=1) == 0).double().mean()),
            "kl": kl / max(tokens, 1),
            "clip_frac": clipped / max(tokens, 1),
            "completion_len": float(rollout.lengths[rows].double().mean()),
            "generation_s": generated,
            "generation_share": self.generation_seconds / max(time.perf_counter() - self.started, 1e-9),
        }
        if rollout.teacher_gap is not None:  # the teacher's gap is 0 off the trained tokens
            values["teacher_kl"] = -float(rollout.teacher_gap[rows].sum()) / max(tokens, 1)
        if rollout.turn_stats is not None:
            counts = {name: count[rows] for name, count in rollout.turn_stats.items()}
            values.update({name: float(c.mean()) for name, c in counts.items()})
            values.update(multiturn.rewards_by_kind(rollout.rewards["total"][rows], counts))
        if rollout.engine_gap is not None:
            values["engine_logprob_gap_mean"], values["engine_logprob_gap_max"] = rollout.engine_gap
            values["sync_s"] = rollout.sync_seconds if fresh else 0.0
            values["sync_gathered_mb"] = rollout.sync_gathered_mb if fresh else 0.0
            values["staleness"] = rollout.staleness
            if self.cfg.grpo.engine_is_cap > 0:
                values["engine_is_weight_mean"] = is_weight / max(tokens, 1)
                values["engine_is_truncated_frac"] = is_outside / max(tokens, 1)
        if rollout.rest_seconds is not None:
            values["wake_s"], values["sleep_s"] = rollout.rest_seconds if fresh else (0.0, 0.0)
        if rollout.times is not None:  # unix times: the round's overlap with the one before is read from them
            names = ("generation_started_at", "generation_ended_at", "training_started_at")
            values.update(zip(names, rollout.times.tolist(), strict=True))
        return values
