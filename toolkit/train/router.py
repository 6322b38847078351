"""The router's load-balancing loss of a mixture of experts, the same whatever the layout.

Each MoE layer's router gives every token a probability over the E experts and sends it to its top k. The
loss (Switch Transformer's, as transformers computes it) pools every layer's real tokens:

    f_e = top-k assignments to expert e per token (they add up to k; no gradient: a count)
    P_e = mean probability the router gave expert e
    aux = E x sum_e f_e P_e             (k when the load is even: f_e = k/E, P_e = 1/E)

Here f and P are taken over the whole data-parallel micro-batch: the counts and probability sums of every
data-parallel rank are added before the loss is formed, so two processes with m rows each compute what one
process computes on the 2m rows together. Balancing each rank's rows alone (what a model's own aux loss does
under data parallelism) would make the loss, and the push it gives the router, depend on how the batch is
split. Each rank's gradient comes from its own rows' probabilities only, and the backend's averaging over
ranks is multiplied back, so the summed gradient is that of the pooled loss."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from toolkit.model.moe import Routing

DEFAULT_COEF = 0.001


def router_coef(moe_cfg, model_config) -> float:
    """moe.router_aux_loss_coef, else the model config's own, else DEFAULT_COEF."""
    if moe_cfg.router_aux_loss_coef is not None:
        return moe_cfg.router_aux_loss_coef
    own = getattr(model_config.get_text_config(), "router_aux_loss_coef", None)
    return DEFAULT_COEF if own is None else float(own)


class RouterBalance:
    """Collects the routers' logits of the micro-batch being trained and turns them into the balancing loss
    (`loss`); keeps what the step's metrics report (`step_metrics`)."""

    def __init__(self, model, routing: Routing, coef: float, sum_over_data: Callable, data_parallel: int):
        self.routing, self.coef = routing, coef
        self.sum_over_data, self.data_parallel = sum_over_data, data_parallel
        self._logits: list[torch.Tensor] | None = None
        self._values: list[float] = []
        self._load: list[torch.Tensor] = []
        for module in model.modules():
            if type(module).__name__.endswith("TopKRouter"):
                module.register_forward_hook(self._collect)

    def _collect(self, module, args, output) -> None:
        # Only a forward pass that trains counts: evaluation, generation and reference passes run without
        # gradients; a checkpointed layer's recomputation comes after `loss` and is not used.
        if self._logits is not None and torch.is_grad_enabled() and output[0].requires_grad:
            self._logits.append(output[0])

    @contextlib.contextmanager
    def micro_batch(self):
        """Around one micro-batch's forward pass and `loss`."""
        self._logits = []
        try:
            yield self
        finally:
            self._logits = None

    def loss(self, token_mask: torch.Tensor) -> torch.Tensor:
        """Collective: this rank's share of `coef` x the pooled loss, scaled for the backend's averaging
        over ranks (add it to the value given to `backward`). `token_mask` marks the real tokens of the
        micro-batch's rows, in the order the model flattened them."""
        if not self._logits:
            return 0.0  # a dense model
        experts, per_token = self.routing.experts, self.routing.per_token
        mask = token_mask.reshape(-1, 1).float()
        counts = torch.zeros(len(self._logits), experts, device=mask.device)
        probs = []
        for layer, logits in enumerate(self._logits):
            p = torch.softmax(logits.float(), dim=-1) * mask
            chosen = torch.topk(p.detach(), per_token, dim=-1).indices
            counts[layer].scatter_add_(0, chosen.reshape(-1), mask.expand(-1, per_token).reshape(-1))
            probs.append(p.sum(dim=0))
        prob_sum = torch.stack(probs).sum(dim=0)
        local = torch.cat([counts.reshape(-1), prob_sum.detach(), mask.sum().reshape(1)])
        pooled = self.sum_over_data(local)
        counts_all = pooled[: counts.numel()].reshape(counts.shape)
        rows = pooled[-1] * len(self._logits)
        share = counts_all.sum(dim=0) / rows
        self._values.append(experts * float((share * pooled[counts.numel() : -1]).sum() / rows))
        self._load.append(counts_all)
        return self.coef * self.data_parallel * experts * (share * prob_sum).sum() / rows

    def step_metrics(self) -> dict[str, float]:
        """The step's mean balancing loss (`router_aux_loss`) and the busiest expert's load over an even
        share, the largest of any layer (`expert_load_max`: 1 is even, E/k would be one expert taking all);
        the step's record is then cleared."""
        if not self._values:
            return {}
        load = torch.stack(self._load).sum(dim=0)
        even = load.sum(dim=1, keepdim=True) / self.routing.experts
        metrics = {
            "router_aux_loss": sum(self._values) / len(self._values),
            "expert_load_max": float((load / even).max()),
        }
        self._values, self._load = [], []
        return metrics


def experts_line(model, routing, coef: float, cfg, data_parallel: int) -> str:
    """The start-up line of a mixture of experts: its routing, kernel, router balance and what is trained
    (`cfg`: the moe section)."""
    from toolkit.model import moe, quant_experts

    parts = ", ".join(f"{part} {count:,}" for part, count in moe.trained_parts(model).items())
    packed = quant_experts.stored_bytes(model)
    stored = f"; experts stored in 4-bit, {packed / 2**20:,.2f} MiB" if packed else ""
    if cfg.expert_parallel > 1:
        stored += f"; experts split over {cfg.expert_parallel} processes"
    kernel = getattr(model.config, "_experts_implementation", None) or "eager"
    return (
        f"experts: {routing.experts} a layer, {routing.per_token} per token, {kernel} kernel; router balance "
        f"{coef:g} x the load-balancing loss, pooled over {data_parallel} data-parallel rank(s); "
        f"trained: {parts}{stored}"
    )
