"""`ftkit` command line: one subcommand per user task, each a thin edge over a toolkit module."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from toolkit.commands import plan_options
from toolkit.errors import UserError


def main(argv: list[str] | None = None) -> int:
    from toolkit.commands import train

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(
        prog="ftkit", description="Fine-tuning toolkit on Hugging Face Accelerate."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    train_parser = commands.add_parser(
        "train", help="launch a recipe on this machine: picks the backend, prints the accelerate command"
    )
    train.add_arguments(train_parser)

    gen = commands.add_parser("generate", help="chat with a fine-tuned model, adapter or full")
    gen.add_argument("--model", required=True, help="final/ or merged model directory, or a PEFT adapter")
    gen.add_argument("--prompt", required=True)
    gen.add_argument(
        "--image", action="append", help="an image the prompt asks about (vision-language models; repeatable)"
    )
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument(
        "--trust-remote-code", action="store_true", help="run modelling code shipped with the model"
    )

    score = commands.add_parser("score", help="a reward model's score of answers to a prompt")
    score.add_argument("--model", required=True, help="a reward model's final/ or merged/ directory")
    score.add_argument("--prompt", required=True)
    score.add_argument("--answer", action="append", required=True, help="an answer to score (repeatable)")
    score.add_argument(
        "--trust-remote-code", action="store_true", help="run modelling code shipped with the model"
    )

    vectors = commands.add_parser("embed", help="an embedding model's vectors, or similarities to a query")
    vectors.add_argument("--model", required=True, help="an embedding run's final/ directory")
    vectors.add_argument("--text", action="append", required=True, help="a text to embed (repeatable)")
    vectors.add_argument("--query", help="print each text's cosine similarity to this query instead")
    vectors.add_argument(
        "--trust-remote-code", action="store_true", help="run modelling code shipped with the model"
    )

    pairs = commands.add_parser(
        "sample-pairs", help="reward-model pairs: the reference answer against a policy's own wrong samples"
    )
    pairs.add_argument(
        "--model", required=True, help="the policy: final/ or merged model directory, or adapter"
    )
    pairs.add_argument("--data", required=True, help="SFT data whose last turn is the reference answer")
    pairs.add_argument("--out", required=True, help="the pairs file to write (JSON lines)")
    pairs.add_argument("--samples", type=int, default=8, help="answers sampled per prompt (default 8)")
    pairs.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    pairs.add_argument("--max-new-tokens", type=int, default=8, help="tokens an answer may have (default 8)")
    pairs.add_argument("--seed", type=int, default=0)

    evaluate = commands.add_parser(
        "eval", help="score a fine-tuned model and its base on benchmarks (lm-evaluation-harness)"
    )
    evaluate.add_argument(
        "--model", required=True, help="final/ or merged model directory, or a PEFT adapter"
    )
    evaluate.add_argument(
        "--tasks", required=True, help="comma-separated lm-eval task names (ftkit_sums: local)"
    )
    evaluate.add_argument("--base", help="the model to compare with (default: the run's base; none: no base)")
    evaluate.add_argument("--include", help="a folder of lm-eval task YAMLs (local tasks)")
    evaluate.add_argument("--limit", type=int, help="examples per task (default: all)")
    evaluate.add_argument("--batch-size", type=int, default=8)
    evaluate.add_argument("--json", action="store_true", help="print the table as JSON")
    evaluate.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="data-parallel processes (accelerate launch; after --: its own options, e.g. a port)",
    )
    evaluate.add_argument(
        "--trust-remote-code", action="store_true", help="run modelling code shipped with the model"
    )

    plan_options.add(commands)

    doctor = commands.add_parser("doctor", help="check this machine: versions, GPUs, P2P, NCCL, RAM, disk")
    doctor.add_argument("--output-dir", default="runs", help="where runs go (free disk is checked there)")
    doctor.add_argument("--json", action="store_true")
    doctor.add_argument(
        "--no-allreduce", action="store_true", help="skip the short all-reduce on every GPU pair"
    )

    check = commands.add_parser("check-config", help="check an accelerate YAML against a recipe config")
    check.add_argument("accelerate_config", metavar="ACCEL_YAML", help="e.g. accelerate_configs/zero3.yaml")
    check.add_argument("--config", help="recipe config YAML (default: the demo config)")
    check.add_argument("--num-processes", type=int, help="as passed to accelerate launch --num_processes")

    plot = commands.add_parser("plot", help="loss, learning rate and tokens/s of runs, overlaid in a PNG")
    plot.add_argument("run_dirs", nargs="+", metavar="OUTPUT_DIR")
    plot.add_argument("--out", help="PNG to write (default: metrics.png in the first OUTPUT_DIR)")

    export = commands.add_parser(
        "export", help="a checkpoint of any backend as a Hugging Face model or PEFT adapter, on one CPU"
    )
    export.add_argument(
        "checkpoint_dir",
        metavar="CHECKPOINT_DIR",
        help="e.g. runs/demo/checkpoints/step-100 (with --gguf, a run too: its newest checkpoint)",
    )
    export.add_argument(
        "--out",
        help="directory to write: new, empty, or an earlier export (then replaced); with --gguf, "
        "the folder the .gguf and .Modelfile go into (default: RUN-gguf beside the run)",
    )
    export.add_argument(
        "--gguf",
        metavar="TYPE",
        help="merge and write one GGUF file and an Ollama Modelfile: "
        "f16 | bf16 | q8_0 | q4_k_m | q5_k_m | q6_k (docs/gguf.md)",
    )
    export.add_argument(
        "--llama-cpp", metavar="DIR", help="with --gguf: a llama.cpp checkout to convert with"
    )
    export.add_argument("--merge-lora", action="store_true", help="fold a LoRA adapter into a full model")
    export.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="default: the run's export.dtype")
    export.add_argument("--base-model", help="base model path, where the config's model.path moved")
    export.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run modelling code shipped with the base model (never taken from the checkpoint's config)",
    )

    scaling = commands.add_parser(
        "bench-scaling", help="the recipe at several process counts: tokens/s, speedup, efficiency"
    )
    scaling.add_argument(
        "--config_file", required=True, help="accelerate config, e.g. accelerate_configs/ddp.yaml"
    )
    scaling.add_argument("--nprocs", default="1,2", help="process counts to compare (default 1,2)")
    scaling.add_argument("--config", help="recipe config YAML (default: the demo config)")
    scaling.add_argument("--recipe", default="recipes/finetune_llm.py", help="recipe script to launch")
    scaling.add_argument("--out", default="runs/bench-scaling", help="where the runs and scaling.json go")
    scaling.add_argument("--warmup-steps", type=int, default=2, help="first steps left out of the timing")
    scaling.add_argument("--json", action="store_true")
    scaling.add_argument("overrides", nargs="*", help="after --: dotted.key=value recipe overrides")

    studio = commands.add_parser("studio", help="a local web page over the run folders (docs/studio.md)")
    from toolkit.studio.server import add_arguments as studio_arguments

    studio_arguments(studio)

    if argv[:1] == ["train"]:
        # Options and key=value overrides mix freely; what follows `--` goes to accelerate launch.
        cut = argv.index("--") if "--" in argv else len(argv)
        args = train_parser.parse_intermixed_args(argv[1:cut])
        args.command, args.accelerate_args = "train", argv[cut + 1 :]
    elif argv[:1] == ["eval"]:
        cut = argv.index("--") if "--" in argv else len(argv)
        args = parser.parse_args(argv[:cut])
        args.argv, args.accelerate_args = argv[:cut], argv[cut + 1 :]
    else:
        args = parser.parse_args(argv)
    if args.command != "train":  # a launch's processes quiet themselves
        from toolkit import console

        console.quiet_command()
    try:
        return _run(args)
    except UserError as exc:
        from toolkit import console

        # Under a launch (ftkit eval --gpus N) every process meets the mistake: the user reads it once.
        return console.finish(f"ftkit {args.command}", 2, str(exc))


def _run(args) -> int:
    if args.command == "train":
        from toolkit.commands.train import train_cli

        return train_cli(args)
    if args.command == "generate":
        from toolkit.commands.generate import generate_cli

        print(generate_cli(args.model, args.prompt, args.max_new_tokens, args.trust_remote_code, args.image))
        return 0
    if args.command == "score":
        from toolkit.commands.score import score_cli

        print("\n".join(score_cli(args.model, args.prompt, args.answer, args.trust_remote_code)))
        return 0
    if args.command == "embed":
        from toolkit.commands.embed import embed_cli

        print("\n".join(embed_cli(args.model, args.text, args.query, args.trust_remote_code)))
        return 0
    if args.command == "sample-pairs":
        from toolkit.reward.policy_pairs import sample_pairs_cli

        print(
            sample_pairs_cli(
                args.model,
                args.data,
                args.out,
                args.samples,
                args.temperature,
                args.max_new_tokens,
                args.seed,
            )
        )
        return 0
    if args.command == "eval":
        from toolkit.commands.eval import eval_cli, launch_processes

        if args.gpus < 1:
            raise UserError(f"--gpus: {args.gpus} is not a number of processes")
        if args.gpus > 1:
            return launch_processes(args)
        shown = eval_cli(
            args.model,
            args.tasks,
            args.base,
            args.include,
            args.limit,
            args.batch_size,
            args.json,
            args.trust_remote_code,
        )
        if shown:  # processes other than a launch's main one print nothing
            print(shown)
        return 0
    if args.command == "plan":
        from toolkit.plan import estimate, from_config, report

        request, cost = estimate.requests_from_options(from_config.with_config(vars(args)))
        result = estimate.make_plan(request, cost)
        print(json.dumps(report.to_json(result), indent=2) if args.json else report.render_text(result))
        return 0 if result.choice is not None else 1
    if args.command == "doctor":
        from toolkit.commands.doctor import probe, report

        timeout_s = None if args.no_allreduce else probe.ALLREDUCE_TIMEOUT_S
        probes = probe.gather_probes(Path(args.output_dir), allreduce_timeout_s=timeout_s)
        findings = report.diagnose(probes)
        shown = report.to_json(findings, probes) if args.json else None
        print(json.dumps(shown, indent=2) if args.json else report.render_text(findings, probes))
        return report.exit_code(findings)
    if args.command == "check-config":
        import os

        from toolkit.commands.check_config import check_config_cli

        # A copy: what the check would set for NCCL only applies inside a launched process.
        print(check_config_cli(args.accelerate_config, args.config, args.num_processes, dict(os.environ)))
        return 0
    if args.command == "plot":
        from toolkit.commands.plot import plot_runs

        print(plot_runs([Path(d) for d in args.run_dirs], Path(args.out) if args.out else None))
        return 0
    if args.command == "export" and args.gguf:
        from toolkit.gguf.export import export_gguf

        if args.dtype:
            raise UserError("--dtype: not used with --gguf, whose type is the precision written")
        out, llama_cpp = (Path(p) if p else None for p in (args.out, args.llama_cpp))
        print(
            export_gguf(
                Path(args.checkpoint_dir), args.gguf, out, llama_cpp, args.base_model, args.trust_remote_code
            )
        )
        return 0
    if args.command == "export":
        from toolkit.checkpoint.to_hf import export_checkpoint

        if not args.out:
            raise UserError("--out: required (the directory to write the model or adapter to)")
        print(
            export_checkpoint(
                Path(args.checkpoint_dir),
                Path(args.out),
                args.merge_lora,
                args.dtype,
                args.base_model,
                args.trust_remote_code,
            )
        )
        return 0
    if args.command == "studio":
        from toolkit.studio.server import studio_cli

        return studio_cli(args)
    if args.command == "bench-scaling":
        from dataclasses import asdict

        from toolkit.commands import bench_scaling
        from toolkit.launch.machine import count_gpus

        points = bench_scaling.run_scaling(
            args.config_file,
            bench_scaling.parse_counts(args.nprocs),
            args.overrides,
            Path(args.out),
            Path(args.recipe),
            args.config,
            args.warmup_steps,
            echo=(lambda line: print(line, file=sys.stderr)) if args.json else print,
        )
        if args.json:
            print(json.dumps([asdict(p) for p in points], indent=2))
        else:
            print(bench_scaling.render(points, args.config_file, on_cpu=count_gpus() == 0))
        return 0
    raise AssertionError(args.command)


if __name__ == "__main__":
    code = main()
    if code == 0:
        from toolkit.errors import leave_at_once

        leave_at_once(code)
    sys.exit(code)
