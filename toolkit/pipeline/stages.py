"""Which decoder layers each pipeline stage holds, and the model trimmed to one process's stages.

A process keeps the model object it loaded (LoRA included) and drops what its stages do not hold, so every
parameter it keeps has the name it has in the whole model: checkpoints, export and the portable resume key
the stages' parts as they key the whole model's. The first stage holds the input embeddings, the last the
final norm and the output head; every stage computes the rotary embeddings and the causal mask itself
from the position ids and attention mask that travel with the hidden states.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask

from toolkit.data.collate import flash_varlen_kwargs
from toolkit.data.encode import IGNORE
from toolkit.train import head as heads

# Model types whose decoder layers take (hidden, mask, position ids, rotary embeddings) and whose model
# is embeddings -> layers -> norm -> head, the shape a stage reproduces.
SUPPORTED = ("llama", "qwen2", "mistral")


def model_problem(config, stages: int) -> str | None:
    """Why the model built from `config` cannot be split into `stages` stages (one phrase), or None."""
    if config.model_type not in SUPPORTED:
        return (
            f"model type {config.model_type} is not split into pipeline stages (ftkit pipelines "
            f"{', '.join(SUPPORTED)}-shaped models): use ddp, fsdp or zero3 for it"
        )
    if getattr(config, "tie_word_embeddings", False):
        return (
            "the model ties its output head to its input embeddings, which would live on the first and "
            "the last stage at once: use ddp, fsdp or zero3 for it"
        )
    if config.num_hidden_layers < stages:
        return f"the model has {config.num_hidden_layers} decoder layers, fewer than {stages} stages"
    return None


def layers_problem(layers: list[int], stages: int, num_layers: int) -> str | None:
    """Why a given split (`pipeline.layers`) does not fit, or None."""
    if layers and (len(layers) != stages or sum(layers) != num_layers):
        return (
            f"pipeline.layers {layers} gives {len(layers)} stages of {sum(layers)} layers; the launch has "
            f"{stages} stages and the model {num_layers} layers"
        )
    return None


def balanced(layer_params: list[int], first_extra: int, last_extra: int, stages: int) -> list[int]:
    """Layers per stage, consecutive, minimising the largest stage's parameters (the first stage also
    holds `first_extra` parameters, the last `last_extra`): an exact partition by dynamic programming."""
    n = len(layer_params)
    prefix = [0]
    for size in layer_params:
        prefix.append(prefix[-1] + size)

    def cost(start: int, stop: int) -> int:
        extra = (first_extra if start == 0 else 0) + (last_extra if stop == n else 0)
        return prefix[stop] - prefix[start] + extra

    # best[k][i]: the smallest largest stage splitting the first i layers into k stages.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], cost(j, i))
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    sizes, i = [], n
    for k in range(stages, 0, -1):
        sizes.append(i - cut[k][i])
        i = cut[k][i]
    return sizes[::-1]


def layer_split(model, stages: int, given: list[int]) -> list[int]:
    """Decoder layers of each stage: `given` (pipeline.layers), else balanced by parameter count."""
    if given:
        return list(given)
    base = causal_lm(model)
    numel = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    layer_params = [numel(layer) for layer in base.model.layers]
    return balanced(
        layer_params, numel(base.model.embed_tokens), numel(base.model.norm) + numel(base.lm_head), stages
    )


def is_part(model) -> bool:
    """Whether `model` was trimmed to some pipeline stages (`trim` keeps its layers by index)."""
    inner = getattr(causal_lm(model), "model", None)
    return isinstance(getattr(inner, "layers", None), nn.ModuleDict)


def causal_lm(model):
    """The transformers causal LM inside a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def trim(model, split: list[int], stage_ids: list[int]) -> list[Stage]:
    """Drop from `model` every part the stages `stage_ids` (of len(split)) do not hold; returns their
    Stage modules, in the order of `stage_ids`."""
    base = causal_lm(model)
    inner = base.model
    # A replicated checkpoint numbers the optimizer's moments by position in the whole model's order.
    model.pipeline_whole_trained = [
        (n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad
    ]
    bounds = [sum(split[:i]) for i in range(len(split) + 1)]
    last = len(split) - 1
    stages = [Stage(base, range(bounds[i], bounds[i + 1]), first=i == 0, last=i == last) for i in stage_ids]
    kept = {str(i): inner.layers[i] for s in stage_ids for i in range(bounds[s], bounds[s + 1])}
    inner.layers = nn.ModuleDict(kept)  # the kept layers keep their names: model.layers.<index>
    if 0 not in stage_ids:
        inner.embed_tokens = None
    if last not in stage_ids:
        inner.norm = None
        base.lm_head = None
    return stages


class Stage(nn.Module):
    """One stage's forward: (input ids or hidden states, position ids, attention mask, labels) in; the
    same with new hidden states out, or on the last stage the log-probability of each position's next
    label token (0 where there is none), [rows, length]."""

    def __init__(self, base, layer_ids, first: bool, last: bool):
        super().__init__()
        inner = base.model
        self.config = base.config
        self.embed = inner.embed_tokens if first else None
        self.decoder = nn.ModuleList(inner.layers[i] for i in layer_ids)
        self.rotary = inner.rotary_emb
        self.norm = inner.norm if last else None
        self.head = base.lm_head if last else None
        self.uniform = True
        """The loss weighs every token alike (the chunked head then takes its gradient in the forward)."""
        self.output = "target"
        """What the last stage returns: target (label tokens' log-probs) or argmax (the greedy next token
        at each position, as floats: the schedule's buffers keep one dtype)."""

    def forward(self, x, position_ids, attention_mask, labels):
        hidden = self.embed(x) if self.embed is not None else x
        # A mask with no padding is left out, so that restarting position ids keep packed examples apart.
        mask_in = None if bool(attention_mask.all()) else attention_mask
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=mask_in,
            past_key_values=None,
            position_ids=position_ids,
        )
        extra = {}
        if mask_in is None and self.config._attn_implementation == "flash_attention_2":
            extra = flash_varlen_kwargs(position_ids)
        rotary = self.rotary(hidden, position_ids)
        for layer in self.decoder:
            hidden = layer(
                hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=rotary, **extra
            )
        if self.head is None:
            return hidden, position_ids, attention_mask, labels
        if self.output == "argmax":
            picked = self.head(self.norm(hidden)).argmax(dim=-1)
            return picked.to(torch.promote_types(hidden.dtype, torch.float32))
        return self._target_logps(self.norm(hidden), labels)

    def _target_logps(self, hidden, labels):
        targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], dim=1)
        # The schedule's first pass infers shapes on unfilled receive buffers: keep any label in range.
        vocab = self.head.weight.shape[0]
        targets = torch.where((targets >= 0) & (targets < vocab), targets, IGNORE)
        if isinstance(self.head, heads.TargetHead):
            self.head.targets, self.head.uniform = targets, self.uniform
            try:
                with self.head.shape.moved_into_head():
                    return self.head(hidden)
            finally:
                self.head.targets, self.head.uniform = None, False
        logps = self.head(hidden).float().log_softmax(-1)
        picked = logps.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
        return torch.where(targets != IGNORE, picked, torch.zeros_like(picked))
