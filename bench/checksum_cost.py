"""What the checkpoint checksums cost on a 0.5B model's ZeRO-3 checkpoint: a random model of
Qwen2.5-0.5B's shape (494M parameters) fully fine-tuned one step by the SFT recipe on 2 processes
(accelerate_configs/zero3.yaml; gloo CPU processes without a GPU; `--processes 1` where RAM is short),
checkpointed at that step. Then, on that
checkpoint: the seconds its save spent on CRC-32s (every file read back once), and the seconds and peak
memory of verifying it as resume and export do (`checkpoint.save.damage`, in a process of its own).
Prints one Markdown block; the figures are quoted in docs/recipes.md.

    python bench/checksum_cost.py [--keep DIR] [--processes N]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT
from harness import machine

PY = sys.executable
# Qwen2.5-0.5B's config.json (its sizes; the weights here are random).
SHAPE = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
             num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
             tie_word_embeddings=True, bos_token_id=0, eos_token_id=2, pad_token_id=3)  # fmt: skip


def build_model(out: Path) -> int:
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **SHAPE))
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "toolkit" / "assets" / "tiny-llama" / name, out / name)
    return sum(p.numel() for p in model.parameters())


def train_and_checkpoint(model: Path, out: Path, processes: int) -> float:
    command = [PY, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "accelerate_configs" / "zero3.yaml"), "--num_processes", str(processes),
               str(ROOT / "recipes" / "finetune_llm.py"), f"output_dir={out}", f"model.path={model}",
               "model.method=full", "train.max_steps=1", "train.save_every_steps=1",
               "train.global_batch_size=2", "train.micro_batch_size=1", "data.max_length=64",
               "eval.max_batches=0", "eval.exact_match_samples=0", "data.eval=null",
               "data.eval_fraction=0"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    start = time.time()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the run failed:\n{done.stderr[-3000:]}")
    return time.time() - start


def verify_in_own_process(checkpoint: Path) -> dict:
    """`damage` on the checkpoint in a fresh process: its seconds, and the process's peak RSS before and
    after (the imports alone, then with the verification)."""
    code = (
        "import json, resource, sys, time\nfrom pathlib import Path\n"
        "from toolkit.checkpoint.save import damage\n"
        "rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024\n"
        "before = rss(); t = time.time(); reason = damage(Path(sys.argv[1]))\n"
        "print(json.dumps({'seconds': time.time() - t, 'damage': reason, 'rss_before_mb': before, "
        "'rss_after_mb': rss()}))"
    )
    done = subprocess.run([PY, "-c", code, str(checkpoint)], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", help="work in this folder and leave it (default: a temporary one)")
    parser.add_argument(
        "--processes", type=int, default=2, help="ZeRO-3 processes (1 where RAM holds one copy only)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep or tmp)
        params = build_model(work / "model")
        run_s = train_and_checkpoint(work / "model", work / "run", args.processes)
        checkpoint = work / "run" / "checkpoints" / "step-1"
        from toolkit.checkpoint.save import crc32_of

        files = [f for f in checkpoint.rglob("*") if f.is_file()]
        size = sum(f.stat().st_size for f in files)
        start = time.time()
        for file in files:
            crc32_of(file)
        crc_s = time.time() - start
        verified = verify_in_own_process(checkpoint)
    gib = size / 2**30
    print(
        f"Machine: {machine()}.\n\n"
        f"- model: {params:,} parameters (Qwen2.5-0.5B's shape), full fine-tune, "
        f"ZeRO-3 on {args.processes} process(es); "
        f"the run (load, one step, checkpoint, export) took {run_s:.0f} s\n"
        f"- checkpoint step-1: {len(files)} files, {gib:.2f} GiB\n"
        f"- CRC-32 of every file (what a save adds, files read back once, page cache warm): {crc_s:.2f} s "
        f"({crc_s / gib:.2f} s per GiB)\n"
        f"- verifying it in a fresh process (sizes, safetensors headers, CRC-32s): "
        f"{verified['seconds']:.2f} s; "
        f"the process's peak RSS {verified['rss_before_mb']:.0f} MB after its imports, "
        f"{verified['rss_after_mb']:.0f} MB after verifying; damage found: {verified['damage'] or 'none'}"
    )


if __name__ == "__main__":
    main()
