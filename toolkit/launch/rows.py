"""What may put several examples in one row (data.packing, data.streaming) or cut one row across processes
(sequence parallelism), given the model's layer kinds (`toolkit/model/families.py`).

Restarted position ids keep a packed example's attention to itself, and ftkit runs each recurrent layer it
knows (gated DeltaNet, Kimi delta attention, short convolution, Mamba-2) on each packed example alone
(toolkit/model/per_example.py). A layer of another kind would hand one example's state to the next, and
compressed attention pools tokens of neighbouring examples together; a row cut across processes would start
each slice of a recurrent layer from an empty state; under Ulysses sequence parallelism sdpa also attends
across packed examples. Each would train on a silently wrong loss, so each is refused before anything
loads, in one line naming the key."""

from __future__ import annotations

from toolkit.errors import UserError
from toolkit.model.facts import ModelFacts

PACKED = {"data.packing": "data.packing", "data.streaming": "data.streaming (it packs rows)"}


def check_rows(cfg, sp: int, facts: ModelFacts, recipe_source: str, launch_source: str) -> None:
    """Refuse packed rows on a model with a layer kind that lets packed examples reach each other, sequence
    parallelism (`sp` > 1) on a model with a recurrent layer kind, and packed rows under sequence
    parallelism."""
    packed = [key for key in PACKED if getattr(cfg.data, key.split(".")[1])]
    family = facts.family
    _refuse_latent_kv_heads(cfg.model.path, facts)
    leak = family.leaks if family is not None else None
    if leak is not None and packed:
        raise UserError(
            f"{PACKED[packed[0]]} {recipe_source:{packed[0]}}: {cfg.model.path} ({family.model_type}) has "
            f"{leak.name} layers, which let one packed example reach the next; set {packed[0]}: false "
            "(data.group_by_length pads less without joining examples)"
        )
    if family is not None and family.recurrent:
        model = f"{cfg.model.path} ({family.model_type}) has {family.recurrent[0].name} layers"
        if sp > 1:
            raise UserError(
                f"{launch_source}: parallelism_config_sp_size {sp} cuts each row across processes, and "
                f"{model}, whose state cannot pass from one slice to the next; launch without sequence "
                "parallelism"
            )
    if sp > 1 and packed:
        raise UserError(
            f"{launch_source}: parallelism_config_sp_size {sp} refuses {PACKED[packed[0]]} "
            f"{recipe_source:{packed[0]}} (sdpa would attend across the packed examples)"
        )


def _refuse_latent_kv_heads(path: str, facts: ModelFacts) -> None:
    """Multi-head latent attention expands its latent into K and V for every head; a config with fewer
    key/value heads is accepted by transformers and fails in the first forward pass (a shape traceback)."""
    family, raw = facts.family, facts.raw or {}
    text = raw.get("text_config") or raw
    heads, kv_heads = text.get("num_attention_heads"), text.get("num_key_value_heads")
    if family is not None and family.latent_kv and heads and kv_heads and kv_heads != heads:
        raise UserError(
            f"{path}/config.json: num_key_value_heads {kv_heads} with num_attention_heads {heads}, but its "
            f"multi-head latent attention ({family.model_type}) gives every head its own K and V; set "
            f"num_key_value_heads: {heads}"
        )
