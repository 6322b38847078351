"""The model being trained: loading it with its adapters (load), what the launch checks learn from its
config in one read (facts), what ftkit knows of a mixture of experts (moe: routing, expert tensors,
active FLOPs, trained parts), QLoRA's 4-bit base (quant), tensor-parallel plans (tensor_parallel), optional
speed features (speed) and the FLOPs count behind MFU (flops)."""
