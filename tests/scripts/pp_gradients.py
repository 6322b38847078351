"""Under torchrun (2 gloo processes): a tiny float64 Llama of 4 layers trimmed to each process's pipeline
stages (toolkit.pipeline.stages) and stepped by each schedule (GPipe, 1F1B, interleaved 1F1B with 2 chunks
per process) on micro-batches stacked by toolkit.pipeline.batches, against the same model whole on each
process running every example alone. The micro-batches mix right padding, packed rows (position ids
restarting) and rows added to fill a micro-batch. The loss is the summed token NLL over the target count.

With the chunked head (loss.head: chunked, the recipe's default, float64 for a float64 model) the reference
is float64 cross-entropy on the model's logits; with the full head (log-probs in float32) it is the
recipe's one-process loss, `toolkit.train.loss.summed_token_loss`, float32 as well. Writes, per case, the
largest difference of the loss and of every parameter's gradient to --out as JSON."""

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
from transformers import LlamaForCausalLM

from toolkit.data.collate import Collator, PackedCollator
from toolkit.data.encode import IGNORE
from toolkit.entry import leave
from toolkit.pipeline import stages
from toolkit.pipeline.batches import stacked
from toolkit.pipeline.runtime import SCHEDULES
from toolkit.train import head
from toolkit.train.loss import summed_token_loss

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import tiny_llama_config  # noqa: E402

PAD, ROWS, WIDTH = 3, 2, 40
CHUNK_TOKENS = 16  # several chunks of label tokens per micro-batch
CASES = {  # name -> (schedule, chunks per process, head)
    "gpipe": ("gpipe", 1, "chunked"),
    "1f1b": ("1f1b", 1, "chunked"),
    "interleaved_1f1b": ("interleaved_1f1b", 2, "chunked"),
    "1f1b_full_head": ("1f1b", 1, "full"),
}


def examples(vocab: int) -> list[dict]:
    """Rows as the encoder writes them: a prompt without labels, then an answer that is its own label."""
    generator = torch.Generator().manual_seed(1)
    rows = []
    for length, prompt in [(13, 3), (7, 2), (9, 4), (5, 2), (11, 3), (6, 2), (10, 4), (8, 3), (4, 1)]:
        ids = torch.randint(0, vocab, (length,), generator=generator).tolist()
        rows.append({"input_ids": ids, "labels": [IGNORE] * prompt + ids[prompt:]})
    return rows


def packed(rows: list[dict]) -> dict:
    """One packed row as toolkit.data.packing.PackedRows builds it: no label at an example's first token."""
    out = {"input_ids": [], "labels": [], "position_ids": []}
    for row in rows:
        out["input_ids"] += row["input_ids"]
        out["labels"] += [IGNORE] + row["labels"][1:]
        out["position_ids"] += list(range(len(row["input_ids"])))
    return out


def micro_batches(rows: list[dict]) -> list[dict]:
    """Right padding; a packed row; one row (the other added as padding); packed rows of unequal length.
    Every example once."""
    plain, pack = Collator(PAD), PackedCollator(PAD)
    return [
        plain(rows[0:2]),
        pack([packed(rows[2:5])]),
        plain(rows[5:6]),
        pack([packed(rows[6:8]), packed(rows[8:9])]),
    ]


def targets(rows: list[dict]) -> int:
    return sum(sum(label != IGNORE for label in row["labels"][1:]) for row in rows)


def reference_gradients(whole, rows: list[dict], head_kind: str):
    """(loss, gradient by name) of the whole model, every example run alone: no padding, no packing."""
    model = copy.deepcopy(whole)
    total = 0
    for row in rows:
        logits = model(input_ids=torch.tensor([row["input_ids"]])).logits
        labels = torch.tensor([row["labels"]])
        if head_kind == "full":
            total = total + summed_token_loss(logits, labels)
        else:
            total = total + F.cross_entropy(logits[0, :-1], labels[0, 1:], reduction="sum")
    loss = total / targets(rows)
    loss.backward()
    return loss.detach(), {name: param.grad for name, param in model.named_parameters()}


def pipeline_gradients(whole, case: str, batches: list[dict], n_targets: int):
    """This process's part of the model, its gradients filled by one schedule step, and the step's loss
    (on the process with the last stage, else None)."""
    schedule_name, chunks, _ = CASES[case]
    model = copy.deepcopy(whole)
    size, rank = dist.get_world_size(), dist.get_rank()
    n_stages = size * chunks
    stage_ids = [rank + k * size for k in range(chunks)]
    split = stages.layer_split(model, n_stages, [])
    built = [
        PipelineStage(module, i, n_stages, torch.device("cpu"))
        for module, i in zip(stages.trim(model, split, stage_ids), stage_ids)
    ]
    kind = SCHEDULES[schedule_name]
    schedule = kind(
        built if kind is ScheduleInterleaved1F1B else built[0],
        n_microbatches=len(batches),
        loss_fn=lambda logps, labels: -logps.sum() / n_targets,
        scale_grads=False,
    )
    ids, positions, attention, labels = stacked(batches, ROWS, WIDTH, PAD)
    losses = []
    if 0 in stage_ids:
        schedule.step(ids, positions, attention, labels)
    else:
        schedule.step(target=labels, losses=losses)
    return model, split, torch.stack(losses).sum() if losses else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    plain_head = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=4)).double()
    chunked_head = copy.deepcopy(plain_head)
    head.install(chunked_head, CHUNK_TOKENS)
    rows = examples(plain_head.config.vocab_size)
    batches = micro_batches(rows)
    assert all(len(b["input_ids"]) <= ROWS and b["input_ids"].shape[1] < WIDTH for b in batches)
    result = {}
    for case, (_, _, head_kind) in CASES.items():
        whole = chunked_head if head_kind == "chunked" else plain_head
        expected_loss, expected = reference_gradients(whole, rows, head_kind)
        part, split, loss = pipeline_gradients(whole, case, batches, targets(rows))
        # Each process checks the parameters it holds: the whole model's names, each held by one process.
        diffs = [(param.grad - expected[name]).abs().max() for name, param in part.named_parameters()]
        loss_diff = (loss - expected_loss).abs() if loss is not None else torch.zeros((), dtype=torch.float64)
        worst = torch.stack([max(diffs), loss_diff.double()])
        held = torch.tensor(len(diffs))
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        dist.all_reduce(held)
        result[case] = {
            "grad_diff": worst[0].item(),
            "loss_diff": worst[1].item(),
            "grads": held.item(),
            "params": len(expected),
            "split": split,
        }
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    leave(main)  # as the recipes end (toolkit/entry.py): no teardown with a gloo group alive
