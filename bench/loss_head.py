"""The loss head at Llama-3's vocabulary (128,256): peak memory and step time of ftkit's chunked head, its
full-logits path (`loss.head=full`) and TRL's SFTTrainer at 2,048 and 8,192 tokens a row; a sweep of
`loss.chunk_tokens`; and ftkit's DPO recipe against TRL's DPOTrainer on long completions. Round-robin
repeats, each run a fresh process. Writes its tables between the loss-head markers of bench/RESULTS.md and
every run's figures to bench/raw_loss_head.json (also run by `make bench`).

    python bench/loss_head.py [--repeats 3] [--rss-cap-gb 20]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
from common import LEARNING_RATE, ROOT, SEED, TOKENIZER_DIR, step_figures, write_results
from harness import machine

from toolkit.config import LossConfig
from toolkit.train.metrics import read_metrics

BENCH = Path(__file__).resolve().parent
PY = sys.executable
BEGIN, END = "<!-- make bench loss-head: begin -->", "<!-- make bench loss-head: end -->"
VOCAB = 128256
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
ROLES = ["user", "assistant", "system"]
FIRST_WORD = len(SPECIAL) + len(ROLES)  # ids below it are not drawn for the data
STEPS = 6
CASES = {"2,048 x 2 rows": (2048, 2), "8,192 x 1 row": (8192, 1)}  # tokens a row, rows a step
SWEEP = [256, 512, 1024, 2048, 4096]
SWEEP_CASE = "2,048 x 2 rows"
PAIRS = "2 pairs a step"
DPO = {"length": 2048, "batch": 2, "steps": 4, "prompt": 64, "answer": (960, 1024)}
FTKIT, FULL, TRL = "ftkit (chunked head)", "ftkit loss.head=full", "TRL SFTTrainer"
DPO_FTKIT, DPO_FULL, DPO_TRL = "ftkit dpo (chunked head)", "ftkit dpo loss.head=full", "TRL DPOTrainer"


def build_model_dir(out: Path) -> None:
    """A random-init Llama with a 128,256-token vocabulary and a small body (hidden 128, 2 layers): the head
    and the embedding are 98.7% of its 33.3M parameters. Its tokenizer is one word a token ("w<id>", plus
    ChatML's special tokens and role names), so data can be written as token ids and every tool encodes
    them the same way."""
    import torch
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + ROLES)}
    vocab.update({f"w{i}": i for i in range(FIRST_WORD, VOCAB)})
    words = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL[0]))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|endoftext|>"],
        chat_template=AutoTokenizer.from_pretrained(TOKENIZER_DIR).chat_template,
        model_max_length=max(length for length, _ in CASES.values()),
    )
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=448,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=tokenizer.model_max_length,
        rope_theta=500000.0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(SEED)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)


def words(rng: np.random.Generator, count: int) -> str:
    return " ".join(f"w{i}" for i in rng.integers(FIRST_WORD, VOCAB, count))


def write_rows(path: Path, length: int, rows: int) -> None:
    """`rows` plain-text documents of `length` - 1 uniformly drawn token ids: both tools append the eos token,
    so every row is exactly `length` tokens (no padding, no truncation, no packing needed)."""
    rng = np.random.default_rng(SEED)
    with path.open("w") as handle:
        for _ in range(rows):
            handle.write(json.dumps({"text": words(rng, length - 1)}) + "\n")


def write_pairs(path: Path, count: int) -> None:
    """Pairs in the conversational layout: a user turn and two long assistant answers of random token ids."""
    rng = np.random.default_rng(SEED)
    low, high = DPO["answer"]
    with path.open("w") as handle:
        for _ in range(count):
            pair = {"prompt": [{"role": "user", "content": words(rng, DPO["prompt"])}]}
            for side in ("chosen", "rejected"):
                answer = words(rng, int(rng.integers(low, high + 1)))
                pair[side] = [{"role": "assistant", "content": answer}]
            handle.write(json.dumps(pair) + "\n")


def sft_commands(work: Path, case: str) -> dict[str, list[str]]:
    length, batch = CASES[case]
    model, data, out = work / "model", work / f"rows-{length}.jsonl", work / "out"
    ftkit = [PY, str(ROOT / "recipes" / "finetune_llm.py"), "--config", str(BENCH / "ftkit.yaml"),
             f"model.path={model}", f"data.train={data}", "data.format=text", f"data.max_length={length}",
             f"train.max_steps={STEPS}", f"train.global_batch_size={batch}",
             f"train.micro_batch_size={batch}", f"train.learning_rate={LEARNING_RATE}"]  # fmt: skip
    trl = [PY, str(BENCH / "hf_trainers.py"), "trl", str(model), str(data), str(out / "trl"), str(length),
           str(STEPS), str(batch)]  # fmt: skip
    cmds = {
        FTKIT: [*ftkit, f"output_dir={out / 'ftkit'}"],
        FULL: [*ftkit, "loss.head=full", f"output_dir={out / 'ftkit'}"],
        TRL: trl,
    }
    if case == SWEEP_CASE:  # every value named, the default too: a default changed mid-run cannot mix in
        cmds.update({sweep_name(t): [*cmds[FTKIT], f"loss.chunk_tokens={t}"] for t in SWEEP})
    return cmds


def sweep_name(tokens: int) -> str:
    return f"ftkit loss.chunk_tokens={tokens}"


def ftkit_code() -> str:
    """The last commit touching toolkit/ and recipes/, and a digest of their uncommitted changes if any
    (other work may land while the benchmark runs; the block says so if it did)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout

    commit = git("log", "-1", "--format=%h", "--", "toolkit", "recipes").strip()
    diff = git("diff", "HEAD", "--", "toolkit", "recipes")
    return commit + (
        f" + uncommitted changes {hashlib.sha256(diff.encode()).hexdigest()[:8]}" if diff else ""
    )


def dpo_commands(work: Path) -> dict[str, list[str]]:
    model, pairs, out = work / "model", work / "pairs.jsonl", work / "out"
    ftkit = [PY, str(ROOT / "recipes" / "dpo_llm.py"), "--config", str(BENCH / "ftkit-dpo.yaml"),
             f"model.path={model}", f"data.train={pairs}", "model.method=full",
             f"data.max_length={DPO['length']}",
             f"train.max_steps={DPO['steps']}", f"train.global_batch_size={DPO['batch']}",
             f"train.micro_batch_size={DPO['batch']}", f"train.learning_rate={LEARNING_RATE}",
             f"output_dir={out / 'ftkit'}"]  # fmt: skip
    trl = [PY, str(BENCH / "trl_dpo.py"), "text", str(model), str(pairs), str(out / "trl"),
           str(DPO["length"]), str(DPO["steps"]), str(DPO["batch"]), "full"]  # fmt: skip
    return {DPO_FTKIT: ftkit, DPO_FULL: [*ftkit, "loss.head=full"], DPO_TRL: trl}


def run_capped(cmd: list[str], work: Path, cap_mb: float) -> tuple[float, float, float, str | None]:
    """Run `cmd` to its end, killing it if its RSS passes `cap_mb` (sampled every 50 ms, so a run that
    would not fit ends before it takes the machine down): (launch time, wall seconds, peak RSS MB, why it
    failed or None)."""
    (work / "stats.json").unlink(missing_ok=True)
    # Every run starts from an empty output directory (nothing of an earlier run to read or overwrite).
    shutil.rmtree(work / "out", ignore_errors=True)
    env = {**os.environ, "BENCH_STATS": str(work / "stats.json"), "PYTHONPATH": str(BENCH),
           "HF_DATASETS_CACHE": str(work / "hf-cache")}  # fmt: skip
    log, capped = work / "stderr.txt", False
    launched = time.time()
    with log.open("wb") as stderr:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        watched = psutil.Process(proc.pid)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            with contextlib.suppress(psutil.Error):  # ended between the two calls
                if not capped and watched.memory_info().rss > cap_mb * 2**20:
                    proc.kill()
                    capped = True
            time.sleep(0.05)
    wall, rss_mb = time.time() - launched, usage.ru_maxrss / 1024
    if capped:
        return launched, wall, rss_mb, f"did not fit: stopped at the {cap_mb / 1024:.0f} GiB RSS cap"
    if status != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no stderr)"]
        print(f"failed ({status}):\n{log.read_text(errors='replace')[-3000:]}", flush=True)
        return launched, wall, rss_mb, f"failed: {tail[0][:160]}"
    return launched, wall, rss_mb, None


def run_once(name: str, cmd: list[str], work: Path, cap_mb: float) -> dict:
    launched, wall, rss_mb, failed = run_capped(cmd, work, cap_mb)
    if failed:
        return {"failed": failed, "rss_mb": rss_mb, "wall_s": wall}
    rate = "pairs_per_s" if "dpo" in name.lower() else "tokens_per_s"
    if name.startswith("ftkit"):
        lines = [x for x in read_metrics(work / "out" / "ftkit" / "metrics.jsonl") if rate in x]
        ends = [x["time"] for x in lines]
        counts = [round(x[rate] * x["step_time_s"]) for x in lines]
        loss, begin = lines[-1]["loss"], lines[0]["time"] - lines[0]["step_time_s"]
    else:
        record = json.loads((work / "stats.json").read_text())
        ends, counts, loss = record["step_end"], record["tokens"], record["loss"]
        begin = record["first_step_begin"]
    figures = step_figures(rate, ends, counts, loss, begin, (launched, wall, rss_mb))
    return {**figures, "fastest_step_s": min(b - a for a, b in zip(ends, ends[1:]))}


COLUMNS = [
    ("step_s", "step time median (s)", "{:.2f}"),
    ("fastest_step_s", "fastest step (s)", "{:.2f}"),
    ("rss_mb", "peak RSS (MB)", "{:.0f}"),
    ("loss", "final loss", "{:.4f}"),
    ("wall_s", "whole run (s)", "{:.1f}"),
]


def cells(runs: list[dict], columns) -> list[str]:
    """min / median / max of each column over the runs that finished; a run that did not says why."""
    done = [r for r in runs if "failed" not in r]
    failed = sorted({r["failed"] for r in runs if "failed" in r})
    out = []
    for key, _, fmt in columns:
        values = sorted(r[key] for r in done)
        text = (
            " / ".join(fmt.format(v) for v in (values[0], statistics.median(values), values[-1]))
            if done
            else ""
        )
        if failed and key == "rss_mb":
            peaks = sorted(r["rss_mb"] for r in runs if "failed" in r)
            text = f"{text} ({'; '.join(failed)}; peak {peaks[-1]:.0f})".strip()
        out.append(text or "—")
    return out


def table(rows: dict[tuple[str, str], list[dict]], first: str, columns=COLUMNS) -> str:
    lines = [
        f"| {first} | contender | " + " | ".join(c[1] for c in columns) + " |",
        "|---" * (len(columns) + 2) + "|",
    ]
    for (case, name), runs in rows.items():
        lines.append(f"| {case} | {name} | " + " | ".join(cells(runs, columns)) + " |")
    return "\n".join(lines)


def median(runs: list[dict], key: str) -> float | None:
    done = [r[key] for r in runs if "failed" not in r]
    return statistics.median(done) if done else None


def verdict(what: str, ours: list[dict], theirs: list[dict], key: str, bound: float, names: str) -> str:
    mine, other = median(ours, key), median(theirs, key)
    if mine is None or other is None:
        missing = names.split(" against ")[0 if mine is None else 1]
        return f"- {what}: **not judged** — {missing} did not finish"
    ratio = mine / other
    met = "met" if ratio <= bound else "not met"
    return f"- {what}: **{met}** — median {mine:.4g} against {other:.4g} ({names}), ratio {ratio:.3f}"


def fastest(ours: list[dict], theirs: list[dict]) -> str:
    """The same comparison on the fastest step of all runs: other work on the shared cores only adds time,
    so the fastest steps are the least disturbed."""
    mine, other = (
        min((r["fastest_step_s"] for r in runs if "failed" not in r), default=None) for runs in (ours, theirs)
    )
    if mine is None or other is None:
        return ""
    return f"; fastest steps {mine:.3g} against {other:.3g} s, ratio {mine / other:.3f}"


def verdicts(sft: dict, dpo: dict) -> str:
    lines = []
    for case in CASES:
        ours, full, trl = sft[case, FTKIT], sft[case, FULL], sft[case, TRL]
        what = f"{case}: ftkit's peak RSS <= 0.5x TRL's"
        lines.append(verdict(what, ours, trl, "rss_mb", 0.5, f"{FTKIT} against {TRL}"))
        what = f"{case}: ftkit's step time <= 1.05x the full-logits path"
        lines.append(
            verdict(what, ours, full, "step_s", 1.05, f"{FTKIT} against {FULL}") + fastest(ours, full)
        )
    for name in (DPO_FTKIT, DPO_FULL):
        what = f"DPO: {name} peak RSS <= 0.5x TRL DPOTrainer's"
        lines.append(
            verdict(what, dpo[PAIRS, name], dpo[PAIRS, DPO_TRL], "rss_mb", 0.5, f"{name} against {DPO_TRL}")
        )
    return "\n".join(lines)


def sweep_table(sft: dict, default: int) -> str:
    columns = [("tokens_per_s", "tokens/s", "{:.0f}"), *(c for c in COLUMNS if c[0] in SWEEP_COLUMNS)]
    lines = [
        "| loss.chunk_tokens | " + " | ".join(c[1] for c in columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    rows = {f"{t} (default)" if t == default else str(t): sft[SWEEP_CASE, sweep_name(t)] for t in SWEEP}
    rows["loss.head=full (the runs above)"] = sft[SWEEP_CASE, FULL]
    for label, runs in rows.items():
        lines.append(f"| {label} | " + " | ".join(cells(runs, columns)) + " |")
    return "\n".join(lines)


SWEEP_COLUMNS = ("step_s", "fastest_step_s", "rss_mb")


def run_section(repeats: int, machine, cap_gb: float = 20.0) -> str:
    """Every contender `repeats` times round-robin; returns the markdown block it also writes."""
    cap_mb = cap_gb * 1024
    code, default = ftkit_code(), LossConfig().chunk_tokens
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        build_model_dir(work / "model")
        for length, batch in CASES.values():
            write_rows(work / f"rows-{length}.jsonl", length, batch * STEPS)
        write_pairs(work / "pairs.jsonl", DPO["batch"] * DPO["steps"])
        plan = [((case, name), cmd) for case in CASES for name, cmd in sft_commands(work, case).items()]
        plan += [((PAIRS, name), cmd) for name, cmd in dpo_commands(work).items()]
        results: dict[tuple[str, str], list[dict]] = {key: [] for key, _ in plan}
        for repeat in range(repeats):  # round-robin, so drift in machine speed hits every contender
            for key, cmd in plan:
                results[key].append(run_once(key[1], cmd, work, cap_mb))
                print(f"[loss head {repeat + 1}/{repeats}] {key}: {results[key][-1]}", flush=True)
    sft = {key: runs for key, runs in results.items() if key[0] in CASES}
    dpo = {key: runs for key, runs in results.items() if key[0] == PAIRS}
    main_rows = {key: runs for key, runs in sft.items() if key[1] in (FTKIT, FULL, TRL)}
    sft_columns = [("tokens_per_s", "tokens/s", "{:.0f}"), *COLUMNS]
    dpo_columns = [("pairs_per_s", "pairs/s", "{:.3f}"), *COLUMNS]
    head = (
        f"Machine: {machine()}. ftkit at {code} (loss.chunk_tokens default {default}). {repeats} runs of "
        "each contender; cells are min / median / max."
    )
    if ftkit_code() != code:
        head += f" **ftkit's code changed during the run (to {ftkit_code()}): the figures mix two versions.**"
        print(f"warning: ftkit's code changed during the run ({code} -> {ftkit_code()})", flush=True)
    block = "\n\n".join(
        [
            head,
            table(main_rows, "tokens a row x rows a step", sft_columns),
            table(dpo, "DPO", dpo_columns),
            verdicts(sft, dpo),
            f"`loss.chunk_tokens` of ftkit's chunked head at {SWEEP_CASE} (each value set on the command "
            "line, the default's too):",
            sweep_table(sft, default),
        ]
    )
    write_results(BENCH / "RESULTS.md", block, (BEGIN, END))
    raw = {
        "machine": machine(),
        "ftkit": code,
        "runs": {" | ".join(key): runs for key, runs in results.items()},
    }
    (BENCH / "raw_loss_head.json").write_text(json.dumps(raw, indent=1))
    return block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rss-cap-gb", type=float, default=20.0, help="a run past this RSS is stopped")
    args = parser.parse_args()

    print(run_section(args.repeats, machine, args.rss_cap_gb))


if __name__ == "__main__":
    main()
