"""`ftkit plan`'s options. Those left out take the defaults of toolkit.plan.request.PlanRequest (the one
place they live)."""

from __future__ import annotations

import argparse


def add(commands) -> None:
    """The `plan` subcommand and its options, on the CLI's subparsers."""
    from toolkit.config import LossHead, Method
    from toolkit.fields import choices
    from toolkit.plan import GradCkpt, Objective, PlanDtype, PlanPrecision

    plan = commands.add_parser(
        "plan",
        help="memory per GPU per backend, what to launch, what it costs",
        argument_default=argparse.SUPPRESS,
    )
    plan.add_argument("--model", help="model dir, config.json, or hub id (built in or cached)")
    plan.add_argument(
        "--config", help="a recipe config: its model, method, shapes and objective (the options given win)"
    )
    plan.add_argument("--gpus", type=int, help="GPUs on the machine (default 1)")
    plan.add_argument("--gpu-mem", type=float, help="GiB per GPU (default 24)")
    plan.add_argument(
        "--margin", type=float, help="share of each GPU kept free for fragmentation (default 0.05; 0: none)"
    )
    plan.add_argument("--method", choices=choices(Method), help="default lora")
    plan.add_argument("--seq-len", type=int, help="tokens per example (default 2048)")
    plan.add_argument("--micro-batch", type=int, help="examples per GPU per forward (default: most that fit)")
    plan.add_argument("--global-batch", type=int, help="examples per optimizer step (default 32)")
    plan.add_argument("--lora-r", type=int, help="LoRA rank (default 16)")
    plan.add_argument("--lora-dropout", type=float, help="LoRA dropout (default 0)")
    plan.add_argument("--grad-ckpt", choices=choices(GradCkpt), help="checkpointing (default auto)")
    plan.add_argument(
        "--activation-offload",
        action="store_true",
        default=None,
        help="train.activation_offload: saved activations in CPU RAM, one layer's on the GPU",
    )
    plan.add_argument(
        "--packing",
        action="store_true",
        default=None,
        help="data.packing: examples packed into rows of --seq-len tokens (sft)",
    )
    plan.add_argument(
        "--longest-seq",
        action="store_true",
        default=None,
        help="also the longest --seq-len each setup and layout fits (multiples of 1024, up to 1M)",
    )
    plan.add_argument("--dtype", choices=choices(PlanDtype), help="weights (default as recipes)")
    plan.add_argument("--mixed-precision", choices=choices(PlanPrecision), help="default bf16")
    plan.add_argument(
        "--loss-head",
        choices=choices(LossHead),
        help="auto (default): chunked where the model allows; chunked: the logits never exist whole; full",
    )
    plan.add_argument(
        "--chunk-tokens",
        type=int,
        help="label tokens per chunk of the chunked head (default: loss.chunk_tokens, 512)",
    )
    plan.add_argument("--cpu-mem", type=float, help="GiB of CPU RAM; setups needing more do not fit")
    plan.add_argument(
        "--objective",
        choices=choices(Objective),
        help="sft (default); dpo: chosen + rejected per example; grpo: a generation round, then training; "
        "embed: the embedding recipe (no LM head)",
    )
    plan.add_argument(
        "--reference-model",
        action="store_true",
        default=None,
        help="dpo or grpo (with --beta > 0) with a separate reference model",
    )
    plan.add_argument(
        "--embed-task",
        choices=("embedding", "reranker", "classifier"),
        help="embed: what is trained (embed.task; default embedding)",
    )
    plan.add_argument("--negatives", type=int, help="embed: hard negatives per row (default 0)")
    plan.add_argument("--cached", action="store_true", default=None, help="embed: GradCache (embed.cached)")
    plan.add_argument("--labels", type=int, help="embed classifier: how many labels (default 2)")
    plan.add_argument(
        "--matryoshka-dims",
        type=sizes,
        metavar="N,N",
        help="embed: Matryoshka sizes trained beside the full width (embed.matryoshka_dims), e.g. 256,64",
    )
    plan.add_argument("--generations", type=int, help="grpo: completions per prompt (default 8)")
    plan.add_argument("--max-new-tokens", type=int, help="grpo: tokens a completion may have (default 32)")
    plan.add_argument(
        "--generation-batch", type=int, help="grpo: completions a GPU generates at once (default: its share)"
    )
    plan.add_argument(
        "--steps-per-generation", type=int, help="grpo: optimizer steps a round feeds (default 1)"
    )
    plan.add_argument(
        "--gather-for-generation",
        action=argparse.BooleanOptionalAction,
        help="grpo under zero3/fsdp: gather the whole model on each GPU to generate (default on)",
    )
    plan.add_argument("--beta", type=float, help="grpo: KL weight; above 0 a reference is scored (default 0)")
    plan.add_argument("--generation", choices=("hf", "vllm"), help="grpo: what samples (grpo.generation, hf)")
    plan.add_argument(
        "--gpu-memory-utilization", type=float, help="grpo with vllm: the engine's share of its GPU (0.3)"
    )
    plan.add_argument(
        "--engine",
        choices=("shared", "own"),
        help="grpo with vllm: on the main process's GPU (default) or its own (grpo.vllm.gpus or .url)",
    )
    plan.add_argument(
        "--replicas",
        type=int,
        help="grpo with vllm, --engine own: copies of the engine (grpo.vllm.replicas, 1)",
    )
    plan.add_argument(
        "--images-per-row", type=int, help="vision-language models: images in each row (default 1)"
    )
    plan.add_argument(
        "--max-pixels",
        type=int,
        help="vision-language models: pixels of an image (vision.max_pixels, 589824)",
    )
    for part in ("projector", "tower"):
        plan.add_argument(
            f"--train-{part}",
            action="store_true",
            default=None,
            help=f"vision-language models: train the {part} too (vision.train_{part})",
        )
    plan.add_argument(
        "--tower-blocks", type=int, help="with --train-tower: only its last this many blocks (default 0: all)"
    )
    plan.add_argument("--tokens", type=float, help="tokens to train on, for time and cost")
    plan.add_argument("--tokens-per-s", type=float, help="throughput of the whole machine")
    plan.add_argument("--from-run", help="a run's output_dir on the same hardware: its measured tokens/s")
    plan.add_argument("--price-per-gpu-hour", type=float)
    plan.add_argument("--json", action="store_true", default=False, help="machine-readable output, in bytes")


def sizes(text: str) -> tuple[int, ...]:
    """`--matryoshka-dims 256,64`: distinct positive sizes, largest first (as embed.matryoshka_dims)."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give sizes as N,N (e.g. 256,64)") from None
    if min(values) < 1 or sorted(set(values), reverse=True) != list(values):
        raise argparse.ArgumentTypeError(f"{text!r}: give distinct positive sizes, largest first")
    return values
