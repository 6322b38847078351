"""The chunked loss head: log-probabilities of the label tokens without the whole logits.

`install` turns the model's output layer into a `TargetHead`. Outside `target_logps` it is the plain linear
layer (generation, export and state-dict names are unchanged). Inside, the model's own forward pass hands
its last hidden states to the head as usual, and the head returns, for each position, the log-probability
of the next label token, computed `chunk_tokens` label tokens at a time by `_TargetLogps`: the head's
projection, log-softmax and target pick per chunk, differentiated in the same pass (or, for a trained
head under a loss that weighs tokens unequally, recomputed in backward) so that neither the logits nor
their gradient exist whole.

Scoring inside the model's forward, rather than on hidden states it returned, is what keeps every backend
right: ZeRO-3 gathers the head's weight when the head module runs (and again for its backward), FSDP has
it unsharded there, and DDP sees every parameter used in its own forward.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn.functional as F
from torch import nn

from toolkit.data.collate import model_inputs
from toolkit.data.encode import IGNORE
from toolkit.errors import UserError
from toolkit.model.speed import eager_blocks
from toolkit.train import truncation
from toolkit.train.fused_head import chunk_bounds, chunk_math

# Config keys of models whose forward changes the logits after the head in a way the chunked head cannot
# reproduce; each is refused by name rather than scored wrongly.
UNSUPPORTED_LOGIT_KEYS = ("logit_scale", "output_multiplier", "unpadded_vocab_size")


class TargetHead(nn.Linear):
    """An output layer that, while `targets` is set, returns the log-probability of each position's
    target token (0 where the target is IGNORE) in place of the logits."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.targets is None:
            return super().forward(hidden)
        return score(
            hidden,
            self.weight,
            self.bias,
            self.targets,
            self.chunk_tokens,
            self.uniform,
            self.shape,
            self.fused if self.shape.untouched else None,  # compiled for untempered, uncut logits
        )


def not_chunkable(model) -> str | None:
    """Why the chunked head cannot stand in for `model`'s output layer, or None."""
    layer = model.get_output_embeddings()
    name = getattr(model.config, "model_type", type(model).__name__)
    if type(layer) is not nn.Linear:
        kind = f"{type(layer).__module__}.{type(layer).__qualname__}"
        return f"the output layer of {name} is a {kind}, not a plain linear layer (LoRA on lm_head?)"
    problem = logit_change_problem(model.config)
    if problem:
        return (
            f"{name} changes its logits after the head ({problem}), which the chunked head does not reproduce"
        )
    return None


def install(model, chunk_tokens: int, fused: bool = False) -> None:
    """Make `model`'s output layer a TargetHead in place (one line naming what stands in the way).
    `fused`: its per-chunk math compiled into fused kernels (`fused_head`), as compiled blocks have it."""
    reason = not_chunkable(model)
    if reason:
        raise UserError(f"loss.head: chunked: {reason}; set loss.head: full")
    layer = model.get_output_embeddings()
    layer.__class__ = TargetHead
    layer.verified = False
    layer.targets = None
    layer.uniform = False
    layer.chunk_tokens = chunk_tokens
    layer.shape = LogitShape.of(model.config)
    layer.fused = chunk_math(layer.shape.scale, layer.shape.softcap) if fused else None


def check_loss_head(facts, recipe_source) -> None:
    """loss.head chunked on a model (`facts`: launch checks' ModelFacts) that changes its logits after the
    head is refused before any data is prepared."""
    problem = logit_change_problem(facts.config) if facts.config is not None else None
    if problem:
        raise UserError(
            f"loss.head chunked {recipe_source:loss.head}: {facts.path} changes its logits after the head "
            f"({problem}), which the chunked head does not reproduce; set loss.head: full"
        )


def logit_change_problem(config) -> str | None:
    """The config key by which a model changes its logits after the head in a way LogitShape does not
    cover, or None. A nested text config's scale or cap is read from there, where LogitShape does not
    look, so it counts too."""
    nested = getattr(config, "text_config", None)
    nested = nested if nested is not None and nested is not config else None
    for key in UNSUPPORTED_LOGIT_KEYS:
        if any(getattr(c, key, None) is not None for c in (config, nested)):
            return key
    for key in LogitShape.KEYS:
        if getattr(nested, key, None) not in (None, 1.0):
            return f"text_config.{key}"
    return None


class LogitShape:
    """What the model does to the head's output before it is a logit: a scale, then a tanh soft cap.

    The model applies both itself after the head (the config keys are read in its forward); while the head
    scores targets they are applied here instead, and set to no-ops in the config for that forward."""

    KEYS = {"logits_scaling": 1.0, "final_logit_softcapping": None}

    def __init__(self, config, scaling: float, softcap: float | None):
        self.config = config
        self.scale = 1.0 / scaling
        self.softcap = softcap
        # A sampling temperature the logits are divided by last, and the sampler's top-k / top-p cut (GRPO
        # scores the distribution it sampled from): none but in a `tempered` copy.
        self.temperature, self.top_k, self.top_p = 1.0, 0, 1.0

    @classmethod
    def of(cls, config) -> LogitShape:
        return cls(
            config,
            getattr(config, "logits_scaling", None) or 1.0,
            getattr(config, "final_logit_softcapping", None),
        )

    @contextlib.contextmanager
    def moved_into_head(self):
        saved = {key: getattr(self.config, key) for key in self.KEYS if hasattr(self.config, key)}
        for key in saved:
            setattr(self.config, key, self.KEYS[key])
        try:
            yield
        finally:
            for key, value in saved.items():
                setattr(self.config, key, value)

    def tempered(self, temperature: float, top_k: int = 0, top_p: float = 1.0) -> LogitShape:
        """This shape with the logits divided by `temperature` last and the softmax taken over the tokens
        a top-k / top-p sampler keeps (a copy: a backward pass that recomputes reads the shape its forward
        pass had)."""
        shape = copy.copy(self)
        shape.temperature, shape.top_k, shape.top_p = temperature, top_k, top_p
        return shape

    @property
    def untouched(self) -> bool:
        """No temperature and no cut: the logits' whole softmax."""
        return self.temperature == 1.0 and not truncation.truncates(self.top_k, self.top_p)

    def kept(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """The sampler's kept tokens for a chunk of logits (truncation.kept), None without a cut."""
        return truncation.kept(logits, self.top_k, self.top_p, targets)

    def apply(self, z: torch.Tensor) -> torch.Tensor:
        """The logits from the head's float32 output, in place."""
        if self.scale != 1.0:
            z.mul_(self.scale)
        if self.softcap:
            z.div_(self.softcap).tanh_().mul_(self.softcap)
        if self.temperature != 1.0:
            z.div_(self.temperature)
        return z

    def chain(self, dz: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The gradient with respect to the head's output from that with respect to the logits, in place."""
        if self.temperature != 1.0:
            dz.div_(self.temperature)
        if self.softcap:
            dz.mul_(1 - (logits * (self.temperature / self.softcap)).square_())
        if self.scale != 1.0:
            dz.mul_(self.scale)
        return dz


def chunked_head(model) -> TargetHead | None:
    """The model's installed TargetHead (through any backend wrapper), or None."""
    return next((m for m in model.modules() if isinstance(m, TargetHead)), None)


def target_logps(
    model, batch: dict, uniform: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """Per-position log-probability of the next label token, [rows, length - 1] ([rows, length] for a
    sequence-parallel slice), 0 where the label is IGNORE; the chunked head's forward pass. `uniform`: the
    caller's loss weighs every token alike (a summed token loss), so the gradient is taken in the forward
    pass and not recomputed. `temperature`, `top_k`, `top_p`: of the distribution softmax(logits /
    temperature) over the tokens a top-k / top-p sampler keeps (train/truncation.py).

    The first call for a model checks the head against the model's own logits (see `verify`): every rank
    makes it at the same point, so the forward passes it adds stay collective."""
    layer = chunked_head(model)
    if not layer.verified:
        verify(model, layer, batch)
        layer.verified = True
    if temperature == 1.0 and not truncation.truncates(top_k, top_p):
        return _scored(model, layer, batch, uniform)
    shape, layer.shape = layer.shape, layer.shape.tempered(temperature, top_k, top_p)
    try:
        return _scored(model, layer, batch, uniform)
    finally:
        layer.shape = shape


def _scored(model, layer: TargetHead, batch: dict, uniform: bool) -> torch.Tensor:
    shifted = "shift_labels" in batch  # a sequence-parallel slice: every position has its target
    if shifted:
        targets = batch["shift_labels"]
    else:
        labels = batch["labels"]
        targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], dim=1)
    layer.targets, layer.uniform = targets, uniform
    try:
        with layer.shape.moved_into_head():
            logps = model(**model_inputs(batch)).logits
            return logps if shifted else logps[:, :-1]
    finally:
        layer.targets, layer.uniform = None, False


PROBE_TOKENS = 16


@torch.no_grad()
def verify(model, layer: TargetHead, batch: dict) -> None:
    """Refuse, in one line, a model whose chunked log-probs differ from those of its own logits: it changes
    its logits after the head in a way no config key announced (e.g. a cap kept as an attribute).

    Probes the first PROBE_TOKENS tokens of the batch's first row, every position a target, in eval mode."""
    ids = batch["input_ids"][:1, :PROBE_TOKENS]
    probe = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    # DeepSpeed's engine passes eval() to its module without clearing its own flag: read the module's.
    was_training = getattr(model, "module", model).training
    model.eval()
    try:
        with eager_blocks():  # a 16-token probe is not worth compiling an inference graph for
            logits = model(**model_inputs(probe)).logits[:, :-1].float()
            expected = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            got = _scored(model, layer, probe, uniform=False).float()
    finally:
        model.train(was_training)
    if not expected.numel():
        return
    gap = (got - expected).abs().max().item()
    half = layer.weight.element_size() < 4 or torch.is_autocast_enabled(ids.device.type)
    # Rounding alone stays far below these (the two paths run the same matmul and softmax per token).
    if not gap <= (5e-2 if half else 1e-3) * max(1.0, expected.abs().max().item()):
        name = getattr(layer.shape.config, "model_type", type(model).__name__)
        raise UserError(
            f"loss.head: chunked: {name}'s log-probs through the chunked head differ from its own logits' "
            f"(by {gap:.3g} on a {ids.size(1)}-token probe): it changes its logits after the head; "
            "set loss.head: full"
        )


def score(
    hidden, weight, bias, targets, chunk_tokens: int, uniform: bool, shape: LogitShape, fused=None
) -> torch.Tensor:
    """Log-probabilities of `targets` (the shape of `hidden` less its last dimension) under the head, 0
    where a target is IGNORE; only the label positions go through the head. The result is a tensor of its
    own, not a view (FSDP2 hooks a module's outputs, which an in-place op on a view would bypass).
    `fused`: the compiled per-chunk math (`fused_head.chunk_math`), else the eager passes."""
    picked = (targets != IGNORE).nonzero(as_tuple=True)
    out_dtype = torch.promote_types(hidden.dtype, torch.float32)
    picked_hidden, picked_targets = hidden[picked], targets[picked]
    logps = _TargetLogps.apply(
        picked_hidden, weight, bias, picked_targets, chunk_tokens, uniform, shape, fused
    )
    full = torch.zeros(targets.shape, dtype=out_dtype, device=hidden.device)
    return full.index_put(picked, logps.to(out_dtype))


class _TargetLogps(torch.autograd.Function):
    """log p(target) for rows of hidden states, a chunk of rows at a time, in float32 (float64 for a
    float64 model).

    The hidden states' gradient is taken in forward per row and scaled row by row in backward, which is
    exact whatever the loss. The weight's (and bias') gradient sums over rows, so it is taken in forward
    only for a loss that weighs every row alike (`uniform`) and scaled in backward if the incoming
    gradients are indeed all equal; otherwise each chunk is recomputed for it in backward. A frozen head
    (LoRA) is thus never recomputed."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_tokens, uniform, shape, fused):
        device = hidden.device.type
        autocast = torch.is_autocast_enabled(device)
        ctx.dtype = torch.get_autocast_dtype(device) if autocast else hidden.dtype
        ctx.chunk_tokens, ctx.shape, ctx.fused = chunk_tokens, shape, fused
        ctx.save_for_backward(hidden, weight, bias, targets)
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        early = (need_hidden, need_weight and uniform, need_bias and uniform)
        grads = _zero_grads(hidden, weight, bias, early)
        out_dtype = torch.promote_types(ctx.dtype, torch.float32)
        out = torch.empty(len(targets), dtype=out_dtype, device=hidden.device)
        with torch.autocast(device, enabled=False):
            w, b = _cast(weight, ctx.dtype), _cast(bias, ctx.dtype)
            for rows in chunk_bounds(len(targets), chunk_tokens, fused is not None):
                h = hidden[rows].to(ctx.dtype)
                if fused is not None:
                    out[rows], dz = fused(F.linear(h, w, b), targets[rows], out_dtype, None, any(early))
                    if dz is not None:
                        _accumulate(grads, dz, h, w, rows)
                    continue
                logits = shape.apply(_head(h, w, b, out_dtype))
                kept = shape.kept(logits, targets[rows])
                lse = torch.logsumexp(truncation.masked(logits, kept), dim=-1)
                out[rows] = logits.gather(1, targets[rows, None]).squeeze(1) - lse
                if any(early):
                    dz = _dlogp(logits, lse, targets[rows], shape, kept)
                    _accumulate(grads, dz.to(ctx.dtype), h, w, rows)
        ctx.grads = grads
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, targets = ctx.saved_tensors
        (grad_hidden, *param_grads), ctx.grads = ctx.grads, None
        if grad_hidden is not None:
            grad_hidden.mul_(grad_out[:, None])
        needs = ctx.needs_input_grad[1:3]
        if any(need and g is None for need, g in zip(needs, param_grads)) or not _all_equal(grad_out):
            param_grads = _recomputed_param_grads(ctx, hidden, weight, bias, targets, grad_out, needs)
        else:
            factor = grad_out[0] if len(grad_out) else 0.0
            param_grads = [g.mul_(factor) if g is not None else None for g in param_grads]
        return (grad_hidden, *param_grads, None, None, None, None, None)


def _recomputed_param_grads(ctx, hidden, weight, bias, targets, grad_out, needs) -> list:
    """The weight and bias gradients for per-row incoming gradients, each chunk's logits recomputed."""
    grads = _zero_grads(hidden, weight, bias, (False, *needs))
    if not any(needs):
        return grads[1:]
    with torch.autocast(hidden.device.type, enabled=False):
        w, b = _cast(weight, ctx.dtype), _cast(bias, ctx.dtype)
        for rows in chunk_bounds(len(targets), ctx.chunk_tokens, ctx.fused is not None):
            h = hidden[rows].to(ctx.dtype)
            if ctx.fused is not None:
                _, dz = ctx.fused(F.linear(h, w, b), targets[rows], grad_out.dtype, grad_out[rows], True)
                _accumulate(grads, dz, h, w, rows)
                continue
            logits = ctx.shape.apply(_head(h, w, b, grad_out.dtype))
            kept = ctx.shape.kept(logits, targets[rows])
            lse = torch.logsumexp(truncation.masked(logits, kept), dim=-1)
            dz = _dlogp(logits, lse, targets[rows], ctx.shape, kept).mul_(grad_out[rows, None])
            _accumulate(grads, dz.to(ctx.dtype), h, w, rows)
    return grads[1:]


def _cast(tensor, dtype):
    return tensor.to(dtype) if tensor is not None else None


def _head(h, w, b, dtype) -> torch.Tensor:
    """The head's output for a chunk of rows, as a fresh tensor of `dtype` (float32 at least)."""
    z = F.linear(h, w, b)
    return z.to(dtype) if z.dtype != dtype else z


def _dlogp(logits, lse, targets, shape: LogitShape, kept=None) -> torch.Tensor:
    """d log p(target) / d(head output) for a chunk: one-hot minus softmax (over the `kept` tokens when the
    sampler cuts), through the logit shape. Overwrites `logits` (which the soft cap's derivative reads
    first)."""
    probs = torch.exp(logits - lse[:, None]) if shape.softcap else logits.sub_(lse[:, None]).exp_()
    if kept is not None:
        probs.masked_fill_(~kept, 0.0)
    dz = probs.neg_()
    dz[torch.arange(len(targets), device=dz.device), targets] += 1
    reshaped = shape.softcap or shape.scale != 1.0 or shape.temperature != 1.0
    return shape.chain(dz, logits) if reshaped else dz


def _zero_grads(hidden, weight, bias, needs) -> list:
    """Gradient buffers for the inputs that need one: hidden in its dtype, weight and bias in theirs."""
    return [
        torch.zeros_like(t) if need and t is not None else None
        for t, need in zip((hidden, weight, bias), needs)
    ]


def _accumulate(grads, dz, h, w, rows) -> None:
    """Add one chunk's contribution to the hidden-state, weight and bias gradients."""
    grad_hidden, grad_weight, grad_bias = grads
    if grad_hidden is not None:
        grad_hidden[rows] = (dz @ w).to(grad_hidden.dtype)
    if grad_weight is not None:
        if grad_weight.dtype == dz.dtype:
            grad_weight.addmm_(dz.t(), h)
        else:
            grad_weight += (dz.t() @ h).to(grad_weight.dtype)
    if grad_bias is not None:
        grad_bias += dz.sum(0).to(grad_bias.dtype)


def _all_equal(grad: torch.Tensor) -> bool:
    return len(grad) == 0 or bool((grad == grad[0]).all())
