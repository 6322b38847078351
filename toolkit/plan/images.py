"""A vision-language model's images in `ftkit plan`: the tower's and the projector's parameters, the image
tokens a row holds, and what a micro-batch's images hold on a GPU.

The language model is planned as a text model. Its rows of --seq-len tokens hold the image tokens, as
data.max_length does (the data drops a row longer than that once its images are expanded), so images add
nothing to the language model's activations; they add:

- the tower's and the projector's weights (`VisionCounts`, exact, from the model built on the meta device):
  frozen by default, in the weights' dtype (QLoRA quantizes only the language model); what vision.train_tower
  and vision.train_projector train gets adapters (LoRA; the projector a whole trainable copy) or its own
  gradients and optimizer states (full), as the model states of every other trained weight;
- per micro-batch, for its p patches (the tower's tokens) and t image tokens, e bytes an activation:

      pixel values          p x 3 x frames x patch^2 x 4   fp32 as the processor makes them, held all step
      trained tower blocks  k x (a layer's bytes) x p      the decoder-layer formula of
                                                           `memory.activation_bytes` over the tower's widths
                                                           (each block's input only, under checkpointing); k
                                                           counts the blocks from the first trained one on
      trained projector     t x (4 + 4e) x w               its input, fp32 and normalised copies, its hidden
                                                           layer and activation, w its input width a token

  These are kept from the forward until the backward, so they add to the language model's peak.
- the tower's own peak: a frozen tower keeps nothing for backward (no input or weight of it needs a gradient,
  so autograd records none of its operations): each block's activations over all p patches live only while
  that block runs, before the language model's forward (a checkpointed trained block's recompute: after its
  backward). That meets none of the language model's activations: the micro-batch's peak is the larger of
  the language model's (with the kept bytes above) and the kept bytes plus one block's activations.
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.errors import UserError
from toolkit.model import vision
from toolkit.plan import memory
from toolkit.plan.footprint import NO_IMAGES, ImageBytes
from toolkit.plan.memory import Precision

CHANNELS = 3
"""Images are read as RGB."""
PIXEL_BYTES = 4
"""Processors return pixel values in fp32."""
TILED = ("llava_next", "idefics3", "smolvlm")
"""Families that cut an image into a grid of tiles of their own choosing: the plan does not count them."""
GEMMA4_SOFT_TOKENS = 280
"""Gemma-4's image budget: its processor's soft tokens an image (transformers' and the hub's default)."""


@dataclass(frozen=True)
class VisionCounts:
    """A vision-language model's tower and projector: parameters (adapters and trainable copies included)
    and the shapes the image estimates read."""

    tower: int
    tower_trainable: int
    projector: int
    projector_trainable: int
    persistent: int
    """Of the tower's and projector's parameters, those ZeRO-3 keeps whole on every rank (as
    `ModelCounts.zero3_persistent`)."""
    blocks: int
    """The tower's repeated blocks."""
    kept_blocks: int
    """Blocks whose activations are kept for backward: from the first trained one to the last (0: frozen)."""
    hidden: int
    intermediate: int
    heads: int
    patch: int
    """Side of a patch in pixels."""
    merge: int
    """Patches merged into one image token along each side (Qwen's and Mistral's spatial merge; else 1)."""
    frames: int
    """Frames a still image is repeated into (Qwen: its temporal patch)."""
    resolution: str
    """dynamic: image tokens follow the pixels; fixed: every image is resized to one size; tiled: cut into
    tiles (not counted)."""
    fixed_tokens: int = 0
    """Image tokens of every image (fixed resolution)."""
    fixed_patches: int = 0
    """Patches of every image (fixed resolution)."""


@dataclass(frozen=True)
class ImageRows:
    """The images each row of a plan holds."""

    images: int
    """Images per row."""
    tokens: int
    """Image tokens each image puts in the language model's row."""
    patches: int
    """Patches the tower reads of each image."""
    max_pixels: int | None
    """Pixels each image is scaled down to first (None: as large as the row allows)."""


@dataclass(frozen=True)
class _TowerLayer:
    """A tower block's widths, as `memory.token_activation_bytes` reads a decoder layer's."""

    hidden: int
    heads: int
    head_dim: int
    intermediate: int
    method: str
    experts: int = 0
    experts_per_token: int = 0


def count_vision(model, config, small: int) -> VisionCounts:
    """The tower's and projector's counts on `model` (built on meta, its trained parameters chosen); a
    parameter of at most `small` elements is ZeRO-3 persistent."""
    trained = vision.trained_by_part(model)
    persistent = sum(
        p.numel()
        for name, p in model.named_parameters()
        if vision.part_of(name) != "language model" and p.numel() <= small
    )
    v = config.vision_config
    # Qwen2-VL names its tower's width embed_dim (its hidden_size is the projector's output) and gives its
    # MLP as a ratio.
    hidden = getattr(v, "embed_dim", None) or v.hidden_size
    merge = getattr(v, "spatial_merge_size", None) or getattr(config, "spatial_merge_size", None) or 1
    blocks = vision.tower_blocks(model)
    return VisionCounts(
        tower=trained["tower"][1],
        tower_trainable=trained["tower"][0],
        projector=trained["projector"][1],
        projector_trainable=trained["projector"][0],
        persistent=persistent,
        blocks=len(blocks),
        kept_blocks=_kept_blocks(model, blocks),
        hidden=hidden,
        intermediate=getattr(v, "intermediate_size", None) or int(v.mlp_ratio * hidden),
        heads=getattr(v, "num_heads", None) or v.num_attention_heads,
        patch=v.patch_size,
        merge=merge,
        frames=getattr(v, "temporal_patch_size", None) or 1,
        **_resolution(config, v.patch_size, merge),
    )


def _kept_blocks(model, blocks: list[str]) -> int:
    """Blocks from the first with a trained parameter to the last: autograd records from there on."""
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    for index, block in enumerate(blocks):
        if any(vision.in_blocks(name, [block]) for name in trained):
            return len(blocks) - index
    return 0


def _resolution(config, patch: int, merge: int) -> dict:
    """How a family sizes an image's tokens and patches (`VisionCounts.resolution`)."""
    kind = config.model_type
    if kind in TILED:
        return {"resolution": "tiled"}
    if merge > 1:
        return {"resolution": "dynamic"}
    if kind == "gemma4":
        # Up to the budget's tokens an image, each pooled from k x k patches; every image is padded to the
        # budget's patches, which the tower runs on.
        pool = config.vision_config.pooling_kernel_size
        return {
            "resolution": "fixed",
            "fixed_tokens": GEMMA4_SOFT_TOKENS,
            "fixed_patches": GEMMA4_SOFT_TOKENS * pool**2,
        }
    patches = (config.vision_config.image_size // patch) ** 2
    # Gemma-3 pools its patches into a fixed number of tokens; Llava passes every patch on.
    tokens = config.mm_tokens_per_image if kind == "gemma3" else patches
    return {"resolution": "fixed", "fixed_tokens": tokens, "fixed_patches": patches}


def image_rows(v: VisionCounts, kind: str, images: int, max_pixels: int | None, seq_len: int) -> ImageRows:
    """What each `seq_len`-token row's `images` images hold at `max_pixels` pixels each (a `kind` model)."""
    if images == 0:
        return ImageRows(0, 0, 0, max_pixels)
    if v.resolution == "tiled":
        raise UserError(
            f"--images-per-row: ftkit plan does not count {vision.FAMILIES[kind]}'s image tiles yet; "
            "--images-per-row 0 plans its weights without images"
        )
    if v.resolution == "fixed":
        return ImageRows(images, v.fixed_tokens, v.fixed_patches, max_pixels)
    unit = v.patch * v.merge
    tokens = max(max_pixels // unit**2, 1) if max_pixels else seq_len // images
    return ImageRows(images, tokens, tokens * v.merge**2, max_pixels)


def check_row(rows: ImageRows, seq_len: int) -> None:
    """A row's image tokens fit in its `seq_len` tokens: the data drops a row longer than data.max_length
    once its images are expanded."""
    if rows.images * rows.tokens > seq_len:
        raise UserError(
            f"--images-per-row {rows.images} x {rows.tokens:,} image tokens exceed --seq-len {seq_len}: the "
            "data drops such rows (fewer images, a smaller --max-pixels or a longer --seq-len)"
        )


def micro_batch_bytes(
    v: VisionCounts,
    rows: ImageRows,
    sequences: int,
    method: str,
    precision: Precision,
    checkpointing: bool,
    lora_dropout: float = 0.0,
) -> ImageBytes:
    """What the images of a micro-batch of `sequences` rows hold on a GPU (the module docstring's model)."""
    patches = rows.images * rows.patches * sequences
    if patches == 0:
        return NO_IMAGES
    e = memory.compute_bytes(precision)
    shape = _TowerLayer(v.hidden, v.heads, v.hidden // v.heads, v.intermediate, method)
    layer, kept_input, _ = memory.token_activation_bytes(shape, precision, lora_dropout)
    pixels = patches * CHANNELS * v.frames * v.patch**2 * PIXEL_BYTES
    tower = v.kept_blocks * (kept_input if checkpointing else layer) * patches
    tokens = rows.images * rows.tokens * sequences
    projector = tokens * (4 + 4 * e) * v.hidden * v.merge**2 if v.projector_trainable else 0
    kept = pixels + tower + projector
    return ImageBytes(kept=kept, peak=kept + layer * patches)
