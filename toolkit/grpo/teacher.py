"""On-policy distillation (grpo.teacher): the policy samples, a frozen teacher scores every sampled token,
and the gap between their log-probs becomes each token's advantage.

The policy's reverse KL to the teacher on its own samples, KL(pi || T) = E_{y ~ pi} sum_t [log pi(y_t) -
log T(y_t)] (each term given the tokens before it), is lowered by the policy gradient with the per-token
advantage log T(y_t) - log pi_old(y_t): the teacher's log-prob of the sampled token minus the policy's
before the round's first update, neither differentiated. It is added, times grpo.teacher_weight, to the
rewards' group-normalised advantage of the completion, and the clipped ratio loss takes it as it takes
that one, so a token the teacher finds likelier than the policy does is pushed up, one it finds less
likely pushed down, and a policy that is the teacher gets no signal at all. Each token is credited with
its own gap only, not the sum of the gaps after it: the estimate of the full sequence KL's gradient that
this drops (a token's effect on the later tokens' gaps) is what makes the summed form noisy, and the
per-token form is the one on-policy distillation is usually run with. A teacher alone (no rewards) is
plain distillation on the policy's own samples; with rewards the teacher shapes every token while the
reward still says which whole answers were right.

Over a multi-turn conversation (grpo.environment) the teacher reads what the policy read: the prompt and
every turn, the environment's tool results and user turns included, in one forward pass per micro-batch
(the same micro-batches the old log-probs and the reference are scored on). Only the model's own tokens
are targets there, so the environment's tokens get no teacher term and stay out of teacher_kl.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from toolkit.checkpoint.export import ADAPTER_CONFIG, START_ADAPTER
from toolkit.config import ModelConfig
from toolkit.errors import UserError
from toolkit.grpo.loss import completion_logps
from toolkit.grpo.rollout import scored
from toolkit.model.load import load_tokenizer
from toolkit.preference.reference import frozen, load_separate

KEY = "grpo.teacher"


def teacher_parts(path: str) -> tuple[str, str | None]:
    """(the model to load, the adapter folded into it or None) for grpo.teacher `path`: a model folder or
    hub id as it is; an exported adapter on the base its adapter_config names."""
    folder = Path(path).expanduser()
    if not folder.is_dir() or (folder / "config.json").is_file():
        return path, None
    if not (folder / ADAPTER_CONFIG).is_file():
        raise UserError(
            f"{KEY}: {path} holds neither a model (config.json) nor an adapter ({ADAPTER_CONFIG})"
        )
    if (folder / START_ADAPTER).is_dir():
        raise UserError(
            f"{KEY}: {path} is an adapter trained over another one ({START_ADAPTER}/); merge them into one "
            "model folder (`ftkit export --merge-lora`) and name that"
        )
    base = json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base:
        raise UserError(f"{KEY}: {folder / ADAPTER_CONFIG} names no base_model_name_or_path")
    return base, path


def check_tokenizers(cfg) -> None:
    """Refuse a teacher whose tokenizer differs from the policy's: it scores the policy's token ids, which
    mean the same text to both only when their vocabularies and special tokens agree. Before the run
    writes anything."""
    if not cfg.grpo.teacher:
        return
    base, adapter = teacher_parts(cfg.grpo.teacher)
    own = adapter and any(
        Path(adapter, name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")
    )
    try:
        teacher = load_tokenizer(
            ModelConfig(path=adapter if own else base, trust_remote_code=cfg.model.trust_remote_code)
        )
    except UserError as exc:
        raise UserError(str(exc).replace("model.path", KEY, 1)) from None
    student = load_tokenizer(cfg.model)
    differs = tokenizer_difference(student, teacher)
    if differs:
        raise UserError(f"{KEY}: {cfg.grpo.teacher}: its tokenizer differs from model.path's ({differs})")


def tokenizer_difference(student, teacher) -> str | None:
    """What differs between two tokenizers, in a few words, or None when they agree."""
    ours, theirs = student.get_vocab(), teacher.get_vocab()
    if ours != theirs:
        changed = len(set(ours.items()) ^ set(theirs.items()))
        return f"vocabularies of {len(ours)} and {len(theirs)} tokens, {changed} entries not shared"
    for name in ("bos_token_id", "eos_token_id", "unk_token_id"):
        if getattr(student, name) != getattr(teacher, name):
            return f"{name} {getattr(student, name)} vs {getattr(teacher, name)}"
    specials = set(student.all_special_tokens) ^ set(teacher.all_special_tokens)
    specials -= {student.pad_token, teacher.pad_token}  # padding is never scored
    return f"special tokens {sorted(specials)}" if specials else None


class Teacher:
    """The frozen teacher, prepared (sharded) like the policy: per-token log-probs of the completions."""

    def __init__(self, model):
        self.model = model

    @classmethod
    def build(cls, accelerator, cfg, features) -> Teacher | None:
        """Collective: None without grpo.teacher."""
        if not cfg.grpo.teacher:
            return None
        base, adapter = teacher_parts(cfg.grpo.teacher)
        return cls(load_separate(accelerator, cfg, features, base, KEY, adapter=adapter))

    def logps(self, batch: dict, temperature: float) -> torch.Tensor:
        with frozen(self.model):
            return completion_logps(self.model, batch, temperature)


def score(run, model, rollout, prompts, cfg, pad_id: int, teacher: Teacher | None) -> None:
    """Collective: set `rollout.teacher_gap`, the teacher's log-prob minus the policy's of every sampled
    token, [N, max_new_tokens]; nothing without a teacher. It is 0 past each completion and on a
    conversation's environment tokens: the round's micro-batches make those no target (rollout.mask), so
    both scorings give them 0 while still reading them as context."""
    if teacher is None:
        return
    policy = rollout.old_logps if rollout.old_logps is not None else rollout.policy_logps
    if policy is None:  # HF generate, one step a round: the policy is scored here only
        policy = scored(run, model, rollout, prompts, cfg, pad_id, None)
    rollout.teacher_gap = scored(run, model, rollout, prompts, cfg, pad_id, teacher) - policy
