"""Held-out evaluation of a GRPO run with tools: whole conversations, not first turns. Each held-out row's
opening (what precedes its first assistant turn, as the rollouts' prompts) is answered greedily turn by turn
with the run's tools, as a rollout samples it (grpo/multiturn.py: its turn ends, grpo.max_new_tokens as the
conversation's budget, up to grpo.max_turns); the final model turn is scored against the row's last
assistant turn, as the exact-answer reward scores a rollout's.
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.grpo import multiturn, prompts, sampling
from toolkit.grpo.environment import Environment


@dataclass
class ConversationEval:
    """The held-out openings and references, and what answers them: the evaluator's measure for a run
    with tools (toolkit/train/evaluate.py calls `measure` where it would score first turns)."""

    accelerator: object
    tokenizer: object
    held_out: prompts.PromptSet
    environment: Environment
    grpo: object
    """The run's grpo section: max_turns, max_new_tokens, generation_batch_size, gather_for_generation."""

    @classmethod
    def build(cls, accelerator, cfg, tokenizer, dataset, environment) -> ConversationEval | None:
        """For a run with tools and held-out rows, the first eval.exact_match_samples of them; None
        otherwise (single-turn runs and OpenEnv environments keep the first-turn exact match)."""
        samples = cfg.eval.exact_match_samples
        if not isinstance(environment, Environment) or dataset is None or not samples:
            return None
        rows = [dataset[i] for i in range(min(samples, len(dataset)))]
        held_out = prompts.prompt_set(rows, tokenizer, opening=True)
        return cls(accelerator, tokenizer, held_out, environment, cfg.grpo)

    def measure(self, model) -> dict:
        """Collective: every process runs every conversation (the same ones, greedy) and returns the same
        scores (`scores`)."""
        with (
            sampling.generating(self.accelerator, model, self.grpo.gather_for_generation) as (policy, synced),
            self.accelerator.autocast(),
        ):
            talks = multiturn.greedy_conversations(
                policy, self.tokenizer, self.held_out.ids, self.environment, self.grpo, synced
            )
        return scores(talks, self.held_out.answers)


def scores(talks: list[multiturn.Conversation], references: list[str]) -> dict:
    """exact_match: the share of conversations whose final model turn equals its reference;
    eval_tool_call_share: the share that called a tool; eval_turns: model turns per conversation."""
    count = max(len(talks), 1)
    return {
        "exact_match": sum(t.answer == r.strip() for t, r in zip(talks, references, strict=True)) / count,
        "eval_tool_call_share": sum(t.stats["tool_calls"] > 0 for t in talks) / count,
        "eval_turns": sum(t.stats["turns"] for t in talks) / count,
    }
