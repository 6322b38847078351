"""examples/slurm/train.sbatch without SLURM: its launch logic with SLURM's variables for two "nodes" on
127.0.0.1 (stand-in `srun` and `scontrol` on PATH), stopped by SIGTERM as a time limit would, requeued on one
node, and ending with the losses of an uninterrupted run.

Launches: real: the SLURM script and its requeue are what is tested.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import REPO, free_port, step_losses

# Timing-sensitive (its SIGTERM lands at a chosen moment): make test-e2e runs it with nothing beside it.
pytestmark = [pytest.mark.multiproc, pytest.mark.alone]

SCRIPT = REPO / "examples" / "slurm" / "train.sbatch"
# srun's part: one task per node with SLURM_NODEID set, SIGTERM passed on, the highest exit code returned.
SRUN = """#!{python}
import os, signal, subprocess, sys
command = [a for a in sys.argv[1:] if not a.startswith("--")][:1]
command = sys.argv[sys.argv.index(command[0]):]
tasks = [subprocess.Popen(command, env={{**os.environ, "SLURM_NODEID": str(n), "SLURM_PROCID": str(n)}})
         for n in range(int(os.environ["SLURM_NNODES"]))]
signal.signal(signal.SIGTERM, lambda s, f: [t.send_signal(s) for t in tasks])
sys.exit(max(t.wait() for t in tasks))
"""
# scontrol's part: the allocation's host names, and a record of requeue requests.
SCONTROL = """#!/bin/bash
case "$1 $2" in
  "show hostnames") echo 127.0.0.1; echo 127.0.0.1 ;;
  requeue*) echo "requeue $2" >> "{log}" ;;
  *) exit 1 ;;
esac
"""
RUN = [
    "--backend", "ddp", "--gpus", "1", "train.max_steps=10", "train.learning_rate=1e-4",
    "train.lr_scheduler=constant", "train.log_every_steps=1", "train.global_batch_size=8",
    "train.micro_batch_size=4", "data.max_length=64", "eval.max_batches=1", "eval.exact_match_samples=0",
]  # fmt: skip


def stand_ins(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(SRUN.format(python=sys.executable))
    (bin_dir / "scontrol").write_text(SCONTROL.format(log=tmp_path / "scontrol.log"))
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    return bin_dir


def slurm_env(bin_dir, restart: int) -> dict:
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FTKIT": f"{sys.executable} -m toolkit.commands.cli",
        "SLURM_JOB_ID": "4242",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_SUBMIT_DIR": str(REPO),
        "SLURM_RESTART_COUNT": str(restart),
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
    }


def start(out, env) -> subprocess.Popen:
    return subprocess.Popen(
        ["bash", str(SCRIPT), *RUN, f"output_dir={out}"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def test_two_nodes_stop_on_sigterm_requeue_on_one_and_match_an_uninterrupted_run(tmp_path):
    bin_dir = stand_ins(tmp_path)
    out = tmp_path / "job"
    job = start(out, slurm_env(bin_dir, restart=0))
    deadline = time.monotonic() + 300
    while len(step_losses(out)) < 2 and time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.2)
    job.send_signal(signal.SIGTERM)  # --signal=B:TERM: the batch shell only
    stdout, stderr = job.communicate(timeout=300)
    assert job.returncode == 75, stdout[-2000:] + stderr[-4000:]
    assert "--num_machines 2 --machine_rank 0 --main_process_ip 127.0.0.1" in stdout
    assert "stopped by SIGTERM after step" in stdout
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    stopped = len(step_losses(out))
    assert 2 <= stopped < 10

    # The requeued job gets one node where it had two, as a spot or preempted allocation may.
    rerun = start(out, {**slurm_env(bin_dir, restart=1), "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "node1"})
    stdout, stderr = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, stdout[-2000:] + stderr[-4000:]
    assert "on 1 node(s)" in stdout and "| world 1 |" in stdout
    assert f"resumed from {out / 'checkpoints' / f'step-{stopped}'}" in stdout

    straight = tmp_path / "straight"
    command = [sys.executable, "-m", "toolkit.commands.cli", "train", *RUN[:2], *RUN[4:]]
    env = {**slurm_env(bin_dir, 0), "SLURM_NNODES": "1", "SLURM_NODEID": "0"}
    done = subprocess.run(
        [*command, f"output_dir={straight}", "--gpus", "2"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert step_losses(out) == pytest.approx(step_losses(straight), rel=1e-5)
