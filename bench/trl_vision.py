"""TRL's SFTTrainer on the vision benchmark's tiny Llava and picture questions, LoRA on the language model,
its defaults for a vision-language model apart from the settings bench/vision.py shares with ftkit.

    BENCH_STATS=stats.json python bench/trl_vision.py {plain,packing,padding-free} OUT_DIR STEPS

The processor is the processing class; the dataset has TRL's `messages` and `images` columns, the images
opened from the demo's PNG files. `packing` and `padding-free` ask TRL for its two ways of dropping padding
(the section records what it does with them on image rows). Real tokens are those the model's input
attention mask keeps, counted by a forward pre-hook on the trained (adapter-wrapped) model.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers and TRL are imported: nothing is fetched

import json
import sys
from pathlib import Path

from common import SEED
from datasets import Dataset
from hf_trainers import SHARED, Recorder
from peft import LoraConfig
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor, set_seed
from vision import DATA, LEARNING_RATE, LORA, MAX_LENGTH, MICRO_BATCH, MODEL, accumulation

# The language model's linear layers: the vision tower and the projector get no adapter (ftkit's default
# for a vision-language model), and the output head none either (ftkit's "all-linear").
LANGUAGE_LINEARS = r".*language_model\..*_proj"


class MaskRecorder(Recorder):
    """Recorder counting the tokens the attention mask keeps (the pad id can also be a real token)."""

    def count(self, module, args, kwargs):
        self.pending += int(kwargs["attention_mask"].sum())


def records(path: Path) -> list[dict]:
    """The demo's rows in TRL's layout: the chat as written, each image path opened as an RGB picture."""
    rows = []
    with path.open() as handle:
        for line in handle:
            row = json.loads(line)
            images = [Image.open(path.parent / ref).convert("RGB") for ref in row["images"]]
            rows.append({"messages": row["messages"], "images": images})
    return rows


def main(mode: str, out_dir: str, steps: str) -> None:
    from trl import SFTConfig, SFTTrainer

    set_seed(SEED)  # before the model and its adapter, as ftkit does
    processor = AutoProcessor.from_pretrained(MODEL)
    model = AutoModelForImageTextToText.from_pretrained(MODEL, dtype="float32")
    shared = {
        **SHARED,
        "max_steps": int(steps),
        "per_device_train_batch_size": MICRO_BATCH,
        "gradient_accumulation_steps": accumulation(),
        "learning_rate": LEARNING_RATE,
    }
    config = SFTConfig(
        output_dir=out_dir,
        max_length=MAX_LENGTH,
        packing=mode == "packing",
        padding_free=mode == "padding-free",
        gradient_checkpointing=False,  # as in the text bench: no other contender recomputes activations
        **shared,
    )
    lora = LoraConfig(
        r=LORA["r"],
        lora_alpha=LORA["alpha"],
        lora_dropout=0.0,
        target_modules=LANGUAGE_LINEARS,
        task_type="CAUSAL_LM",
    )
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_list(records(DATA)),
        processing_class=processor,
        peft_config=lora,
    )
    recorder = MaskRecorder(trainer.model, processor.tokenizer.pad_token_id)
    trainer.add_callback(recorder)
    trainer.train()
    recorder.stats.save()


if __name__ == "__main__":
    main(*sys.argv[1:4])
