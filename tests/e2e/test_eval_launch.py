"""`ftkit eval --gpus 2` launched for real on 2 gloo CPU processes: lm-eval splits every task's examples
over them, and the main process's before/after table equals one process's.

Launches: real, through the `ftkit eval --gpus` command line (the command is what is tested).
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import REPO, free_port, start_adapter

from toolkit.commands.cli import main as cli

TASKS = ["--tasks", "ftkit_sums,ftkit_sums_choice", "--limit", "12", "--json"]


@pytest.mark.multiproc
def test_two_processes_score_like_one(tmp_path, capsys):
    adapter = start_adapter(tmp_path / "adapter")  # its base (the tiny model) is the table's other column
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "toolkit" / "assets" / "tiny-llama" / name, adapter / name)
    argv = ["eval", "--model", str(adapter), *TASKS]
    assert cli(argv) == 0
    one = json.loads(capsys.readouterr().out)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "toolkit.commands.cli", *argv, "--gpus", "2"]
    command += ["--", "--main_process_port", str(free_port())]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    two = json.loads(done.stdout)  # the main process's table alone: the other prints nothing
    assert (one["processes"], two["processes"]) == (1, 2)
    assert [(r["task"], r["metric"]) for r in two["rows"]] == [
        ("ftkit_sums", "exact_match"),
        ("ftkit_sums_choice", "acc"),
    ]
    for ours, theirs in zip(two["rows"], one["rows"], strict=True):
        for key in ("tuned", "base", "diff", "diff_stderr"):
            assert ours[key] == pytest.approx(theirs[key], abs=1e-9), (ours["task"], key)
    assert one["rows"][1]["tuned"] != one["rows"][1]["base"]  # the adapter moved the choices
    assert "`pretrained` model kwarg" not in done.stderr  # lm-eval's note for a model handed over
