"""TRL's DPOTrainer on the shared model and pairs, LoRA, its defaults apart from the shared settings.

    BENCH_STATS=stats.json python bench/trl_dpo.py {chat,text} MODEL_DIR PAIRS OUT_DIR \
        [MAX_LENGTH STEPS BATCH {lora,full}]

`chat` hands TRL the conversational records, which it renders and tokenizes itself: its completions keep
what the chat template writes after the end-of-turn token (a newline here), one token more per answer
than ftkit scores. `text` hands it the same pairs already rendered (prompt up to the assistant header;
each answer up to its end-of-turn token), so its token rows are ftkit's and the losses can be compared.
`full` trains every weight, with TRL's default reference for it: a frozen copy of the starting model.
"""

import json
import sys

from common import BATCH, SEED, SEQ_LEN, STEPS, StepStats
from datasets import Dataset
from hf_trainers import SHARED
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, set_seed


class PairRecorder(TrainerCallback):
    """Stamps the start of the first optimizer step and the end of each (every step holds `batch` pairs)."""

    def __init__(self, batch: int):
        self.stats = StepStats()
        self.batch = batch

    def on_step_begin(self, args, state, control, **kwargs):
        self.stats.begin()

    def on_step_end(self, args, state, control, **kwargs):
        self.stats.step(self.batch)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.stats.loss = logs["loss"]


def rendered(tokenizer, record: dict) -> dict:
    """A conversational pair as text: the prompt with the generation header, each answer cut at the end
    of its turn (what follows the end-of-turn token is template layout, not answer)."""
    prompt = tokenizer.apply_chat_template(record["prompt"], tokenize=False, add_generation_prompt=True)
    out = {"prompt": prompt}
    for side in ("chosen", "rejected"):
        full = tokenizer.apply_chat_template(record["prompt"] + record[side], tokenize=False)
        out[side] = full[len(prompt) :].rstrip()
    return out


def main(
    mode: str,
    model_dir: str,
    pairs_path: str,
    out_dir: str,
    length=SEQ_LEN,
    steps=STEPS,
    batch=BATCH,
    method: str = "lora",
) -> None:
    from trl import DPOConfig, DPOTrainer

    set_seed(SEED)  # before the model and its adapter, as ftkit does, so both draw the same LoRA init
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with open(pairs_path) as handle:
        records = [json.loads(line) for line in handle]
    if mode == "text":
        records = [rendered(tokenizer, r) for r in records]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    shared = {**SHARED, "max_steps": int(steps), "per_device_train_batch_size": int(batch)}
    config = DPOConfig(output_dir=out_dir, max_length=int(length), gradient_checkpointing=False, **shared)
    lora = LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    recorder = PairRecorder(int(batch))
    trainer = DPOTrainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_list(records),
        processing_class=tokenizer,
        peft_config=lora if method == "lora" else None,
        callbacks=[recorder],
    )
    trainer.train()
    recorder.stats.save()


if __name__ == "__main__":
    main(*sys.argv[1:9])
