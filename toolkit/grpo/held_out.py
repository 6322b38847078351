"""Held-out evaluation of a GRPO run with an environment: whole conversations, not first turns. Each held-out
row's opening (what precedes its first assistant turn, as the rollouts' prompts) is answered greedily turn by
turn, as a rollout samples it (grpo/multiturn.py: its turn ends, grpo.max_new_tokens as the conversation's
budget, up to grpo.max_turns). With tools the final model turn is scored against the row's last assistant
turn, as the exact-answer reward scores a rollout's. With OpenEnv each row's session is reset with a seed
of the row alone (`episode_seed`), the same before and after training, on every layout and in every run, and
the score is the environment's reward summed over the conversation, beside exact match where the rows have a
reference answer.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from toolkit.grpo import multiturn, prompts, sampling
from toolkit.grpo.environment import Environment


@dataclass
class ConversationEval:
    """The held-out openings and references, and what answers them: the evaluator's measure for a run
    with an environment (toolkit/train/evaluate.py calls `measure` where it would score first turns)."""

    accelerator: object
    tokenizer: object
    held_out: prompts.PromptSet
    environment: object
    """The tools (grpo/environment.py's Environment) or an OpenEnv server (grpo/openenv.py's OpenEnv)."""
    grpo: object
    """The run's grpo section: max_turns, max_new_tokens, generation_batch_size, gather_for_generation."""

    @classmethod
    def build(cls, accelerator, cfg, tokenizer, dataset, environment) -> ConversationEval | None:
        """For a run with an environment and held-out rows, the first eval.exact_match_samples of them; None
        otherwise (single-turn runs keep the first-turn exact match)."""
        samples = cfg.eval.exact_match_samples
        if environment is None or dataset is None or not samples:
            return None
        rows = [dataset[i] for i in range(min(samples, len(dataset)))]
        held_out = prompts.prompt_set(rows, tokenizer, opening=True)
        return cls(accelerator, tokenizer, held_out, environment, cfg.grpo)

    def measure(self, model) -> dict:
        """Collective: every process decodes every conversation (the same ones, greedy) and returns the same
        scores (`scores`, or `episode_scores` with OpenEnv, whose sessions the main process alone holds)."""
        tools = isinstance(self.environment, Environment)
        with (
            sampling.generating(self.accelerator, model, self.grpo.gather_for_generation) as (policy, synced),
            self.accelerator.autocast(),
        ):
            if tools:
                talks = multiturn.greedy_conversations(
                    policy, self.tokenizer, self.held_out.ids, self.environment, self.grpo, synced
                )
            else:
                seeds = [episode_seed(row) for row in range(len(self.held_out))]
                talks = multiturn.greedy_episodes(
                    self.accelerator,
                    policy,
                    self.tokenizer,
                    self.held_out.ids,
                    seeds,
                    self.environment,
                    self.grpo,
                    synced,
                )
        return (scores if tools else episode_scores)(talks, self.held_out.answers)


def episode_seed(row: int) -> int:
    """The seed held-out row `row`'s OpenEnv session is reset with: a function of the row's place alone, so
    every evaluation of a run, and of runs with other seeds, plays the same episodes."""
    key = f"held-out/{row}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def scores(talks: list[multiturn.Conversation], references: list[str]) -> dict:
    """exact_match: the share of conversations whose final model turn equals its reference;
    eval_tool_call_share: the share that called a tool; eval_turns: model turns per conversation."""
    count = max(len(talks), 1)
    return {
        "exact_match": sum(t.answer == r.strip() for t, r in zip(talks, references, strict=True)) / count,
        "eval_tool_call_share": sum(t.stats["tool_calls"] > 0 for t in talks) / count,
        "eval_turns": sum(t.stats["turns"] for t in talks) / count,
    }


def episode_scores(talks: list[multiturn.Conversation], references: list[str]) -> dict:
    """eval_reward_environment: the environment's reward summed over each conversation (0 where it gave
    none), averaged; eval_turns: model turns per conversation; eval_environment_errors: the share with a
    failed step (an error or a timeout turn); exact_match over the rows with a reference answer (none when
    no row has one)."""
    count = max(len(talks), 1)
    results = {
        "eval_reward_environment": sum(t.reward or 0.0 for t in talks) / count,
        "eval_turns": sum(t.stats["turns"] for t in talks) / count,
        "eval_environment_errors": sum(t.stats["tool_errors"] + t.stats["tool_timeouts"] > 0 for t in talks)
        / count,
    }
    referenced = [(t, r.strip()) for t, r in zip(talks, references, strict=True) if r.strip()]
    if referenced:
        results["exact_match"] = sum(t.answer == r for t, r in referenced) / len(referenced)
    return results
