"""A mistake is shown once per launch, by whichever rank reports it first (the launcher may end the
others before they print anything); what the main process computed (or the error it met instead) reaches
every rank alike (toolkit.distributed.from_main)."""

import json
import os
import subprocess
import sys

from helpers import REPO, free_port

from toolkit.checkpoint import rundir

REPORT = "from toolkit import console; console.finish('finetune_llm', 2, 'train.max_steps: must be positive')"


def ranks_reporting(order: list[int], world: int = 2) -> str:
    """stderr of `order`'s ranks reporting the same mistake in turn, as children of one launcher (a shell)."""
    runs = "; ".join(f"WORLD_SIZE={world} RANK={rank} {sys.executable} -c {REPORT!r}" for rank in order)
    # The trailing `true` keeps the shell alive as the parent of the last rank too.
    return subprocess.run(["bash", "-c", f"{runs}; true"], cwd=REPO, capture_output=True, text=True).stderr


def test_a_non_main_rank_that_fails_before_the_launcher_ends_rank_0_prints_the_line():
    assert ranks_reporting([1]) == "finetune_llm: error: train.max_steps: must be positive\n"
    assert ranks_reporting([1, 0]) == "finetune_llm: error: train.max_steps: must be positive\n"


def test_the_line_is_printed_once_whatever_the_order_and_again_for_the_next_launch():
    assert ranks_reporting([0, 1, 2], world=3).count("finetune_llm: error:") == 1
    assert ranks_reporting([0, 1]).count("finetune_llm: error:") == 1  # another launcher: its own line


def test_one_process_always_prints():
    assert ranks_reporting([0, 0], world=1).count("finetune_llm: error:") == 2


CLAIM = """
import json
import sys
from pathlib import Path
from accelerate import Accelerator
from toolkit.checkpoint import rundir
from toolkit.distributed import from_main
from toolkit.errors import UserError
from toolkit.grpo.engine import EngineLost
accelerator = Accelerator(cpu=True)
try:
    rundir.claim(accelerator, Path(sys.argv[1]))
except UserError as exc:
    Path(sys.argv[2], f"rank-{accelerator.process_index}.txt").write_text(str(exc))
# What the main process computed, on both; and the error it met instead, of its own type, on both.
main = accelerator.is_main_process
shared = {"value": from_main(accelerator, {"round": 3} if main else "not read")}
try:
    from_main(accelerator, "not sent", EngineLost("grpo.vllm: the engine exited") if main else None)
except UserError as exc:
    shared["raised"] = [type(exc).__name__, str(exc)]
Path(sys.argv[2], f"shared-{accelerator.process_index}.json").write_text(json.dumps(shared))
"""


def test_every_rank_raises_the_main_process_words_when_output_dir_is_held(tmp_path):
    """Whichever rank the launcher hears first prints the line, so each must carry the holder's name."""
    out = tmp_path / "run"
    held = rundir.hold_lock(out)
    script = tmp_path / "claim.py"
    script.write_text(CLAIM)
    said = tmp_path / "said"
    said.mkdir()
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        f"--master-port={free_port()}",
    ]
    result = subprocess.run(
        [*launch, str(script), str(out), str(said)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    held.close()
    words = [
        (said / f"rank-{rank}.txt").read_text() for rank in (0, 1) if (said / f"rank-{rank}.txt").exists()
    ]
    assert len(words) == 2, result.stderr[-3000:]
    assert words[0] == words[1] and f"pid {os.getpid()}" in words[0]
    # toolkit.distributed.from_main, in the same launch.
    for rank in (0, 1):
        assert json.loads((said / f"shared-{rank}.json").read_text()) == {
            "value": {"round": 3},
            "raised": ["EngineLost", "grpo.vllm: the engine exited"],
        }, rank
