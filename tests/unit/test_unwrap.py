"""`toolkit.distributed.unwrap` gives what `accelerator.unwrap_model` gives on the backends it handles itself,
and a run that uses no DeepSpeed does not import it to unwrap its model."""

import subprocess
import sys

import torch
from accelerate import Accelerator
from helpers import REPO, free_port

from toolkit.distributed import unwrap


def test_a_plain_and_a_compiled_model_unwrap_as_accelerate_unwraps_them():
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    assert unwrap(accelerator, model) is accelerator.unwrap_model(model) is model
    compiled = torch.compile(torch.nn.Linear(2, 2))
    assert unwrap(accelerator, compiled) is accelerator.unwrap_model(compiled) is compiled


SCRIPT = """
import os, sys, torch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
from accelerate import Accelerator
from toolkit.distributed import unwrap
accelerator = Accelerator(cpu=True)
inner = torch.nn.Linear(2, 2)
model = accelerator.prepare(inner)
assert type(model).__name__ == "DistributedDataParallel", type(model)
assert unwrap(accelerator, model) is inner
assert "deepspeed" not in sys.modules
assert accelerator.unwrap_model(model) is inner
"""


def test_ddp_unwraps_to_the_model_without_importing_deepspeed():
    """In a process of its own (one gloo rank), where nothing else has imported DeepSpeed."""
    env = {"OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(free_port())],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
