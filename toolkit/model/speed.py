"""Optional speed features: each is asked for in the config and used where this machine has it; where it does
not, the run goes on without it and says so in one line.

    model.attn_implementation: auto                 flex_attention for packed rows on CUDA (each example
                                                    attends to itself through a block mask, at fused-kernel
                                                    speed, without flash-attn); sdpa otherwise
    model.attn_implementation: flash_attention_2   CUDA and the flash-attn package, else sdpa
    model.attn_implementation: flex_attention      CUDA (torch has no CPU backward for it), else sdpa
    model.attn_implementation: sdpa                 eager for a model whose attention torch's SDPA cannot run
                                                    (gpt-oss's sinks, Gemma-2's soft-capping)
    model.liger_kernels: true                      Liger's RMSNorm, RoPE, SwiGLU kernels: CUDA + liger-kernel
    model.compile: auto | true | false             torch.compile of each decoder block (see compile_blocks);
                                                    auto: on CUDA, in the layouts it is proven in
    train.fused_adamw: auto | true | false         torch's fused AdamW kernel, CUDA only; auto: where it can
"""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import threading
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
    packing: bool = False,
    compile_proven: bool = True,
) -> SpeedFeatures:
    """Match the config's speed requests against the device, the installed packages and the attention
    `kernels` the model takes (`ModelFacts.attention_kernels`; None: not known, the request stands).
    `packing`: the rows are packed (auto attention keeps their examples apart with flex_attention on CUDA);
    `compile_proven`: the launch's layout is one auto compile is proven in (`compile_proven_for`)."""
    installed = installed or _installed
    has_compiler = has_compiler or can_compile
    cuda = device.type == "cuda"
    notes = []

    attention = model.attn_implementation
    if attention == "auto":
        flex = cuda and packing and (kernels is None or "flex_attention" in kernels)
        attention = "flex_attention" if flex else "sdpa"
    if attention == "flex_attention" and not cuda:
        notes.append("model.attn_implementation: flex_attention trains on a CUDA GPU only; using sdpa")
        attention = "sdpa"
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
    if compile_model == "auto":
        compile_model = cuda and compile_proven and model.method != "qlora"
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


def resolve_for_run(cfg, launch, device: torch.device, kernels: frozenset[str] | None) -> SpeedFeatures:
    """`resolve` for a recipe's config (`cfg`) on a launch (`launch.Launch`): packed rows where it packs or
    streams, auto compile kept to the layouts it is proven in."""
    return resolve(
        cfg.model,
        cfg.train,
        device,
        kernels=kernels,
        packing=cfg.data.packing or cfg.data.streaming,
        compile_proven=compile_proven_for(launch.backend, launch.uses_mesh),
    )


def compile_proven_for(backend: str, uses_mesh: bool) -> bool:
    """Whether `model.compile: auto` compiles on this launch: where it is proven (one process, DDP, FSDP);
    DeepSpeed's hooks, pipeline stages and model-parallel meshes keep the eager forward unless the config
    asks for compile itself."""
    return backend in ("single", "ddp", "fsdp") and not uses_mesh


def compile_blocks(model) -> int:
    """Compile, in place, every repeated block of the model (its decoder layers, and a vision tower's), the
    number compiled. Every block of a class runs the same compiled code (dynamo reuses one graph for them),
    so the first step compiles one block, not the whole model: seconds, not minutes. The shapes are dynamic
    from the start, so packed rows of a new width reuse the graph (a batch of one row is specialised and
    compiles once more; the training loader drops short remainders, so training keeps its batch size).
    Outside the blocks (embeddings, the loss head with its data-dependent token selection) the model runs
    eagerly.

    The model's own KV cache is switched off for training: a cache object that fills layer by layer
    changes what each compiled block sees, which recompiles it per layer. Under an adapter the embeddings
    are frozen, so the first block's input would not require grad and the first block would need a graph
    of its own; its input is made to require one (one extra product in that block's backward)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    # Float arguments (attention's scale) are the model's constants: traced as dynamic, they restart the
    # first compilation once to specialise them.
    torch._dynamo.config.specialize_float = True
    for block in blocks:
        block.compile(dynamic=True)
    base.config.use_cache = False
    if blocks and not base.get_input_embeddings().weight.requires_grad:
        model.enable_input_require_grads()
    return len(blocks)


class _SharedStance:
    """A compiler stance that threads may hold at once: torch's stance is one for the whole process, so the
    first thread in sets it and the last one out puts back what was there before. Each setting and undoing
    its own, one thread could undo another's and leave the stance set for good."""

    def __init__(self, stance: str):
        self.stance, self.lock, self.inside, self.undo = stance, threading.Lock(), 0, None

    @contextlib.contextmanager
    def held(self):
        with self.lock:
            if self.inside == 0:
                self.undo = torch.compiler.set_stance(self.stance)
            self.inside += 1
        try:
            yield
        finally:
            with self.lock:
                self.inside -= 1
                if self.inside == 0:
                    self.undo.__exit__(None, None, None)


_EAGER = _SharedStance("force_eager")


def eager_blocks():
    """Around generation: compiled blocks run their eager code, since decoding one token at a time against
    a growing cache would recompile them (and the training graphs stay as they are). Threads inside at once
    (conversations answered concurrently with the model, as the engine's stand-in in the unit tests does)
    share one setting (`_SharedStance`)."""
    return _EAGER.held()


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def can_compile() -> bool:
    """Whether torch.compile can build kernels here: Inductor needs a C++ compiler on CPU, Triton on CUDA."""
    if torch.cuda.is_available():
        return _installed("triton")
    return any(shutil.which(name) for name in ("c++", "g++", "clang++"))
