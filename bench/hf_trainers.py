"""TRL's SFTTrainer (its defaults, or with packing) and the plain HF Trainer on the shared model and data.

    BENCH_STATS=stats.json python bench/hf_trainers.py {trl,trl-packing,hf-trainer} MODEL_DIR DATA OUT_DIR \
        [MAX_LENGTH STEPS BATCH]

Every contender gets the shared settings (fp32, batch, steps, learning rate, constant schedule,
sequence length) and nothing is saved; everything else is the library's default, except that TRL's
default gradient checkpointing is turned off because no other contender recomputes activations.
Real tokens are counted by a forward pre-hook on the model: input ids that are not the pad id.
"""

import json
import sys

import torch
from common import BATCH, LEARNING_RATE, SEED, SEQ_LEN, STEPS, StepStats, encode, pad_batch
from datasets import Dataset, load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

SHARED = dict(
    per_device_train_batch_size=BATCH,
    gradient_accumulation_steps=1,
    max_steps=STEPS,
    learning_rate=LEARNING_RATE,
    lr_scheduler_type="constant",
    weight_decay=0.0,
    max_grad_norm=1.0,
    bf16=False,
    fp16=False,
    use_cpu=True,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    seed=SEED,
    disable_tqdm=True,
)


class Recorder(TrainerCallback):
    """Counts real tokens the model sees and stamps the start of the first optimizer step and the end of
    every one."""

    def __init__(self, model, pad_id: int):
        self.stats = StepStats()
        self.pad_id = pad_id
        self.pending = 0
        model.register_forward_pre_hook(self.count, with_kwargs=True)

    def count(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.pending += int((ids != self.pad_id).sum())

    def on_step_begin(self, args, state, control, **kwargs):
        self.stats.begin()

    def on_step_end(self, args, state, control, **kwargs):
        self.stats.step(self.pending)
        self.pending = 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.stats.loss = logs["loss"]


def run_trl(
    model, tokenizer, data_path: str, out_dir: str, packing: bool, recorder_for, length, steps, batch
):
    from trl import SFTConfig, SFTTrainer

    shared = {**SHARED, "max_steps": steps, "per_device_train_batch_size": batch}
    config = SFTConfig(
        output_dir=out_dir, max_length=length, packing=packing, gradient_checkpointing=False, **shared
    )
    dataset = load_dataset("json", data_files=data_path, split="train")
    recorder = recorder_for(model)
    trainer = SFTTrainer(
        model=model, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[recorder]
    )
    trainer.train()
    return recorder


def run_hf_trainer(model, tokenizer, data_path: str, out_dir: str, recorder_for):
    with open(data_path) as handle:
        rows = [encode(tokenizer, json.loads(line)["messages"]) for line in handle]
    dataset = Dataset.from_dict({"input_ids": rows})
    recorder = recorder_for(model)
    trainer = Trainer(
        model=model,
        args=TrainingArguments(output_dir=out_dir, **SHARED),
        train_dataset=dataset,
        data_collator=lambda items: pad_batch([i["input_ids"] for i in items], tokenizer.pad_token_id),
        callbacks=[recorder],
    )
    trainer.train()
    return recorder


def main(
    mode: str, model_dir: str, data_path: str, out_dir: str, length=SEQ_LEN, steps=STEPS, batch=BATCH
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def recorder_for(m):
        return Recorder(m, tokenizer.pad_token_id)

    if mode == "hf-trainer":
        recorder = run_hf_trainer(model, tokenizer, data_path, out_dir, recorder_for)
    else:
        packing = mode == "trl-packing"
        recorder = run_trl(
            model, tokenizer, data_path, out_dir, packing, recorder_for, int(length), int(steps), int(batch)
        )
    recorder.stats.save()


if __name__ == "__main__":
    main(*sys.argv[1:8])
