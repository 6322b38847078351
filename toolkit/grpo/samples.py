"""A few of each round's rollouts, as text, in the run folder (SAMPLES_FILE): what the studio's run page
shows of a GRPO run. The first groups of the round, each completion with its rewards and advantage, a
conversation split into the model's turns and the environment's (tool answers, next headers)."""

from __future__ import annotations

import json

SAMPLES_FILE = "rollouts.jsonl"
GROUPS = 2
"""Groups of the round kept (each grpo.num_generations completions of one prompt)."""


def record(run, rollout, prompts, tokenizer, group_size: int) -> None:
    """Main process: the round's first GROUPS groups appended as one JSON line (a resumed run may append a
    round again: the last line of a round is its)."""
    if not run.accelerator.is_main_process:
        return
    kept = min(len(rollout.prompt), GROUPS * group_size)
    samples = [_sample(rollout, i, tokenizer) for i in range(kept)]
    line = {
        "round": rollout.round_index,
        "prompts": [prompts.texts[int(rollout.prompt[i])] for i in range(0, kept, group_size)],
        "answers": [prompts.answers[int(rollout.prompt[i])] for i in range(0, kept, group_size)],
        "group_size": group_size,
        "samples": samples,
    }
    with open(run.output_dir / SAMPLES_FILE, "a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")


def _sample(rollout, i: int, tokenizer) -> dict:
    length = int(rollout.lengths[i])
    tokens = rollout.completions[i, :length].tolist()
    mask = rollout.mask[i, :length].tolist() if rollout.mask is not None else [1] * length
    return {
        "turns": [
            {
                "by": "model" if by else "environment",
                "text": tokenizer.decode(part, skip_special_tokens=False),
            }
            for by, part in _runs(tokens, mask)
        ],
        "rewards": {name: round(float(values[i]), 4) for name, values in rollout.rewards.items()},
        "advantage": round(float(rollout.advantages[i]), 4),
        "tokens": length,
    }


def _runs(tokens: list[int], mask: list[int]) -> list[tuple[int, list[int]]]:
    """(1 for the model's, 0 for the environment's, tokens) of each run of equal mask values, in order."""
    runs: list[tuple[int, list[int]]] = []
    for token, by in zip(tokens, mask, strict=True):
        if runs and runs[-1][0] == by:
            runs[-1][1].append(token)
        else:
            runs.append((by, [token]))
    return runs


def read(output_dir, last: int = 5) -> list[dict]:
    """The last `last` rounds recorded, newest first, one line per round (the last written for it); lines
    that do not parse are skipped (a file being written)."""
    path = output_dir / SAMPLES_FILE
    if not path.is_file():
        return []
    rounds: dict[int, dict] = {}
    for text in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            line = json.loads(text)
            rounds[int(line["round"])] = line
        except (ValueError, KeyError, TypeError):
            continue
    return [rounds[k] for k in sorted(rounds, reverse=True)[:last]]
