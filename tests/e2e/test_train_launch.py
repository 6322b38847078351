"""`ftkit train` launched for real: a worker's error reaches the user once, as the exit code it chose.

Launches: real, through the `ftkit train` command line (the command is what is tested).
"""

import os
import subprocess
import sys

import pytest
from helpers import REPO, free_port

pytestmark = pytest.mark.multiproc


def ftkit_train(*argv: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "toolkit.commands.cli", "train", *argv]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_a_user_error_on_every_rank_is_one_line_and_exit_2(tmp_path):
    missing = tmp_path / "missing.jsonl"
    done = ftkit_train(
        "--backend", "ddp", f"output_dir={tmp_path / 'run'}", f"data.train={missing}", "data.max_length=64",
        "--", "--main_process_port", str(free_port()),
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stdout.splitlines()[0].startswith(
        "accelerate launch --config_file accelerate_configs/ddp.yaml"
    )
    assert done.stderr == f"finetune_llm: error: {missing}: file not found\n"
