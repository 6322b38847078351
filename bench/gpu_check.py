"""`make gpu-check`: ftkit on a real GPU, in parts that each run in a few minutes on one H100.

    python bench/gpu_check.py [startup] [large] [plan] [speed] [compile] [paths] [multi] [--smoke]
                              [--work DIR] [--report FILE]

- startup: time to the first step with the evaluation before training, cold (empty compiler caches) and
         warm (a relaunch where only the run's own compile cache is left), steady tokens/s and MFU of the
         1B shape under the defaults; the chunked head's per-chunk math eager against fused, alone.
- large: the Llama-3.1-8B shape under the defaults (LoRA r16, 2,048 tokens x 1): tokens/s and MFU.

- plan:  `ftkit plan`'s per-GPU prediction against the memory a run really used (single GPU; LoRA, QLoRA
         and full fine-tuning of a Llama-3.2-1B-shaped model at two sequence lengths and two micro-batches;
         LoRA and QLoRA of a Llama-3.1-8B-shaped one). Target: within 10%, never 5% under.
- speed: ftkit's SFT recipe at its defaults against TRL's SFTTrainer, at its defaults and with Liger's
         kernels: the same model, data, length, LoRA rank, bf16 and packing; real tokens/s, MFU, peak memory.
- compile: the defaults (compiled decoder blocks, flex_attention for the packed rows) against the eager
         forward on SDPA, and each switch alone: first-step seconds, recompilations and graph breaks
         (counted from dynamo's own log), steady tokens/s and MFU.
- paths: the CUDA paths ftkit has only reasoned about: bitsandbytes' 4-bit (QLoRA's loss beside LoRA's),
         the chunked loss head against the full one, torch.compile, SDPA (its flash kernel) against eager
         attention, gradient checkpointing, fused AdamW, and a Qwen3-MoE-shaped model's expert kernels.
- multi: with 2+ GPUs, every pair's all-reduce (ftkit doctor's check) and DDP, FSDP2 and ZeRO-3 against
         one GPU, step by step.

No part name: all of them. Models are random-initialised from real shapes and the embedded tokenizer, so
nothing is downloaded. Each result is a JSON line in the work folder's results.jsonl; the report (default
bench/GPU.md) is rendered from bench/gpu_results.jsonl, to which a GPU run adds its lines, so different
cards stand side by side. Without CUDA the kit runs in smoke mode: tiny shapes on the CPU, the same code
paths, its report in the work folder; it says so, and none of its figures is a GPU measurement.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from gpu_models import build, write_chats
from gpu_report import render
from gpu_speed import against_base, part_compile, part_speed, quiet_env, speed_values
from gpu_startup import part_large, part_startup

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
PY = sys.executable
RECIPE = ROOT / "recipes" / "finetune_llm.py"
RESULTS = BENCH / "gpu_results.jsonl"
FINDINGS = BENCH / "gpu_findings.md"
PLAN_LOW, PLAN_HIGH = 0.95, 1.10  # predicted / measured: never 5% under, at most 10% over


@dataclass
class Kit:
    """Where the kit works and what it knows of the machine; runs ftkit and records results."""

    smoke: bool
    work: Path
    device: dict = field(default_factory=dict)
    rows: list[dict] = field(default_factory=list)
    run_limit_s: int = 900

    @property
    def results(self) -> Path:
        return self.work / "results.jsonl"

    def model(self, name: str) -> Path:
        return build(name, self.work / "models" / name, self.smoke)

    def drop_model(self, name: str) -> None:
        """Remove a model the kit built once no later part needs it: an 8B and a 30B-A3B shape together
        fill a 64 GB disk."""
        shutil.rmtree(self.work / "models" / name, ignore_errors=True)

    def data(self) -> Path:
        path = self.work / "chats.jsonl"
        return path if path.is_file() else write_chats(path, 20_000 if self.smoke else 400_000)

    def seq(self, length: int) -> int:
        """A checked sequence length; in smoke mode a sixteenth of it."""
        return length // 16 if self.smoke else length

    def __post_init__(self) -> None:
        lines = self.results.read_text().splitlines() if self.results.is_file() else []
        self.recorded = {(row["part"], row["case"]) for row in map(json.loads, filter(str.strip, lines))}

    def done(self, part: str, case: str) -> bool:
        """Whether an earlier run in this work folder recorded the case (a rerun goes on where it stopped)."""
        if (part, case) in self.recorded:
            print(f"[{part}] {case}: in {self.results} already", flush=True)
            return True
        return False

    def record(self, part: str, case: str, **values) -> dict:
        row = {"part": part, "case": case, **values, **self.device}
        self.rows.append(row)
        with self.results.open("a") as handle:
            handle.write(json.dumps(row) + "\n")
        shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())
        print(f"[{part}] {case}: {shown}", flush=True)
        return row

    def ftkit(
        self,
        case: str,
        model: Path,
        *overrides: str,
        launch: list[str] | None = None,
        logs: str = "",
        env: dict | None = None,
    ) -> dict:
        """One run of the SFT recipe; its steps after the first, summarised from its own metrics.jsonl
        ({"error": last line of stderr} when it fails). `logs`: torch's log switches (TORCH_LOGS) for the
        run, whose recompilation and graph-break entries are then counted; `env`: more variables."""
        out = self.work / "runs" / case.replace(" ", "_").replace("/", "-")
        smoke = ["model.dtype=float32", "train.mixed_precision=no", "train.max_steps=3"] if self.smoke else []
        command = [*(launch or [PY]), str(RECIPE), "--config", str(BENCH / "gpu-check.yaml")]
        command += [
            f"model.path={model}",
            f"data.train={self.data()}",
            f"output_dir={out}",
            *smoke,
            *overrides,
        ]
        started, started_at = time.monotonic(), time.time()
        try:
            env = quiet_env() | ({"TORCH_LOGS": logs} if logs else {}) | (env or {})
            done = subprocess.run(
                command, cwd=ROOT, capture_output=True, text=True, env=env, timeout=self.run_limit_s
            )
        except subprocess.TimeoutExpired as stopped:
            _keep_stderr(out, stopped.stderr or "")
            return {"error": f"stopped after {self.run_limit_s} s (--run-limit)"}
        if done.returncode != 0:
            _keep_stderr(out, done.stderr)
            lines = [line for line in done.stderr.splitlines() if line.strip()] or [f"exit {done.returncode}"]
            return {"error": lines[-1][-300:]}
        summary = summarise(out / "metrics.jsonl", time.monotonic() - started, started_at)
        if logs:
            summary["recompiles"] = done.stderr.count("Recompiling function")
            summary["graph_breaks"] = done.stderr.count("Graph break")
            _keep_stderr(out, done.stderr)
        return summary


def _keep_stderr(out: Path, text: str | bytes) -> None:
    """A run's whole stderr, beside its output folder (`runs/<case>.stderr.txt`): inside it, the folder
    would hold a file ftkit did not write, which a relaunch into it refuses."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_name(out.name + ".stderr.txt").write_text(
        text.decode(errors="replace") if isinstance(text, bytes) else text
    )


def summarise(metrics: Path, wall_s: float, started_at: float | None = None) -> dict:
    """Median tokens/s and MFU over the steps after the first (compilation and warm-up), the highest
    memory figures, the last loss and every step's loss; with `started_at` (the launch's wall clock), the
    seconds from the launch to the end of the first step; the compile cache's counters where logged."""
    lines = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [line for line in lines if "tokens_per_s" in line]
    cache = [line for line in lines if "compile_cache_hits" in line]
    if not steps:
        return {"error": f"{metrics}: no training step was logged"}
    timed = steps[1:] or steps
    summary = {
        "tokens_per_s": statistics.median(s["tokens_per_s"] for s in timed),
        "peak_mem_mb": max(s["peak_mem_mb"] for s in steps),
        "loss": steps[-1]["loss"],
        "losses": [s["loss"] for s in steps],
        "first_step_s": steps[0].get("step_time_s"),
        "wall_s": round(wall_s, 1),
    }
    if started_at is not None:
        summary["to_first_step_s"] = round(steps[0]["time"] - started_at, 1)
    for key in ("compile_cache_hits", "compile_cache_misses"):
        if cache:
            summary[key] = cache[0][key]
    if any("mfu" in s for s in timed):
        summary["mfu"] = statistics.median(s["mfu"] for s in timed if "mfu" in s)
    for key in ("peak_reserved_mb", "outside_allocator_mb"):
        if any(key in s for s in steps):
            summary[key] = max(s[key] for s in steps if key in s)
    return summary


# ---- plan: the prediction against the run ----


def plan_cases(kit: Kit) -> list[tuple[str, str, int, int]]:
    """The most telling cases first (each method at the largest and the smallest activations, then the 8B
    shape), so a run cut short still has them."""
    methods, shapes = ("lora", "qlora", "full"), ((2048, 4), (512, 1), (2048, 1), (512, 4))
    small = [("llama-1b", m, kit.seq(s), b) for s, b in shapes for m in methods]
    large = [] if kit.smoke else [("llama-8b", m, kit.seq(2048), 1) for m in ("lora", "qlora")]
    return small[:6] + large + small[6:]


def predicted(kit: Kit, model: Path, method: str, seq: int, micro: int) -> dict:
    """`ftkit plan --json`'s single-GPU figures for the case, in bytes."""
    precision = ["--dtype", "float32", "--mixed-precision", "no"] if kit.smoke else ["--dtype", "bfloat16"]
    command = [
        PY,
        "-m",
        "toolkit.commands.cli",
        "plan",
        "--model",
        str(model),
        "--gpus",
        "1",
        "--method",
        method,
    ]
    command += [
        "--gpu-mem",
        str(kit.device.get("memory_gib", 80)),
        "--seq-len",
        str(seq),
        "--micro-batch",
        str(micro),
    ]
    command += ["--global-batch", str(micro), "--grad-ckpt", "off", *precision, "--json"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=quiet_env())
    if done.returncode != 0:
        return {}
    plan = json.loads(done.stdout)
    rows = plan["backends"] if isinstance(plan["backends"], list) else [plan["backends"]]
    return next(row for row in rows if row["backend"] == "single")["per_gpu_bytes"]


def part_plan(kit: Kit) -> None:
    for name, method, seq, micro in plan_cases(kit):
        case = f"{name} {method} seq {seq} micro {micro}"
        if kit.done("plan", case):
            continue
        model = kit.model(name)
        plan = predicted(kit, model, method, seq, micro)
        keys = [f"model.method={method}", f"data.max_length={seq}", f"train.micro_batch_size={micro}"]
        keys += [f"train.global_batch_size={micro}", "model.gradient_checkpointing=false"]
        run = kit.ftkit(f"plan {case}", model, *keys)
        if "error" in run or not plan:
            kit.record("plan", case, error=run.get("error", "ftkit plan failed"))
            continue
        kit.record("plan", case, **plan_comparison(plan, run, kit.smoke))
    kit.drop_model("llama-8b")  # only the plan's cases use it


def plan_comparison(plan: dict, run: dict, smoke: bool) -> dict:
    """The plan's tensors (its total less overhead) against the peak allocated, and its total against the
    peak reserved plus what lies outside the allocator (CUDA context); the verdict is on the latter."""
    mib = 2**20
    values = {
        "predicted_mib": round(plan["total"] / mib),
        "tensors_mib": round((plan["total"] - plan["overhead"]) / mib),
    }
    values["allocated_mib"] = round(run["peak_mem_mb"])
    values["tensors_ratio"] = values["tensors_mib"] / max(values["allocated_mib"], 1)
    if "peak_reserved_mb" in run:
        measured = run["peak_reserved_mb"] + run.get("outside_allocator_mb", 0.0)
        values["measured_mib"] = round(measured)
        values["ratio"] = values["predicted_mib"] / max(measured, 1)
        values["verdict"] = "ok" if PLAN_LOW <= values["ratio"] <= PLAN_HIGH else "off"
    else:
        values["verdict"] = "smoke: CPU peak RSS, not GPU memory" if smoke else "no CUDA memory figures"
    return values


# ---- paths: the CUDA paths, each against a baseline run ----

PATHS = {  # case: the keys that switch it on, against the LoRA baseline (defaults, chunked head, fused AdamW)
    "QLoRA (bitsandbytes 4-bit)": ["model.method=qlora"],
    "full loss head": ["loss.head=full"],
    "eager attention (SDPA off)": ["model.attn_implementation=eager"],
    "gradient checkpointing": ["model.gradient_checkpointing=true"],
    "AdamW not fused": ["train.fused_adamw=false"],
    "eager forward (compile off)": ["model.compile=false"],
}


# Kernels from packages `make install` leaves out; without them, the row says so and the kit goes on. In
# smoke mode the keys run anyway: ftkit notes that CUDA is missing and trains without them.
OPTIONAL = {
    "flash-attn 2": ("flash_attn", "model.attn_implementation=flash_attention_2"),
    "Liger kernels": ("liger_kernel", "model.liger_kernels=true"),
}


def part_paths(kit: Kit) -> None:
    if kit.done("paths", "Qwen3-MoE-shaped, QLoRA (4-bit experts)"):
        return
    seq = kit.seq(2048)
    keys = [f"data.max_length={seq}", "train.micro_batch_size=4", "train.global_batch_size=4"]
    model = kit.model("llama-1b")
    base = kit.ftkit("paths baseline", model, *keys)
    flash = torch.cuda.is_available() and torch.backends.cuda.flash_sdp_enabled()
    case = "baseline: LoRA, defaults, chunked head, fused AdamW"
    kit.record("paths", case, **speed_values(base), flash_sdp=flash)
    for case, switch in PATHS.items():
        run = kit.ftkit(f"paths {case}", model, *keys, *switch)
        kit.record("paths", case, **against_base(run, base))
    for case, (package, switch) in OPTIONAL.items():
        if not (kit.smoke or importlib.util.find_spec(package)):
            kit.record(
                "paths", case, skipped=f"{package} is not installed (pip install {package.replace('_', '-')})"
            )
            continue
        run = kit.ftkit(f"paths {case}", model, *keys, switch)
        kit.record("paths", case, **against_base(run, base))
    moe = kit.model("qwen3-moe")
    grouped = kit.ftkit("paths moe grouped_mm", moe, *keys)
    kit.record("paths", "Qwen3-MoE-shaped, grouped_mm experts", **speed_values(grouped))
    eager = kit.ftkit("paths moe eager", moe, *keys, "moe.experts_implementation=eager")
    kit.record("paths", "Qwen3-MoE-shaped, eager experts", **against_base(eager, grouped))
    quantized = kit.ftkit("paths moe qlora", moe, *keys, "model.method=qlora")
    kit.record("paths", "Qwen3-MoE-shaped, QLoRA (4-bit experts)", **against_base(quantized, grouped))
    kit.drop_model("qwen3-moe")


# ---- multi: 2+ GPUs ----


def part_multi(kit: Kit) -> None:
    gpus = torch.cuda.device_count()
    if gpus < 2:
        kit.record("multi", "all", skipped=f"{gpus} GPU(s): the multi-GPU part needs 2 or more")
        return
    from toolkit.commands.allreduce_check import check_pairs

    for result in check_pairs(gpus, timeout_s=60):
        kit.record("multi", f"all-reduce GPUs {result.pair}", status=result.status, seconds=result.seconds)
    keys = [f"data.max_length={kit.seq(2048)}", "train.micro_batch_size=2", "train.global_batch_size=4"]
    model = kit.model("llama-1b")
    single = kit.ftkit("multi single", model, *keys)
    for config in ("ddp", "fsdp", "zero3"):
        launch = [PY, "-m", "accelerate.commands.launch", "--config_file"]
        launch += [str(ROOT / "accelerate_configs" / f"{config}.yaml"), "--num_processes", "2"]
        run = kit.ftkit(f"multi {config}", model, *keys, launch=launch)
        if "error" in run or "error" in single:
            kit.record("multi", config, error=run.get("error") or single["error"])
            continue
        worst = max(abs(a / b - 1) for a, b in zip(run["losses"], single["losses"], strict=True))
        kit.record("multi", f"{config} x2 against one GPU", max_loss_rel_diff=worst, **speed_values(run))


PARTS = {
    "startup": part_startup,
    "large": part_large,
    "plan": part_plan,
    "speed": part_speed,
    "compile": part_compile,
    "paths": part_paths,
    "multi": part_multi,
}


def device_info(smoke: bool) -> dict:
    """What the report heads each run with."""
    info = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "smoke": smoke}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            device=props.name, gpus=torch.cuda.device_count(), memory_gib=round(props.total_memory / 2**30)
        )
        info.update(cuda=torch.version.cuda, driver=_driver())
    else:
        info.update(device="CPU (no GPU found)", gpus=0, cuda=None, driver=None)
    return info


def _driver() -> str | None:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)  # fmt: skip
        return done.stdout.strip().splitlines()[0] if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", help=f"parts to run, of {', '.join(PARTS)} (default: all)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU even where CUDA exists")
    parser.add_argument("--work", type=Path, help="models, data, runs and results (default: a new temp dir)")
    parser.add_argument("--run-limit", type=int, default=900, help="seconds one ftkit run may take")
    parser.add_argument("--report", type=Path, help="markdown report (default: bench/GPU.md on a GPU)")
    args = parser.parse_args(argv)
    unknown = [part for part in args.parts if part not in PARTS]
    if unknown:
        parser.error(f"no part {unknown[0]!r}: the parts are {', '.join(PARTS)}")
    smoke = args.smoke or not torch.cuda.is_available()
    if smoke:
        print("no GPU found: smoke mode, tiny shapes on the CPU; no figure it prints is a GPU measurement")
    if args.work and args.work.exists() and not args.work.is_dir():
        parser.error(f"--work {args.work}: not a directory")
    work = args.work or Path(tempfile.mkdtemp(prefix="ftkit-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    kit = Kit(smoke, work, device_info(smoke), run_limit_s=args.run_limit)
    for part in args.parts or list(PARTS):
        started = time.monotonic()
        PARTS[part](kit)
        print(f"[{part}] done in {time.monotonic() - started:.0f} s", flush=True)
    if smoke:
        report, rows = args.report or work / "GPU.md", kit.rows
    else:
        with RESULTS.open("a") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in kit.rows)
        report = args.report or BENCH / "GPU.md"
        rows = [json.loads(line) for line in RESULTS.read_text().splitlines() if line.strip()]
    findings = FINDINGS.read_text() if FINDINGS.is_file() and not smoke else ""
    report.write_text(render(rows, findings))
    print(f"report: {report} (results: {kit.results})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
