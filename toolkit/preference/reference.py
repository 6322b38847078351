"""Reference log-probabilities: the policy with its adapter switched off (LoRA), a separate frozen model,
or values computed once before training and read back (full fine-tune; reused on resume).

Every reference forward runs in eval mode (no dropout) without gradients, through the prepared model so
sharded backends gather their weights as in training.
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path

import torch
from accelerate.utils import DistributedType
from safetensors.torch import load_file, save_file

from toolkit.checkpoint.rundir import REFERENCE_LOGPS
from toolkit.config import LoraConfig, ModelConfig
from toolkit.distributed import data_shard, unwrap
from toolkit.errors import UserError
from toolkit.model.load import load_model
from toolkit.preference.config import precomputes_reference, uses_reference
from toolkit.preference.data import strided_batches
from toolkit.preference.loss import batch_sequence_logps

FILE, INFO = REFERENCE_LOGPS


@contextlib.contextmanager
def frozen(model):
    """Eval mode and no gradients for the duration; the previous mode is restored after."""
    was_training = getattr(model, "module", model).training  # DeepSpeed's engine keeps a stale flag
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def adapter_off(accelerator, model):
    """The unwrapped PEFT model's adapters disabled (DDP, FSDP and DeepSpeed wrappers forward to it)."""
    return unwrap(accelerator, model).disable_adapter()


def live_logps(accelerator, model, batch: dict, separate=None, pipeline=None) -> torch.Tensor:
    """Reference log-probs of a stacked batch: from `separate` (a prepared frozen model) when given, else
    from `model` with its adapter switched off (a model without adapter is used as it is: only right
    before training does that make it the reference); through `pipeline`'s stages when there is one."""
    return (
        pipeline_logps(accelerator, model, [batch], pipeline)[0]
        if pipeline
        else _live(accelerator, model, batch, separate)
    )


def _live(accelerator, model, batch: dict, separate) -> torch.Tensor:
    source = separate if separate is not None else model
    with frozen(source), _adapter_off_if_any(accelerator, model, separate):
        return batch_sequence_logps(source, batch)[0]


def pipeline_logps(accelerator, model, batches: list[dict], pipeline) -> list[torch.Tensor]:
    """Collective: the reference log-probs of `batches` (at most a step's) through a pipeline's stages."""
    with _adapter_off_if_any(accelerator, model, None):
        return pipeline.forward_logps(batches)


def _adapter_off_if_any(accelerator, model, separate):
    has_adapter = hasattr(unwrap(accelerator, model), "disable_adapter")
    return adapter_off(accelerator, model) if separate is None and has_adapter else contextlib.nullcontext()


class Precomputed:
    """Reference log-probs per pair, computed in one pass over a dataset and looked up by `pair_index`."""

    def __init__(self, chosen: torch.Tensor, rejected: torch.Tensor):
        self.chosen = chosen
        self.rejected = rejected

    def lookup(self, batch: dict) -> torch.Tensor:
        index = batch["pair_index"].cpu()
        device = batch["input_ids"].device
        return torch.cat([self.chosen[index], self.rejected[index]]).to(device)


def compute(
    accelerator, model, dataset, collate, batch_size: int, separate=None, pipeline=None
) -> Precomputed:
    """Collective: every rank scores a strided share of `dataset` (rows carry `pair_index`) and the
    shares are gathered into per-pair tensors."""
    table = torch.zeros(len(dataset), 2, dtype=torch.float64)
    rank, world = data_shard(accelerator)
    for rows, real in strided_batches(dataset, rank, world, batch_size):
        batch = {k: v.to(accelerator.device) for k, v in collate(rows).items()}
        logps = live_logps(accelerator, model, batch, separate, pipeline)
        values = torch.stack(logps.double().chunk(2), dim=1)
        # Padding rows (copies of pair 0) are marked -1 and dropped after the gather.
        marks = torch.tensor(
            [r["pair_index"] if ok else -1 for r, ok in zip(rows, real)], device=values.device
        )
        found = accelerator.gather(torch.cat([marks.double()[:, None], values], dim=1)).cpu()
        found = found[found[:, 0] >= 0]
        table[found[:, 0].long()] = found[:, 1:]
    return Precomputed(table[:, 0].contiguous(), table[:, 1].contiguous())


def save(path: Path, tables: dict[str, Precomputed], fingerprint: dict) -> None:
    """Write all tables (safetensors) and what they were computed for (JSON) beside the run."""
    tensors = {}
    for name, table in tables.items():
        tensors[f"{name}.chosen"], tensors[f"{name}.rejected"] = table.chosen, table.rejected
    save_file(tensors, str(path / FILE))
    (path / INFO).write_text(json.dumps(fingerprint, indent=1))


def load(path: Path, fingerprint: dict) -> dict[str, Precomputed] | None:
    """The saved tables when they were computed for exactly this data and reference; None when absent."""
    if not (path / FILE).is_file() or not (path / INFO).is_file():
        return None
    if json.loads((path / INFO).read_text()) != fingerprint:
        raise UserError(
            f"{path / INFO}: the saved reference log-probs were computed for other data or another "
            "reference; start a fresh run (train.overwrite=true)"
        )
    tensors = load_file(str(path / FILE))
    names = {key.rsplit(".", 1)[0] for key in tensors}
    return {name: Precomputed(tensors[f"{name}.chosen"], tensors[f"{name}.rejected"]) for name in names}


def load_separate(accelerator, cfg, features, path: str, key: str = "dpo.reference_model", adapter=None):
    """The reference model at `path` (config key `key`), with `adapter` folded in when given, loaded frozen
    in the policy's dtype and prepared (sharded) like the policy: DDP/FSDP through accelerate, DeepSpeed as
    an inference engine of its own."""
    spec = ModelConfig(
        path=path,
        adapter=adapter,
        method="full",
        dtype=cfg.model.dtype,
        attn_implementation=cfg.model.attn_implementation,
        gradient_checkpointing=False,
        trust_remote_code=cfg.model.trust_remote_code,
    )
    rank = accelerator.local_process_index
    model = load_model(spec, LoraConfig(), rank, features, key, loss=cfg.loss)
    model.eval()
    model.requires_grad_(False)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return deepspeed_reference(accelerator, model)
    return accelerator.prepare_model(model, evaluation_mode=True)


def deepspeed_reference(accelerator, model):
    """`model` as a DeepSpeed engine without optimizer: under ZeRO-3 its weights are partitioned across
    the ranks (and offloaded where the policy's are) and gathered layer by layer in forward, as the
    policy's; under ZeRO-1/2, which partition only training states, it is held whole like the policy."""
    import deepspeed

    config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
    for key in ("optimizer", "scheduler"):
        config.pop(key, None)
    zero = config.get("zero_optimization", {})
    if zero.get("stage") == 3:
        config["zero_optimization"] = {k: v for k, v in zero.items() if k != "offload_optimizer"}
    else:
        config["zero_optimization"] = {"stage": 0}
    engine = deepspeed.initialize(model=model, config=config)[0]
    engine.eval()  # DeepSpeed's eval() returns None, not the engine
    return engine


class Reference:
    """Where a run's reference log-probs come from: nothing (reference-free losses), precomputed tables,
    a separate frozen model, or the policy with its adapter off."""

    def __init__(self, accelerator, model, tables=None, separate=None, needed: bool = True, pipeline=None):
        self.accelerator = accelerator
        self.model = model
        self.tables = tables
        self.separate = separate
        self.needed = needed
        self.pipeline = pipeline

    @classmethod
    def build(
        cls, accelerator, model, cfg, features, datasets: dict, collate, fresh: bool, pipeline=None
    ) -> Reference:
        """Collective: the reference `cfg` asks for; tables are computed now (fresh run) or read back.
        With a `pipeline` the policy's forward passes run through its stages (no separate model)."""
        if not uses_reference(cfg):
            return cls(accelerator, model, needed=False)
        path = cfg.dpo.reference_model
        separate = load_separate(accelerator, cfg, features, path) if path else None
        if not precomputes_reference(cfg):
            return cls(accelerator, model, separate=separate, pipeline=pipeline)
        tables = precompute_or_load(
            accelerator, model, separate, datasets, collate, cfg, Path(cfg.output_dir), fresh, pipeline
        )
        return cls(accelerator, model, tables=tables)

    def step_logps(self, batches: list[dict]) -> list[torch.Tensor] | None:
        """Reference log-probs of each of a step's stacked batches (a pipeline scores them in one pass)."""
        if self.needed and self.tables is None and self.pipeline is not None:
            return pipeline_logps(self.accelerator, self.model, batches, self.pipeline)
        return [self.logps(batch) for batch in batches] if self.needed else None

    def logps(self, batch: dict, split: str = "train") -> torch.Tensor | None:
        """Reference log-probs of a stacked batch of `split` pairs (None for reference-free losses)."""
        if not self.needed:
            return None
        if self.tables is not None:
            return self.tables[split].lookup(batch)
        return live_logps(self.accelerator, self.model, batch, self.separate, self.pipeline)


def precompute_or_load(
    accelerator, model, separate, datasets: dict, collate, cfg, output_dir, fresh: bool, pipeline=None
):
    """Collective: the reference tables of every dataset in `datasets` (None entries skipped), computed
    now on a fresh run and saved beside it, or read back when resuming."""
    present = {name: data for name, data in datasets.items() if data is not None}
    fingerprint = {
        "reference": cfg.dpo.reference_model or cfg.model.path,
        "adapter": cfg.model.adapter,
        "pairs": {name: len(data) for name, data in present.items()},
        "first": {name: data[0]["chosen_ids"] for name, data in present.items()},
    }
    saved = load(Path(output_dir), fingerprint)
    if saved is not None:
        accelerator.print(f"reference log-probs: read from {output_dir / FILE}")
        return saved
    if not fresh:
        raise UserError(
            f"{output_dir / FILE}: missing; the run cannot resume without its reference log-probs"
        )
    tables = {
        name: compute(accelerator, model, data, collate, cfg.train.micro_batch_size, separate, pipeline)
        for name, data in present.items()
    }
    if accelerator.is_main_process:
        save(output_dir, tables, fingerprint)
    accelerator.wait_for_everyone()
    accelerator.print(f"reference log-probs: computed for {sum(map(len, present.values()))} pairs")
    return tables
