"""Optional speed features: each is asked for in the config and used where this machine has it; where it does
not, the run goes on without it and says so in one line.

    model.attn_implementation: flash_attention_2   CUDA and the flash-attn package, else sdpa
    model.attn_implementation: sdpa                 eager for a model whose attention torch's SDPA cannot run
                                                    (gpt-oss's sinks, Gemma-2's soft-capping)
    model.liger_kernels: true                      Liger's RMSNorm, RoPE, SwiGLU kernels: CUDA + liger-kernel
    model.compile: true                            torch.compile of the model's forward (in place)
    train.fused_adamw: auto | true | false         torch's fused AdamW kernel, CUDA only; auto: where it can
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from toolkit.config import ModelConfig, TrainConfig


@dataclass(frozen=True)
class SpeedFeatures:
    """What this run will really use, and a note for each request it cannot honour."""

    attention: str
    liger: bool
    compile: bool
    fused_adamw: bool
    notes: list[str] = field(default_factory=list)


def resolve(
    model: ModelConfig,
    train: TrainConfig,
    device: torch.device,
    installed: Callable[[str], bool] | None = None,
    has_compiler: Callable[[], bool] | None = None,
    kernels: frozenset[str] | None = None,
) -> SpeedFeatures:
    """Match the config's speed requests against the device, the installed packages and the attention
    `kernels` the model takes (`ModelFacts.attention_kernels`; None: not known, the request stands)."""
    installed = installed or _installed
    has_compiler = has_compiler or can_compile
    cuda = device.type == "cuda"
    notes = []

    attention = model.attn_implementation
    if attention == "flash_attention_2" and not (cuda and installed("flash_attn")):
        need = "a CUDA GPU" if not cuda else "the flash-attn package (pip install flash-attn)"
        notes.append(f"model.attn_implementation: flash_attention_2 needs {need}; using sdpa")
        attention = "sdpa"
    if kernels is not None and attention not in kernels:
        notes.append(f"model.attn_implementation: {model.path} does not take {attention}; using eager")
        attention = "eager"

    liger = model.liger_kernels
    if liger and not (cuda and installed("liger_kernel")):
        need = "a CUDA GPU" if not cuda else "the liger-kernel package (pip install liger-kernel)"
        notes.append(f"model.liger_kernels: needs {need}; running without")
        liger = False

    compile_model = model.compile
    if compile_model and not has_compiler():
        notes.append("model.compile: torch.compile needs a C++ compiler on this machine; running uncompiled")
        compile_model = False

    fused = train.fused_adamw in ("auto", True) and cuda
    if train.fused_adamw is True and not cuda:
        notes.append("train.fused_adamw: the fused kernel needs a CUDA GPU; using the default AdamW")
    return SpeedFeatures(attention, liger, compile_model, fused, notes)


def apply_liger(model) -> None:
    """Swap in Liger's kernels for the model's norms, rotary embedding and MLP (before any adapter wrap).

    The loss stays ours (token-exact across micro-batches), so Liger's fused loss kernels are left off.
    """
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(
        model=model,
        rope=True,
        rms_norm=True,
        swiglu=True,
        cross_entropy=False,
        fused_linear_cross_entropy=False,
    )


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def can_compile() -> bool:
    """Whether torch.compile can build kernels here: Inductor needs a C++ compiler on CPU, Triton on CUDA."""
    if torch.cuda.is_available():
        return _installed("triton")
    return any(shutil.which(name) for name in ("c++", "g++", "clang++"))
