"""FSDP1/FSDP2 launches: the settings accelerate passes on, and FSDP on gloo CPU processes, which accelerate
does not switch on by itself."""

from __future__ import annotations

import torch
from accelerate.state import PartialState
from accelerate.utils import DistributedType

# FSDP settings the launch checks read: env variable `accelerate launch` sets -> YAML key without fsdp_.
FSDP_SETTINGS_ENV = {
    "FSDP_OFFLOAD_PARAMS": "offload_params",
    "FSDP_TRANSFORMER_CLS_TO_WRAP": "transformer_layer_cls_to_wrap",
    "FSDP_STATE_DICT_TYPE": "state_dict_type",
    "FSDP_USE_ORIG_PARAMS": "use_orig_params",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "cpu_ram_efficient_loading",
}


def cpu_fsdp_plugin(version: int):
    """FSDP settings from the launch, minus the two that need a GPU to move meta weights onto (FSDP2 has
    no sync_module_states, and accelerate warns when it is given).

    FSDP1 checkpoints are sharded on CPU: gathering a FULL_STATE_DICT onto rank 0 over gloo crashes it
    (SIGSEGV) inside torch, and ftkit's export gathers the full model from sharded checkpoints itself."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    v1 = {"sync_module_states": False, "state_dict_type": "SHARDED_STATE_DICT"} if version == 1 else {}
    return FullyShardedDataParallelPlugin(cpu_ram_efficient_loading=False, **v1)


def switch_on_cpu_fsdp(accelerator, version: int) -> None:
    """Turn the plain gloo processes accelerate set up for lack of a GPU into FSDP `version`."""
    if accelerator.distributed_type != DistributedType.MULTI_CPU:
        return
    state = accelerator.state
    plugin = cpu_fsdp_plugin(version)
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    # Every later AcceleratorState() copies PartialState's fields over its own.
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    if version == 1:
        # FSDP1 computes on `cpu` and refuses accelerate's `cpu:0` as a different device.
        state.device = PartialState._shared_state["device"] = torch.device("cpu")
