"""`ftkit` command line: one subcommand per user task, each a thin edge over a toolkit module."""

from __future__ import annotations

import argparse
import sys

from toolkit.errors import UserError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ftkit", description="Fine-tuning toolkit on Hugging Face Accelerate.")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="chat with a fine-tuned model, adapter or full")
    gen.add_argument("--model", required=True, help="final/ or merged model directory, or a PEFT adapter")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=64)

    args = parser.parse_args(argv)
    try:
        return _run(args)
    except UserError as exc:
        print(f"ftkit {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _run(args) -> int:
    if args.command == "generate":
        from toolkit.generate import generate_cli

        print(generate_cli(args.model, args.prompt, args.max_new_tokens))
        return 0
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
