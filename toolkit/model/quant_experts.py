"""QLoRA's routed experts in 4-bit. Bitsandbytes quantizes `nn.Linear` only, and transformers stores a
layer's routed experts fused, as 3-D tensors: left alone they would keep nearly all of a mixture of experts
in 16-bit. Here each fused tensor is stored as NF4 (blocks of 64 weights, one float32 scale each, never
straddling two experts where an expert's size is a multiple of 64) through a torch parametrization: reading
`experts.gate_up_proj` dequantizes that one tensor, so a forward holds one layer's experts at full width at
a time, never the model's. PEFT's parameter targeting stacks its LoRA term on top, so the adapter's names
and files are those of LoRA on the unquantized model."""

from __future__ import annotations

import contextlib

import torch
from peft.tuners.lora.layer import ParamWrapper
from torch import nn
from torch.nn.utils import parametrize

from toolkit.model import moe, quant
from toolkit.model.quant import BLOCK, PACKED_EXPERTS


class PackedExperts(nn.Module):
    """The parametrization of one fused experts tensor: it stores the NF4 codes (two a byte) followed by
    the float32 block scales, viewed as `storage` (the dtype a backend casts parameters to, so the cast
    leaves the bits alone and FSDP2 shards them with the rest); reading the tensor dequantizes it."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype, storage: torch.dtype):
        super().__init__()
        self.shape, self.dtype, self.storage = torch.Size(shape), dtype, storage
        self.codes = self.shape.numel() // 2
        self.blocks = -(-self.shape.numel() // BLOCK)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight` as NF4 codes and block scales, in `storage`."""
        from bitsandbytes.functional import quantize_4bit

        packed, state = quantize_4bit(
            weight.detach().contiguous(), blocksize=BLOCK, compress_statistics=False, quant_type="nf4"
        )
        raw = torch.cat([packed.flatten(), state.absmax.float().view(torch.uint8)])
        width = torch.finfo(self.storage).bits // 8
        raw = torch.cat([raw, raw.new_zeros(-raw.numel() % width)])
        return raw.view(self.storage)

    def forward(self, stored: torch.Tensor) -> torch.Tensor:
        from bitsandbytes.functional import QuantState, dequantize_4bit, get_4bit_type

        raw = stored.contiguous().view(torch.uint8)
        codes = raw[: self.codes].view(-1, 1)
        scales = raw[self.codes : self.codes + 4 * self.blocks].view(torch.float32)
        state = QuantState(
            absmax=scales,
            shape=self.shape,
            code=get_4bit_type("nf4", device=stored.device),
            blocksize=BLOCK,
            quant_type="nf4",
            dtype=self.dtype,
        )
        return dequantize_4bit(codes, state)


def quantize(model, storage: torch.dtype, device: torch.device | None = None) -> int:
    """Store every fused routed-experts tensor of `model` in 4-bit (frozen), on `device` (None: where it
    is); the bytes they now take. Under ZeRO-3 each tensor is gathered while it is quantized (then
    DeepSpeed partitions the packed one)."""
    stored = 0
    for module in list(model.modules()):
        for name, param in list(module.named_parameters(recurse=False)):
            if not moe.is_routed_expert(param, module) or hasattr(param, "expert_shape"):
                continue
            with _gathered(param):
                packing = PackedExperts(param.shape, param.dtype, storage)
                packed = packing.pack(param).to(device or param.device)
                param.data = packed.new_empty(0)
            _attach(module, name, packing, param, packed)
            stored += packed.numel() * packed.element_size()
    return stored


def _attach(module, name: str, packing: PackedExperts, param: nn.Parameter, packed: torch.Tensor) -> None:
    """Make `param` (of `storage` dtype) hold `packed` as `module.<name>`'s parametrized stored tensor."""
    # torch's registration keeps the stored tensor's dtype and object, and sets it to what right_inverse gives
    packing.right_inverse = lambda _: packed
    module._parameters[name] = param
    parametrize.register_parametrization(module, name, packing, unsafe=True)
    del packing.right_inverse
    param.requires_grad_(False)
    param.expert_shape = packing.shape  # what the plan and peft's targets read (see moe.full_shape)


@contextlib.contextmanager
def unquantized_look(model):
    """Inside, each 4-bit experts tensor is a plain parameter of its full shape (a zero-sized broadcast, no
    memory): peft then wraps the experts as on the unquantized model, in the same nesting under the same
    names (it nests parametrized tensors in another order), so the adapter is plain LoRA's."""
    held = []
    for module in list(model.modules()):
        for name, packing in _packings(module):
            stored = module.parametrizations[name].original
            parametrize.remove_parametrizations(module, name, leave_parametrized=False)
            look = torch.zeros((), dtype=packing.dtype, device=stored.device).expand(packing.shape)
            module._parameters[name] = nn.Parameter(look, requires_grad=False)
            held.append((module, name, packing, stored))
    try:
        yield
    finally:
        for module, name, packing, stored in held:
            _attach(module, name, packing, stored, stored.detach())


def _packings(module) -> list[tuple[str, PackedExperts]]:
    stacks = getattr(module, "parametrizations", {})
    return [(name, stack[0]) for name, stack in stacks.items() if isinstance(stack[0], PackedExperts)]


def stored_bytes(model) -> int:
    """Bytes the 4-bit experts of `model` take, whole (ZeRO-3's partitioned ones at their full size)."""
    return sum(
        getattr(p, "ds_numel", p.numel()) * p.element_size()
        for name, p in model.named_parameters()
        if quant.is_packed_experts(name)
    )


def round_trip(model) -> None:
    """Replace each fused experts tensor by its 4-bit round trip, in place: the weights QLoRA trained
    through, at full width (to merge an adapter into what training saw)."""
    for module in model.modules():
        for param in list(module.parameters(recurse=False)):
            if moe.is_routed_expert(param, module):
                packing = PackedExperts(param.shape, param.dtype, torch.float32)
                with torch.no_grad():
                    param.copy_(packing(packing.pack(param)))


@contextlib.contextmanager
def hidden_from_peft(model):
    """Keep the packed experts out of `model.parameters()` for a while: peft's k-bit preparation upcasts
    every 16-bit parameter to float32, which would turn their bit patterns into other numbers."""
    held = [
        (owner, owner._parameters.pop(PACKED_EXPERTS))
        for owner in model.modules()
        if isinstance(owner, parametrize.ParametrizationList) and isinstance(owner[0], PackedExperts)
    ]
    try:
        yield
    finally:
        for owner, packed in held:
            owner._parameters[PACKED_EXPERTS] = packed


def peft_wrappers_stack(model) -> None:
    """Let peft's LoRA term sit on top of the 4-bit parametrization: peft removes its own term after each
    forward by type, and misses its factored one when another parametrization sits below it (it would
    then add the LoRA term once more at every forward). Its wrappers of packed tensors remove the top one."""
    for module in model.modules():
        packed = dict(_packings(module.get_base_layer())) if isinstance(module, ParamWrapper) else {}
        if type(module) is ParamWrapper and module.parameter_name in packed:
            module.__class__ = StackedParamWrapper


class StackedParamWrapper(ParamWrapper):
    """peft's wrapper of a targeted parameter, over a parametrized (4-bit) one: after the forward it
    removes the parametrization it added, the top one."""

    @contextlib.contextmanager
    def _activate_lora(self, active_adapters):
        with super()._activate_lora(active_adapters):
            # Adding to a parametrized tensor reads it once; inside an outer wrapper's cache (a layer's
            # second targeted tensor) that read is kept, and this wrapper's LoRA term would be left out.
            parametrize._cache.pop((id(self.get_base_layer()), self.parameter_name), None)
            yield

    def _remove_parametrizations(self):
        del self.get_base_layer().parametrizations[self.parameter_name][-1]


@contextlib.contextmanager
def _gathered(param):
    """The whole of `param` inside, where ZeRO-3 has partitioned it; a no-op elsewhere."""
    if hasattr(param, "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([param]):
            yield
    else:
        yield
