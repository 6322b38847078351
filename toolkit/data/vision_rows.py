"""Rows with images, for a vision-language model: encoded through its processor, batched with their pixels.

Encoding renders a conversation through the chat template (each image a placeholder), locates the
assistant turns by character as for text (`chat.assistant_spans`), and then lets the processor expand each
placeholder into the image's tokens. The trained tokens are carried over from the plain tokenization to the
expanded one by matching the two token sequences, and checked to be the same tokens: the expansion only
ever touches the prompt, so a row whose assistant tokens changed is refused rather than trained wrongly.

Rows keep their image references, not pixels: the collator opens and processes a batch's images as it is
served, so the cache stays small and memory holds one batch of pixels.
"""

from __future__ import annotations

from dataclasses import dataclass
from difflib import SequenceMatcher
from pathlib import Path

import torch
from PIL import Image

from toolkit.data.chat import assistant_spans, check_prefix_stable, render
from toolkit.data.collate import Collator
from toolkit.data.encode import IGNORE, ChunkEncoder, _mask
from toolkit.data.formats import to_example
from toolkit.data.images import open_image, resolve_image
from toolkit.data.sources import Chunk
from toolkit.errors import UserError

# Families whose processor lays a row's images out as [rows, images, ...] (padded), not one after another.
PER_ROW_PIXELS = ("idefics3", "smolvlm")
# Per-token ids some families' forward reads beside input_ids (1 at image tokens).
TOKEN_TYPE_KEYS = {
    "gemma3": "token_type_ids",
    "gemma4": "mm_token_type_ids",
    "qwen2_vl": "mm_token_type_ids",
    "qwen2_5_vl": "mm_token_type_ids",
    "qwen3_vl": "mm_token_type_ids",
    "qwen3_5": "mm_token_type_ids",
    "qwen3_5_moe": "mm_token_type_ids",
}
BLANK_SIDE = 32
"""The stand-in image of a batch without images is this many pixels square (the processor resizes it)."""
SMALLEST = {"gemma4": {"max_soft_tokens": 70}}
"""Image-processor settings that keep the stand-in image small where the family resizes every image up to its
budget (Gemma-4: 280 soft tokens by default, 70 at least)."""


@dataclass
class ImageInputs:
    """A vision-language model's processor as the data needs it: token expansion and pixel tensors."""

    processor: object
    kind: str
    """The model's model_type."""
    image_id: int
    """The token each image's features replace."""
    max_pixels: int | None

    def open(self, refs: list[str], where: str) -> list[Image.Image]:
        return [open_image(ref, where, self.max_pixels) for ref in refs]

    def expanded_ids(self, text: str, images: list[Image.Image], **settings) -> list[int]:
        """Token ids of rendered `text` with every image placeholder expanded into its image's tokens
        (`settings`: the image processor's, for this call)."""
        encoded = self.processor(
            text=[text],
            images=[images] if images else None,
            add_special_tokens=False,
            return_tensors=None,
            **settings,
        )
        return list(encoded["input_ids"][0])

    def pixels(self, per_row: list[list[Image.Image]], **settings) -> dict[str, torch.Tensor]:
        """The model's image inputs for a batch whose rows hold these images (rows may hold none)."""
        image_processor = self.processor.image_processor
        if self.kind in PER_ROW_PIXELS:
            parts = [image_processor(images=[row], return_tensors="pt") for row in per_row if row]
            return _padded_rows(parts, [len(row) > 0 for row in per_row])
        flat = [image for row in per_row for image in row]
        if not flat:
            return {}
        # What the processor computes for its own token expansion only (Gemma-4's soft-token counts).
        unused = getattr(self.processor, "unused_input_names", None) or ()
        encoded = image_processor(images=flat, return_tensors="pt", **settings)
        return {key: value for key, value in encoded.items() if key not in unused}

    def token_types(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The per-token ids this family's forward reads beside `input_ids` (none for most families)."""
        key = TOKEN_TYPE_KEYS.get(self.kind)
        return {key: (input_ids == self.image_id).long()} if key else {}

    def prompt_inputs(self, ids: list[int], refs: list[str], where: str) -> dict[str, torch.Tensor]:
        """A prompt's image inputs for generation: the pixels of the images at `refs`, and the token ids its
        forward reads as in training (Qwen's image positions, Gemma's attention within an image follow
        them)."""
        return {**self.pixels([self.open(refs, where)]), **self.token_types(torch.tensor([ids]))}

    def prompt(self, text: str, refs: list[str], where: str) -> tuple[list[int], dict]:
        """(prompt ids, image inputs) of a one-turn user question about the images at `refs`."""
        content = [*({"type": "image"} for _ in refs), {"type": "text", "text": text}]
        rendered = render(self.processor.tokenizer, [{"role": "user", "content": content}], where, True)
        ids = self.expanded_ids(rendered, self.open(refs, where))
        return ids, self.prompt_inputs(ids, refs, where)

    def stand_in(self) -> tuple[list[int], dict[str, torch.Tensor]]:
        """(token ids, image inputs) of a one-image user turn on a blank image: appended, masked, to a batch
        without images, so the tower runs on every rank for every batch (sharded backends gather its
        weights collectively) while nothing of it reaches the loss."""
        blank = Image.new("RGB", (BLANK_SIDE, BLANK_SIDE))
        text = render(self.processor.tokenizer, [{"role": "user", "content": [{"type": "image"}]}], "")
        settings = SMALLEST.get(self.kind, {})
        return self.expanded_ids(text, [blank], **settings), self.pixels([[blank]], **settings)


def image_fingerprint(inputs: ImageInputs) -> list:
    """What about the images changes encoded rows (part of the cache key)."""
    return [inputs.kind, inputs.max_pixels, inputs.processor.image_processor.to_json_string()]


def _padded_rows(parts: list[dict], has_images: list[bool]) -> dict[str, torch.Tensor]:
    """Per-row [1, images, ...] tensors stacked into [rows, most images, ...], zero-padded (an all-zero
    image is what these models skip); a row without images gets zeros only."""
    if not parts:
        return {}
    out = {}
    for key in parts[0]:
        tensors = [p[key] for p in parts]
        most = max(t.shape[1] for t in tensors)
        shape = (len(has_images), most, *tensors[0].shape[2:])
        stacked = torch.zeros(shape, dtype=tensors[0].dtype)
        rows = iter(tensors)
        for i, present in enumerate(has_images):
            if present:
                tensor = next(rows)[0]
                stacked[i, : tensor.shape[0]] = tensor
        out[key] = stacked
    return out


def as_parts(messages: list[dict]) -> list[dict]:
    """Every message's content as a list of parts, the form vision-language chat templates read."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            message = {**message, "content": [{"type": "text", "text": content}] if content else []}
        out.append(message)
    return out


def carry_labels(ids: list[int], labels: list[int], expanded: list[int], where: str) -> list[int]:
    """`labels` (over `ids`) moved onto `expanded`, the same text with its images expanded."""
    out = [IGNORE] * len(expanded)
    for a, b, size in SequenceMatcher(None, ids, expanded, autojunk=False).get_matching_blocks():
        out[b : b + size] = labels[a : a + size]
    if [t for t in out if t != IGNORE] != [t for t in labels if t != IGNORE]:
        raise UserError(
            f"{where}: expanding the images changed the tokens of an assistant turn; put images in user turns"
        )
    return out


def source_folder(name: str) -> Path | None:
    """The folder a local data file's relative image paths start from (None for a hub dataset)."""
    path = Path(name).expanduser()
    return path.resolve().parent if path.is_file() else None


@dataclass
class VisionEncoder(ChunkEncoder):
    """ChunkEncoder for a vision-language model: rows get `images` (resolved references) beside
    `input_ids` and `labels`. A row longer than max_length once its images are expanded is dropped and
    counted, never cut through an image."""

    inputs: ImageInputs | None = None

    def __call__(self, chunk: Chunk) -> tuple[dict[str, list], dict[str, int]]:
        if self.assistant_only_loss:
            check_prefix_stable(self.tokenizer)
        folder = source_folder(chunk.name)
        columns = {"input_ids": [], "labels": [], "images": []}
        dropped = 0
        for i, record in enumerate(chunk.records()):
            row = self._row(record, folder, chunk.where(i))
            if row is None:
                dropped += 1
                continue
            for key, value in row.items():
                columns[key].append(value)
        return columns, {"truncated": 0, "dropped": dropped}

    def _row(self, record: dict, folder: Path | None, where: str) -> dict | None:
        example = to_example(record, self.fmt, where)
        if "text" in example:
            raise UserError(f"{where}: plain text rows do not train a vision-language model; use chat rows")
        refs = [resolve_image(ref, folder, where) for ref in example.get("images") or []]
        messages = as_parts(example["messages"])
        if not messages:
            return None
        tools = example["tools"]
        if self.assistant_only_loss:
            text, spans = assistant_spans(
                self.tokenizer, messages, where, tools=tools, train_reasoning=self.train_reasoning
            )
        else:
            text, spans = render(self.tokenizer, messages, where, tools=tools), None
        plain = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=spans is not None)
        ids = plain["input_ids"]
        labels = _mask(ids, plain["offset_mapping"], spans) if spans is not None else list(ids)
        expanded = self.inputs.expanded_ids(text, self.inputs.open(refs, where))
        labels = carry_labels(ids, labels, expanded, where)
        if len(expanded) > self.max_length or all(label == IGNORE for label in labels):
            return None
        return {"input_ids": expanded, "labels": labels, "images": refs}


class VisionCollator(Collator):
    """Pads rows as `Collator` does and adds the image inputs of the rows' images, opened and processed
    here; a batch without any image gets the masked stand-in image (`ImageInputs.stand_in`)."""

    def __init__(self, pad_id: int, inputs: ImageInputs, multiple: int = 8):
        super().__init__(pad_id, multiple)
        self.inputs = inputs
        self._stand_in = None

    def __call__(self, rows: list[dict]) -> dict:
        images = [self.inputs.open(row.get("images") or [], "a training row") for row in rows]
        if not any(images):
            if self._stand_in is None:
                self._stand_in = self.inputs.stand_in()
            ids, pixels = self._stand_in
            rows = [{**rows[0], "stand_in": ids}, *rows[1:]]
        else:
            pixels = self.inputs.pixels(images)
        batch = super().__call__([_with_stand_in(row, self.pad_id) for row in rows])
        if "stand_in" in rows[0]:
            width = len(rows[0]["input_ids"]) + len(rows[0]["stand_in"])
            batch["attention_mask"][0, len(rows[0]["input_ids"]) : width] = 0
        batch.update(pixels)
        batch.update(self.inputs.token_types(batch["input_ids"]))
        return batch


def _with_stand_in(row: dict, pad_id: int) -> dict:
    """The row with the stand-in's tokens after its own (labels IGNORE; the collator masks them)."""
    extra = row.get("stand_in")
    if not extra:
        return row
    return {"input_ids": [*row["input_ids"], *extra], "labels": [*row["labels"], *[IGNORE] * len(extra)]}
