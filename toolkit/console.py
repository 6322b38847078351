"""What a launched run prints: known third-party noise filtered; how a worker's exit reaches `ftkit train`.

Recipes call `quiet_third_party()` first and end with `finish(code, message)`. FTKIT_VERBOSE=1 shows
everything. Under `ftkit train` (FTKIT_EXIT_DIR set) each rank writes its exit code and one-line error to a
small file there instead of printing it, so the user sees the line once and `ftkit train` exits with the
worker's own code (torchrun reports any failing worker as exit 1).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import tempfile
import warnings
from pathlib import Path

VERBOSE_ENV = "FTKIT_VERBOSE"
EXIT_DIR_ENV = "FTKIT_EXIT_DIR"
# Warnings that say nothing the user can act on: torch deprecations raised inside DeepSpeed's collectives
# (hundreds per ZeRO-3 step) and inside transformers' own calls.
KNOWN_WARNINGS = (r"`torch\.distributed\.\w+` is deprecated", r"`is_gradient_checkpointing` is deprecated")
# FSDP1's sharded checkpoints go through torch APIs that torch itself marks for removal; FSDP2 is the
# user's way out, and the warnings (dozens per checkpoint) name nothing else to change.
FSDP1_WARNINGS = (
    (r"Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning),
    (r"FSDP\.state_dict_type\(\) and FSDP\.set_state_dict_type\(\) are being deprecated", FutureWarning),
    (r"`load_state_dict` is deprecated", FutureWarning),
    (r"`_get_pg_default_device` will be deprecated", UserWarning),
    (r"Multiple backends are registered with this ProcessGroup", UserWarning),
)
SCHEDULER_ORDER = r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"
# peft's all-linear on fused experts sets gate_up_proj's rank by a pattern it matches on the parameter, then
# warns (at every adapter it builds: load, export check) that no module name matched: the rank is applied
# (tests/unit/test_router.py checks the adapter's shape).
PEFT_PATTERNS = r"The following (rank|alpha)_pattern keys did not match any targeted module"
# Whole lines from the launcher and libraries, matched wherever they appear (`ftkit train` drops them).
KNOWN_LINES = re.compile(
    "|".join(
        (
            r".*Setting accelerator to CPU\. If you have GPU",
            r"DeepSpeed deepspeed\.ops\.\S+ built successfully",
            r".*(FutureWarning|UserWarning): " + f"({'|'.join(KNOWN_WARNINGS)})",
            r"\s+(warnings\.warn\(|return func\(\*args, \*\*kwargs\))$",
            r"[WI]\d{4} [\d:.]+ \d+ \S*torch/distributed/run\.py:\d+\]",
        )
    )
)


def verbose(env=None) -> bool:
    return (os.environ if env is None else env).get(VERBOSE_ENV, "") not in ("", "0")


def quiet_third_party() -> None:
    """Silence the known noise in this process (unless FTKIT_VERBOSE=1); real warnings still show."""
    if verbose():
        return
    for pattern in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=FutureWarning)
    warnings.filterwarnings("ignore", message=PEFT_PATTERNS, category=RuntimeWarning)
    for pattern, category in FSDP1_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category, module=r"torch\.distributed")
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        # The engine steps the optimizer inside backward (CPU Adam under offload), out of sight of the
        # counter torch's scheduler checks; the recipe's loop order is right by construction.
        warnings.filterwarnings("ignore", message=SCHEDULER_ORDER, category=UserWarning)
    # DeepSpeed logs this on every process whenever no GPU exists: the run's own backend line says so.
    logging.getLogger("DeepSpeed").addFilter(lambda record: "Setting accelerator to" not in record.msg)
    logging.getLogger("transformers.modeling_utils").addFilter(_not_a_head_swap)
    if os.environ.get("RANK", "0") != "0":
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one "Loading weights" bar (the main process's), not one per rank


def quiet_command() -> None:
    """An `ftkit` command's console: the known noise quieted as in a run, and the libraries' progress bars
    (loading, writing shards) off, so what the command prints is its own lines (FTKIT_VERBOSE=1: all)."""
    quiet_third_party()
    if verbose():
        return
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    disable_progress_bars()


# A row of transformers' load report: the weight's name, then its status.
REPORT_ROW = re.compile(r"^(\S+)\s*\|\s*(UNEXPECTED|MISSING)\b", re.MULTILINE)
HEAD_SWAP = {"lm_head.weight", "score.weight"}


def _not_a_head_swap(record: logging.LogRecord) -> bool:
    """False for the load report of a causal LM loaded as a reward model's base: its output layer unused and
    the scalar head new, which is what the reward recipe asks for (toolkit/model/scalar.py)."""
    message = record.getMessage()
    names = {name for name, _ in REPORT_ROW.findall(message)}
    return not ("LOAD REPORT" in message and names and names <= HEAD_SWAP)


def is_noise(line: str) -> bool:
    return KNOWN_LINES.match(line) is not None


def finish(recipe: str, code: int, message: str = "") -> int:
    """Report how this process ends: to `ftkit train`'s exit file when it launched us, else on stderr."""
    exit_dir = os.environ.get(EXIT_DIR_ENV)
    if exit_dir and code != 0:
        record = {"code": code, "message": message}
        (Path(exit_dir) / f"rank-{os.environ.get('RANK', '0')}.json").write_text(json.dumps(record))
    elif message and first_to_report(os.environ):
        close_progress_bars()
        print(f"{recipe}: error: {message}", file=sys.stderr, flush=True)
    return code


def first_to_report(env) -> bool:
    """Whether this process is the first of its machine's launch to report an error. Every rank meets the
    same mistakes (a config, a path, an agreed check), and the launcher ends the others once one exits: the
    first to get here prints, whichever rank it is, and the rest stay quiet. The launch is told by the
    launcher process all its ranks share (its pid and start time, so a reused pid is another launch)."""
    if int(env.get("WORLD_SIZE", "1")) <= 1:
        return True
    launcher = os.getppid()
    marker = Path(tempfile.gettempdir()) / f"ftkit-error-{launcher}-{_start_time(launcher)}"
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    except OSError:
        return env.get("RANK", "0") == "0"  # no writable temp dir: rank 0 speaks, as a last resort
    return True


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (Linux), else empty."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def say_once(line: str) -> None:
    """A line every rank would print, printed by the first rank alone."""
    if os.environ.get("RANK", "0") == "0":
        close_progress_bars()
        print(line, flush=True)


def close_progress_bars() -> None:
    """A bar left open by the error ends its line first, so the message gets a line of its own."""
    bars = sys.modules.get("tqdm.std")
    if bars is not None:
        for bar in list(bars.tqdm._instances):
            bar.close()


def read_exits(exit_dir: Path) -> list[dict]:
    """What the ranks reported, by rank."""
    files = sorted(exit_dir.glob("rank-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    return [json.loads(p.read_text()) for p in files]
