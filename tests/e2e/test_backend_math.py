"""Launches the recipe tests do not make, on gloo CPU processes, with a minimal training script: two
"machines" on loopback, float64 gradients of split layers and pipeline stages, and stock accelerate caught.
Each shipped single-machine config against one process is the real recipe's case (tests/e2e/test_backends.py
and, for tp, tests/e2e/test_model_parallel.py: the same losses, gradient norms and weights).

Launches: one machine's runs are started warm (tests/warm.py; `FTKIT_TEST_LAUNCH=real` for the real launcher):
the math is what they test; the two machines on loopback (multinode_ddp, multinode_zero3) are two real
`accelerate launch` processes, since the multi-machine launch is.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import DS_RECIPE_KEYS, REPO, free_port, run_launched

SCRIPT = REPO / "tests" / "scripts" / "train_tiny.py"
# Backend -> the accelerate distributed type it must run as here (no GPU). ZeRO-1/2 (optimizer states and
# gradients partitioned, whole weights) train the recipe beside the others in tests/e2e/test_backends.py with
# LoRA (losses, gradient norms and weights against one process): full fine-tuning puts more parameters into
# the same partitions, nothing else. ZeRO-3 with offload trains there too. DeepSpeed set up by accelerate's
# own settings, without a JSON, is tests/e2e/test_peer_configs.py's zero3_native.


def launch_tiny(
    config: Path, out: Path, *launcher_args: str, script_args: tuple = (), machines: int = 1
) -> dict:
    """Run tests/scripts/train_tiny.py with `accelerate launch` from the repo root, once per machine."""
    head = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), *launcher_args]
    tail = [str(SCRIPT), "--out", str(out), *script_args]
    ranks = [["--machine_rank", str(r), "--main_process_ip", "127.0.0.1"] for r in range(machines)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    if machines == 1:
        done = run_launched([*head, *tail], env, keep=out, timeout=600)
        assert done.returncode == 0, f"{config.name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-6000:]}"
        return json.loads((out / "result.json").read_text())
    procs = [
        subprocess.Popen(
            [*head, *rank, *tail],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in ranks
    ]
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{config.name} failed:\n{stdout[-2000:]}\n{stderr[-6000:]}"
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    result = launch_tiny(REPO / "accelerate_configs/single.yaml", out)
    assert result["distributed_type"] == "NO" and result["world_size"] == 1
    return result, torch.load(out / "model.pt")


def assert_close(got, expected, what: str) -> None:
    got, expected = torch.as_tensor(got), torch.as_tensor(expected)
    scale = expected.abs().max().clamp_min(1e-12)
    assert ((got - expected).abs().max() / scale).item() < 1e-4, what


def assert_same_math(
    result: dict, out: Path, reference, world: int, per_node: int, ga: int, split: str = ""
) -> None:
    """Same global batch, clipping and steps as one process: same losses, gradient norms and final weights."""
    line = f"| world {world} | {per_node} per node | device cpu | precision no | "
    assert line + f"global batch 8 = micro 2 x GA {ga} x {split or f'world {world}'}" in result["describe"]
    if result["distributed_type"] == "DEEPSPEED":
        assert [result["deepspeed"][k] for k in DS_RECIPE_KEYS] == [8, 2, ga, 0.3]
    ref, ref_weights = reference
    assert len(result["losses"]) == len(ref["losses"]) == 2
    assert_close(result["losses"], ref["losses"], "losses")
    assert_close(result["grad_norms"], ref["grad_norms"], "gradient norms")
    weights = torch.load(out / "model.pt")
    assert weights.keys() == ref_weights.keys()
    for name, tensor in ref_weights.items():
        assert_close(weights[name], tensor, name)


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("config", "distributed_type"), [("multinode_ddp", "MULTI_CPU"), ("multinode_zero3", "DEEPSPEED")]
)
def test_multinode_configs_match_one_process(config, distributed_type, reference, tmp_path):
    """Two "machines" on localhost, 2 processes each, started as the YAML's comments tell a user to."""
    path = REPO / "accelerate_configs" / f"{config}.yaml"
    result = launch_tiny(path, tmp_path / "out", "--main_process_port", str(free_port()), machines=2)
    assert (result["distributed_type"], result["world_size"]) == (distributed_type, 4)
    assert_same_math(result, tmp_path / "out", reference, world=4, per_node=2, ga=1)


@pytest.mark.multiproc
def test_split_layers_give_the_dense_gradients_in_float64(tmp_path):
    """Every adapter and base gradient of a LoRA model split 2 ways equals the whole model's, to rounding."""
    out = tmp_path / "grads.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port"]
    command += [str(free_port()), str(REPO / "tests" / "scripts" / "tp_gradients.py"), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = run_launched(command, env, keep=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    # 2 layers x 7 linears: the frozen weight and one adapter piece split, the other piece whole
    assert result["split_params"] == 2 * 7 * 2
    assert result["grads"] == 2 * 7 * 2  # every adapter matrix, split or whole
    assert result["loss_diff"] < 1e-12 and result["grad_diff"] < 1e-12, result


@pytest.mark.multiproc
def test_pipeline_stages_give_the_whole_model_gradients_in_float64(tmp_path):
    """Every schedule (GPipe, 1F1B, interleaved with 2 chunks per process) on stacked micro-batches with
    right padding, packed rows and filler rows: each parameter's gradient equals the whole model's on the
    examples run alone, to rounding, each parameter held by one stage. The full head's log-probs are float32
    (as the one-process loss it is compared with), so its loss agrees to float32 rounding."""
    out = tmp_path / "grads.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port"]
    command += [str(free_port()), str(REPO / "tests" / "scripts" / "pp_gradients.py"), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = run_launched(command, env, keep=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    cases = {  # case -> (layers per stage, largest loss difference)
        "gpipe": ([2, 2], 1e-12),
        "1f1b": ([2, 2], 1e-12),
        "interleaved_1f1b": ([1, 1, 1, 1], 1e-12),
        "1f1b_full_head": ([2, 2], 1e-6),
    }
    assert result.keys() == cases.keys()
    for case, (split, loss_diff) in cases.items():
        got = result[case]
        assert got["split"] == split and got["grads"] == got["params"] == 4 * 9 + 3, (case, got)
        assert got["grad_diff"] < 1e-12 and got["loss_diff"] < loss_diff, (case, got)


@pytest.mark.multiproc
def test_stock_accelerate_on_cpu_is_caught_by_verify(tmp_path):
    args = ("--num_processes", "2", "--main_process_port", str(free_port()))
    result = launch_tiny(REPO / "accelerate_configs/ddp.yaml", tmp_path, *args, script_args=("--stock",))
    assert "2 processes were launched (ddp, WORLD_SIZE) but accelerate joined 1 (NO)" in result["error"]
