"""`ftkit score`: a reward model's score of answers to a prompt (`ftkit generate`'s counterpart)."""

from __future__ import annotations

from pathlib import Path

from toolkit import console
from toolkit.errors import UserError
from toolkit.model import scalar
from toolkit.model.for_generation import load_for_generation
from toolkit.reward.score import answer_ids, score_rows


def score_cli(model_dir: str, prompt: str, answers: list[str], trust_remote_code: bool = False) -> list[str]:
    """One line per answer: its score, then the answer."""
    console.quiet_third_party()  # an adapter's base loads without its head, which the adapter carries
    model, tokenizer = load_for_generation(Path(model_dir), trust_remote_code)
    if not scalar.is_scalar(model):
        raise UserError(
            f"--model: {model_dir} is not a reward model (no scalar head); ftkit generate answers"
        )
    turns = [{"role": "user", "content": prompt}]
    rows = [answer_ids(tokenizer, turns, answer, "--answer") for answer in answers]
    scores = score_rows(model, rows, tokenizer.pad_token_id)
    return [f"{value:.4f}\t{answer}" for value, answer in zip(scores, answers, strict=True)]
