"""Side-by-side CPU benchmark: bare Accelerate loop, ftkit (with and without packing), TRL SFTTrainer
(defaults and packing) and HF Trainer on the same model files, data and settings. Prints the table, puts it
with the machine and the target verdicts into bench/RESULTS.md (between its markers), and writes every run's
figures to bench/raw_results.json. Then the DPO section (bench/dpo.py), the reward-model section
(bench/reward.py: ftkit's reward-model recipe against TRL's RewardTrainer), the data-preparation section
(bench/data_prep.py), the loss-head section (bench/loss_head.py, fewer repeats: its runs are long), the
pipeline section (bench/pipeline.py: ddp, fsdp and pipeline schedules, launched 2-process runs) and the GRPO
section (bench/grpo.py: ftkit's GRPO recipe against TRL's GRPOTrainer), and the mixture-of-experts section:
the SFT contenders but the bare loop and HF Trainer on a Qwen3-MoE of the same width, the routers'
balancing loss on in both ftkit and TRL (each at the model's coefficient, 0.001). Last, the long-sequence
section (bench/long_context.py: one process against Ulysses sequence parallelism sp=2 on the SFT recipe at
4,096 tokens a row, launched runs: tokens/s, peak memory per rank, losses, the all-to-all share), and the
memory of reading a ZeRO-3 checkpoint's optimizer moments one parameter at a time (bench/moments_memory.py,
its checkpoint built once and cached under runs/bench-moments/), and the vision-language section
(bench/vision.py: ftkit's vision demo config against TRL's SFTTrainer on the embedded tiny Llava, LoRA,
and what each does when asked to pack image rows), and `ftkit eval` against lm-eval's own HF backend
(bench/eval_overhead.py: the whole command's time and memory, and the scores, on the same model and tasks),
and a Qwen3.5-shaped hybrid padded, grouped by length and packed (bench/hybrid_packing.py), and GRPO's
rollouts with HF generate against the vLLM engine (bench/rollout_engine.py; skipped without .venv-vllm), and
the engine's weight sync, adapter-only against merged weights (bench/engine_sync.py; the same), the
studio's runs list of 500 runs and plot of a 200,000-step metrics file (bench/studio_scale.py), and ftkit's
embedding recipe against sentence-transformers' own trainer (bench/embed_vs_st.py).

    python bench/run.py [--repeats 5] [--loss-head-repeats 3] [--pipeline-repeats 2] [--grpo-repeats 2]
        [--reward-repeats 3]
        [--moe-repeats 3] [--long-context-repeats 2] [--moments-repeats 3] [--vision-repeats 3]
        [--eval-repeats 3] [--hybrid-repeats 3] [--rollout-engine-repeats 3]
        [--engine-sync-repeats 5] [--studio-repeats 5] [--embed-repeats 3]
        [--only SECTION ...]
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import data_prep
import dpo
import embed_vs_st
import engine_sync
import eval_overhead
import grpo
import hybrid_packing
import long_context
import loss_head
import moments_memory
import pipeline
import reward
import rollout_engine
import studio_scale
import vision
from common import (
    BATCH,
    LEARNING_RATE,
    ROOT,
    SEQ_LEN,
    STEPS,
    build_model_dir,
    step_figures,
    write_data,
    write_results,
)
from harness import BENCH, machine, run_process, table

from toolkit.train.metrics import read_metrics

PY = sys.executable


def commands(work: Path) -> dict[str, list[str]]:
    model, data, out = str(work / "model"), str(work / "data.jsonl"), work / "out"
    ftkit = [PY, str(ROOT / "recipes" / "finetune_llm.py"), "--config", str(BENCH / "ftkit.yaml"),
             f"model.path={model}", f"data.train={data}", f"output_dir={out}/ftkit",
             f"train.max_steps={STEPS}", f"train.global_batch_size={BATCH}",
             f"train.micro_batch_size={BATCH}",
             f"train.learning_rate={LEARNING_RATE}", f"data.max_length={SEQ_LEN}"]  # fmt: skip
    hf = [PY, str(BENCH / "hf_trainers.py")]
    return {
        "bare accelerate loop": [PY, str(BENCH / "bare_loop.py"), model, data],
        "ftkit": ftkit,
        "ftkit packing": [*ftkit, "data.packing=true"],
        "TRL SFTTrainer": [*hf, "trl", model, data, str(out / "trl")],
        "TRL SFTTrainer packing": [*hf, "trl-packing", model, data, str(out / "trlp")],
        "HF Trainer": [*hf, "hf-trainer", model, data, str(out / "hf")],
    }


def run_once(name: str, cmd: list[str], work: Path) -> dict:
    run = run_process(name, cmd, work)
    stats_path = work / "stats.json"
    if name.startswith("ftkit"):
        lines = [x for x in read_metrics(work / "out" / "ftkit" / "metrics.jsonl") if "tokens_per_s" in x]
        ends = [x["time"] for x in lines]
        tokens = [round(x["tokens_per_s"] * x["step_time_s"]) for x in lines]
        loss = lines[-1]["loss"]
        begin = ends[0] - lines[0]["step_time_s"]  # a step's time includes waiting for its batch
    else:
        record = json.loads(stats_path.read_text())
        ends, tokens, loss = record["step_end"], record["tokens"], record["loss"]
        begin = record["first_step_begin"]
    return step_figures("tokens_per_s", ends, tokens, loss, begin, run)


TARGETS = [
    # (what, contender, reference, key, best ratio of contender to reference, higher is better)
    ("ftkit overhead <= 2% over the bare loop (real tokens/s)", "ftkit", "bare accelerate loop",
     "tokens_per_s", 0.98, True),
    ("ftkit packing >= 1.3x TRL's default real tokens/s", "ftkit packing", "TRL SFTTrainer",
     "tokens_per_s", 1.3, True),
    # Setup only: a packed first step holds more real tokens than a padded one, so it ends later.
    ("ftkit time to first step (setup) no worse than TRL's", "ftkit", "TRL SFTTrainer", "setup_s", 1.0,
     False),
    ("ftkit packing time to first step (setup) no worse than TRL's", "ftkit packing", "TRL SFTTrainer",
     "setup_s", 1.0, False),
]  # fmt: skip


MOE_TARGETS = [
    ("ftkit packing >= 1.3x TRL's default real tokens/s on a mixture of experts", "ftkit packing",
     "TRL SFTTrainer", "tokens_per_s", 1.3, True),
    ("ftkit >= TRL's default real tokens/s on a mixture of experts (both padded)", "ftkit",
     "TRL SFTTrainer", "tokens_per_s", 1.0, True),
]  # fmt: skip


def verdicts(results: dict[str, list[dict]], targets: list = TARGETS) -> str:
    """One line per target, judged on medians."""
    lines = []
    for what, name, reference, key, bound, higher in targets:
        ours = statistics.median(r[key] for r in results[name])
        theirs = statistics.median(r[key] for r in results[reference])
        ratio = ours / theirs
        met = ratio >= bound if higher else ratio <= bound
        lines.append(
            f"- {what}: **{'met' if met else 'not met'}** — median {ours:.4g} ({name}) against "
            f"{theirs:.4g} ({reference}), ratio {ratio:.3f}"
        )
    return "\n".join(lines)


BEGIN, END = "<!-- make bench: begin -->", "<!-- make bench: end -->"
MOE_BEGIN, MOE_END = "<!-- make bench moe: begin -->", "<!-- make bench moe: end -->"


def sft_section(repeats: int, moe: bool = False) -> str:
    """The first table (or, `moe`, the mixture-of-experts one): every SFT contender `repeats` times
    round-robin; returns the block it also writes."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        build_model_dir(work / "model", moe)
        write_data(work / "data.jsonl")
        cmds = commands(work)
        if moe:  # the bare loop and HF Trainer add no balancing loss: not the same work
            cmds = {name: cmd for name, cmd in cmds.items() if name.startswith(("ftkit", "TRL"))}
            # ftkit's expert kernels side by side (the default is transformers' grouped_mm); batched_mm
            # gathers every token's experts' weights, far too slow at these batch sizes (RESULTS.md)
            cmds["ftkit packing, eager experts"] = [
                *cmds["ftkit packing"],
                "moe.experts_implementation=eager",
            ]
        results: dict[str, list[dict]] = {name: [] for name in cmds}
        for repeat in range(repeats):  # round-robin, so drift in machine speed hits every contender
            for name, cmd in cmds.items():
                results[name].append(run_once(name, cmd, work))
                print(f"[{repeat + 1}/{repeats}] {name}: {results[name][-1]}", flush=True)
    targets = MOE_TARGETS if moe else TARGETS
    block = "\n\n".join(
        [
            f"Machine: {machine()}. {repeats} runs of each contender; cells are min / median / max.",
            table(results),
            verdicts(results, targets),
        ]
    )
    markers, raw = ((MOE_BEGIN, MOE_END), "raw_moe.json") if moe else ((BEGIN, END), "raw_results.json")
    write_results(BENCH / "RESULTS.md", block, markers)
    (BENCH / raw).write_text(json.dumps({"machine": machine(), "runs": results}, indent=1))
    return block


SECTIONS = ("sft", "dpo", "reward", "data-prep", "loss-head", "pipeline", "grpo", "moe", "long-context",
            "moments", "vision", "eval", "hybrid", "rollout-engine", "engine-sync", "studio",
            "embed")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--loss-head-repeats", type=int, default=3)
    parser.add_argument("--pipeline-repeats", type=int, default=2)
    parser.add_argument("--grpo-repeats", type=int, default=2)
    parser.add_argument("--reward-repeats", type=int, default=3)
    parser.add_argument("--moe-repeats", type=int, default=3)
    parser.add_argument("--long-context-repeats", type=int, default=2)
    parser.add_argument("--moments-repeats", type=int, default=3)
    parser.add_argument("--vision-repeats", type=int, default=3)
    parser.add_argument("--eval-repeats", type=int, default=3)
    parser.add_argument("--hybrid-repeats", type=int, default=3)
    parser.add_argument("--rollout-engine-repeats", type=int, default=3)
    parser.add_argument("--engine-sync-repeats", type=int, default=5)
    parser.add_argument("--studio-repeats", type=int, default=5)
    parser.add_argument("--embed-repeats", type=int, default=3)
    parser.add_argument(
        "--only", action="append", choices=SECTIONS, help="run this section only (repeatable; default: all)"
    )
    args = parser.parse_args()
    only = args.only or SECTIONS
    if "sft" in only:
        print(sft_section(args.repeats))
    if "dpo" in only:
        print(dpo.run_section(args.repeats, machine))
    if "reward" in only:
        print(reward.run_section(args.reward_repeats, machine))
    if "data-prep" in only:
        print(data_prep.run_section([20000, 100000], machine()))
    if "loss-head" in only:
        print(loss_head.run_section(args.loss_head_repeats, machine))
    if "pipeline" in only:
        print(pipeline.run_section(args.pipeline_repeats, machine))
    if "grpo" in only:
        print(grpo.run_section(args.grpo_repeats, machine))
    if "moe" in only:
        print(sft_section(args.moe_repeats, moe=True))
    if "long-context" in only:
        print(long_context.run_section(args.long_context_repeats, machine))
    if "moments" in only:
        print(moments_memory.run_section(args.moments_repeats, [3], machine))
    if "vision" in only:
        print(vision.run_section(args.vision_repeats, machine))
    if "eval" in only:
        print(eval_overhead.run_section(args.eval_repeats, machine))
    if "hybrid" in only:
        print(hybrid_packing.run_section(args.hybrid_repeats, machine))
    if "rollout-engine" in only:
        print(rollout_engine.run_section(args.rollout_engine_repeats, machine))
    if "engine-sync" in only:
        print(engine_sync.run_section(args.engine_sync_repeats, machine))
    if "studio" in only:
        print(studio_scale.run_section(args.studio_repeats, machine))
    if "embed" in only:
        print(embed_vs_st.run_section(args.embed_repeats, machine))


if __name__ == "__main__":
    main()
