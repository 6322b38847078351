"""Optimizer moments by parameter name: the portable half of a training state.

Read from a checkpoint of any layout, whole and on CPU, without a process group:

    replicated   optimizer.bin numbers parameters by position; named by the optimizer as built
    dcp          FSDP2 / tensor-parallel optimizer state, already by name
    deepspeed    ZeRO-1/2/3 flat partitions, one file per rank, cut back into parameters by the shapes
                 DeepSpeed lists in its model states (files memory-mapped: a parameter is read when cut)

and written into the optimizer of any layout: a plain optimizer before `accelerator.prepare`, FSDP2's
DTensor shards or DeepSpeed's flat fp32 partitions after it. Every rank holds the whole tensor and keeps its
own part, so nothing is communicated.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from toolkit.errors import UserError

Moments = Mapping[str, dict[str, torch.Tensor]]
"""parameter name -> optimizer state fields (Adam: step, exp_avg, exp_avg_sq)."""

ZERO_OPTIM = "optimizer_state_dict"
ZERO_STATE_FIELDS = ("exp_avg", "exp_avg_sq")


def positional(saved: dict, model, optimizer) -> Moments | None:
    """A torch optimizer's state_dict (numbered by position) named by `optimizer`, built for `model` the
    same way (checked: every group's size, every moment's shape); None where it was built otherwise."""
    whole = getattr(model, "pipeline_whole_trained", None)
    if whole is not None:
        return _whole_model(saved, whole)
    groups = [group["params"] for group in optimizer.param_groups]
    if [len(group["params"]) for group in saved["param_groups"]] != [len(group) for group in groups]:
        return None
    names = {id(param): name for name, param in model.named_parameters()}
    positions = [index for group in saved["param_groups"] for index in group["params"]]
    moments = {}
    for index, param in zip(positions, [param for group in groups for param in group]):
        state = saved["state"].get(index, {})
        shape = getattr(param, "ds_shape", param.shape)  # ZeRO-3 partitions weights as it builds them
        if any(value.dim() and value.shape != shape for value in state.values()):
            return None
        moments[names[id(param)]] = state
    return moments


def _whole_model(saved: dict, whole: list[tuple[str, tuple]]) -> Moments | None:
    """Moments by name for a pipeline stage, from the order the optimizer gives the whole model's trained
    parameters (`optim.build_optimizer`: matrices, then vectors; `whole` as `stages.trim` recorded it)."""
    groups = [[n for n, shape in whole if len(shape) >= 2], [n for n, shape in whole if len(shape) < 2]]
    groups = [group for group in groups if group]
    if [len(group["params"]) for group in saved["param_groups"]] != [len(group) for group in groups]:
        return None
    shapes = dict(whole)
    positions = [index for group in saved["param_groups"] for index in group["params"]]
    moments = {}
    for index, name in zip(positions, [name for group in groups for name in group]):
        state = saved["state"].get(index, {})
        if any(value.dim() and tuple(value.shape) != shapes[name] for value in state.values()):
            return None
        moments[name] = state
    return moments


def read_zero(directory: Path) -> OnDemand:
    """Adam's moments of a ZeRO-1/2/3 checkpoint directory (DeepSpeed's tag folder), by parameter name.
    The files were checked by `safe_load.check_deepspeed` and are read under the same allow-list."""
    from toolkit.checkpoint import safe_load

    def load(path: Path) -> dict:
        with torch.serialization.safe_globals(safe_load.deepspeed_types()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)

    shapes = load(next(directory.glob("*_model_states.pt")))["param_shapes"]
    files = sorted(directory.glob("*_optim_states.pt"), key=_rank_of)
    ranks = [load(path)[ZERO_OPTIM] for path in files]
    if int(ranks[0]["zero_stage"]) == 3:
        return _cut_zero3(ranks, {name: shape for group in shapes for name, shape in group.items()})
    return _cut_zero12(ranks, shapes)


def _rank_of(path: Path) -> int:
    return int(re.search(r"zero_pp_rank_(\d+)_", path.name).group(1))


def _group_states(rank: dict, flats: list[torch.Tensor]) -> list[dict]:
    """The base optimizer's state of each flat group, trimmed to the group's length (a rank's last
    partition keeps DeepSpeed's alignment padding in its moments but not in its fp32 copy)."""
    base = rank.get("base_optimizer_state", rank.get(ZERO_OPTIM))
    states = base if isinstance(base, list) else [base["state"][i] for i in sorted(base["state"])]
    trimmed = []
    for state, flat in zip(states, flats):
        trimmed.append({k: v[: flat.numel()] if v.dim() else v for k, v in state.items()})
    return trimmed


class OnDemand(Mapping):
    """A parameter's moments (or weight) read from memory-mapped files when asked for, so reading a
    checkpoint holds one parameter's at a time beside what the caller keeps (`cuts`: name -> its reader)."""

    def __init__(self, cuts: dict[str, Callable[[], object]]):
        self._cuts = cuts

    def __getitem__(self, name: str):
        return self._cuts[name]()

    def __contains__(self, name: object) -> bool:
        return name in self._cuts

    def __iter__(self):
        return iter(self._cuts)

    def __len__(self) -> int:
        return len(self._cuts)


def _cut_zero12(ranks: list[dict], shapes: list[dict]) -> OnDemand:
    """ZeRO-1/2: a group's partitions, rank after rank, are its parameters end to end (each followed by
    its alignment padding where DeepSpeed recorded one)."""
    flats = [rank["single_partition_of_fp32_groups"] for rank in ranks]
    states = [_group_states(rank, flat) for rank, flat in zip(ranks, flats)]
    paddings = ranks[0].get("param_alignment_paddings")

    def cut(group: int, offset: int, shape) -> dict[str, torch.Tensor]:
        found = {"step": states[0][group]["step"]}
        for field in ZERO_STATE_FIELDS:
            parts = [rank_states[group][field] for rank_states in states]
            found[field] = torch.cat(_span(parts, offset, math.prod(shape))).view(shape)
        return found

    cuts = {}
    for group, group_shapes in enumerate(shapes):
        offset = 0
        for index, (name, shape) in enumerate(group_shapes.items()):
            cuts[name] = functools.partial(cut, group, offset, shape)
            offset += math.prod(shape) + (paddings[group][index] if paddings else 0)
    return OnDemand(cuts)


def _cut_zero3(ranks: list[dict], shapes: dict) -> OnDemand:
    """ZeRO-3: each parameter is split into world-size equal pieces (the last padded), piece r in rank r's
    flat groups at the same offset."""
    world = len(ranks)
    flats = [rank["fp32_flat_groups"] for rank in ranks]
    states = [_group_states(rank, flat) for rank, flat in zip(ranks, flats)]

    def cut(offset: int, shape) -> dict[str, torch.Tensor]:
        numel = math.prod(shape)
        found = {"step": states[0][0]["step"]}
        for field in ZERO_STATE_FIELDS:
            piece = math.ceil(numel / world)
            views = [
                v for rank_states in states for v in _span([g[field] for g in rank_states], offset, piece)
            ]
            found[field] = torch.cat(views)[:numel].view(shape)  # the one copy out of the mapped files
        return found

    cuts, offset = {}, 0
    for name, shape in shapes.items():
        cuts[name] = functools.partial(cut, offset, shape)
        offset += math.ceil(math.prod(shape) / world)
    return OnDemand(cuts)


def _span(parts: list[torch.Tensor], start: int, numel: int) -> list[torch.Tensor]:
    """Views of elements [start, start + numel) of the parts laid end to end (the caller copies them once)."""
    views, begin = [], 0
    for part in parts:
        end = begin + part.numel()
        low, high = max(start, begin), min(start + numel, end)
        if low < high:
            views.append(part[low - begin : high - begin])
        begin = end
    if sum(view.numel() for view in views) != numel:
        raise ValueError(f"flat partitions hold {begin} elements, short of [{start}, {start + numel})")
    return views


def into_plain(model, optimizer, moments: Moments) -> None:
    """Give a plain optimizer (before `prepare`) the state saved by name; its groups stay as built."""
    names = {id(param): name for name, param in model.named_parameters()}
    # A torch optimizer's state_dict numbers parameters in order through its groups.
    params = [names[id(param)] for group in optimizer.param_groups for param in group["params"]]
    by_name = dict(model.named_parameters())
    # Cloned: Adam counts steps in place, so parameters must not share one saved step tensor.
    state = {
        i: {field: like(by_name[name], value).clone() for field, value in moments[name].items()}
        for i, name in enumerate(params)
        if name in moments
    }
    _check_covered(len(state), len(params))
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})


def into_prepared(accelerator, prepared_model, model, optimizer, moments: Moments) -> bool:
    """Collective-free, after `prepare`: write the moments into DeepSpeed's partitions or FSDP2's shards.
    `model` is the module as built (FSDP2 shards it in place), `optimizer` the torch one. False where this
    layout keeps its state some other way (FSDP1's flat parameters)."""
    if accelerator.distributed_type == "DEEPSPEED":
        _into_zero(prepared_model.optimizer, model, moments)
        return True
    if accelerator.distributed_type == "FSDP" and not getattr(accelerator, "is_fsdp2", False):
        return False
    _into_dtensors(model, optimizer, moments)
    return True


def _into_dtensors(model, optimizer, moments: Moments) -> None:
    names = {id(param): name for name, param in model.named_parameters()}
    params = [param for group in optimizer.param_groups for param in group["params"]]
    covered = 0
    for param in params:
        saved = moments.get(names.get(id(param)))
        if saved is not None:
            optimizer.state[param] = {field: like(param, value).clone() for field, value in saved.items()}
            covered += 1
    _check_covered(covered, len(params))


def _into_zero(zero, model, moments: Moments) -> None:
    """DeepSpeed keeps Adam's state per flat fp32 partition, created at the first step: create it with the
    saved step count, link each parameter's fragment to it, then fill the fragments."""
    from deepspeed.utils import safe_set_full_optimizer_state

    trained = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    _check_covered(sum(name in moments for name, _ in trained), len(trained))
    step = moments[trained[0][0]]["step"]
    flats = getattr(zero, "fp32_partitioned_groups_flat", None) or zero.single_partition_of_fp32_groups
    for flat in flats:
        state = zero.optimizer.state[flat]
        state["step"] = step.clone() if torch.is_tensor(step) else step
        for field in ZERO_STATE_FIELDS:
            state[field] = torch.zeros_like(flat)
    if hasattr(zero, "_hp_optimizer_states_linked"):  # ZeRO-1/2 link fragments lazily
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()
    for name, param in trained:
        saved = moments[name]
        for field in ZERO_STATE_FIELDS:
            safe_set_full_optimizer_state(param, saved[field].to(torch.float32), field)


def like(target: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """`whole` laid out as `target` is: this rank's part where `target` is split (a DTensor), else as is.
    Every rank holds `whole`, so each cuts its own part without communicating. A 0-d value (Adam's step
    count) stays plain."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(target, DTensor) or whole.dim() == 0:
        return whole
    return distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None)


def _check_covered(covered: int, trained: int) -> None:
    if covered != trained:
        raise UserError(f"optimizer state covers {covered} of {trained} trained parameters")
