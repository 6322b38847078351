"""Greedy answers from a pipeline, for the evaluations that generate (exact match, the sample answer):
`PipelineGenerator` stands in for the model in `toolkit.train.generation`, one forward pass through every
stage per new token (no key-value cache: each pass sees the whole sequence so far)."""

from __future__ import annotations

import torch


class PipelineGenerator:
    """The part of a causal LM's `generate` that greedy evaluation uses, run through `pipeline`."""

    def __init__(self, pipeline):
        self.pipeline = pipeline

    def parameters(self):
        return iter([torch.empty(0, device=self.pipeline.accelerator.device)])

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens: int, eos_token_id=None, **_greedy_settings) -> torch.Tensor:
        """Collective: every rank of the pipeline calls it with the same prompts."""
        rows = [row.tolist() for row in input_ids]
        done = [False] * len(rows)
        room = self.pipeline.width - max(map(len, rows))
        for _ in range(min(max_new_tokens, room)):
            for i, token in enumerate(self.pipeline.next_tokens(rows)):
                rows[i].append(token if not done[i] else self.pipeline.pad_id)
                done[i] = done[i] or token == eos_token_id
            if all(done):
                break
        width = max(map(len, rows))
        return torch.tensor([row + [self.pipeline.pad_id] * (width - len(row)) for row in rows])
