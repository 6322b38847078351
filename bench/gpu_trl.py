"""The GPU check's TRL side: SFTTrainer with LoRA r16 on every linear layer, bf16 (fp32 in smoke mode on the
CPU), packing, the same model, data, length, micro-batch and steps as ftkit's run.

    python bench/gpu_trl.py MODEL_DIR DATA OUT_JSON MAX_LENGTH MICRO_BATCH STEPS [liger]

`liger`: SFTTrainer's `use_liger_kernel` (Liger's norms, rotary, SwiGLU and fused loss).

Writes {tokens_per_s, mfu, peak_mem_mb, loss}: real tokens/s over the steps after the first (the benchmark's
Recorder counts them) and MFU with ftkit's FLOPs count, so the two sides are counted alike.
"""

import json
import sys
import tempfile

import torch
from datasets import load_dataset
from hf_trainers import Recorder
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer

from toolkit.model import flops
from toolkit.train.metrics import peak_memory_mb


def main(model_dir: str, data: str, out: str, length: str, micro: str, steps: str, *extra: str) -> None:
    from trl import SFTConfig, SFTTrainer

    gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if gpu else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    recorder = Recorder(model, tokenizer.pad_token_id)
    config = SFTConfig(
        output_dir=tempfile.mkdtemp(), max_length=int(length), packing=True,
        per_device_train_batch_size=int(micro), max_steps=int(steps), learning_rate=1e-4,
        lr_scheduler_type="constant", bf16=gpu, use_cpu=not gpu, gradient_checkpointing=False,
        logging_steps=1, save_strategy="no", report_to="none", seed=0, disable_tqdm=True,
        use_liger_kernel="liger" in extra,
    )  # fmt: skip
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    dataset = load_dataset("json", data_files=data, split="train")
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[recorder],
    )
    trainer.train()
    stats = recorder.stats  # steps 2.. (the first compiles and warms up), as bench/run.py counts them
    tokens_per_s = sum(stats.tokens[1:]) / (stats.step_end[-1] - stats.step_end[0])
    device = torch.device("cuda" if gpu else "cpu")
    per_token = flops.ModelShape.of(trainer.model).flops_per_token(int(length))
    result = {"tokens_per_s": tokens_per_s, "peak_mem_mb": peak_memory_mb(device), "loss": stats.loss}
    utilisation = flops.mfu(tokens_per_s, per_token, flops.device_name(device), 1)
    if utilisation is not None:
        result["mfu"] = utilisation
    with open(out, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main(*sys.argv[1:])
