"""The model being trained: loading it with its adapters (load), what the launch checks learn from its
config in one read (facts), QLoRA's 4-bit base (quant), tensor-parallel plans (tensor_parallel), optional
speed features (speed) and the FLOPs count behind MFU (flops)."""
