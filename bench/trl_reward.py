"""TRL's RewardTrainer on the shared model and pairs, LoRA (its scalar head trained whole, as peft's
sequence-classification task does), its defaults apart from the shared settings.

    BENCH_STATS=stats.json python bench/trl_reward.py MODEL_DIR PAIRS OUT_DIR
"""

import json
import sys

from common import BATCH, SEED, SEQ_LEN
from datasets import Dataset
from hf_trainers import SHARED
from peft import LoraConfig
from transformers import AutoModelForSequenceClassification, AutoTokenizer, set_seed
from trl_dpo import PairRecorder


def main(model_dir: str, pairs_path: str, out_dir: str) -> None:
    from trl import RewardConfig, RewardTrainer

    set_seed(SEED)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with open(pairs_path) as handle:
        records = [json.loads(line) for line in handle]
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype="float32")
    model.config.pad_token_id = tokenizer.pad_token_id
    config = RewardConfig(output_dir=out_dir, max_length=SEQ_LEN, gradient_checkpointing=False, **SHARED)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="SEQ_CLS")
    recorder = PairRecorder(BATCH)
    trainer = RewardTrainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_list(records),
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[recorder],
    )
    trainer.train()
    recorder.stats.save()


if __name__ == "__main__":
    main(*sys.argv[1:4])
