"""examples/skypilot/train.yaml without a cloud: SkyPilot's own loader reads it (when installed), and its
`run:` script, run by bash with SkyPilot's variables for one node or each of two and a stand-in `ftkit`,
gives a command that ftkit's parser takes and plans into the launch each node needs."""

import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import yaml
from helpers import REPO

from toolkit.commands import cli, train
from toolkit.launch.machine import Machine
from toolkit.recipes import load_recipe_config

TASK = REPO / "examples" / "skypilot" / "train.yaml"
ENVS = [("CHECKPOINT_BUCKET", "ftkit-test-checkpoints"), ("HF_TOKEN", "hf_test")]
# Records its arguments where the run script's `.venv/bin/ftkit` would have trained.
STAND_IN = """#!{python}
import json, os, sys
open(os.environ["ARGV_FILE"], "w").write(json.dumps(sys.argv[1:]))
"""
HEAD, PEER = "10.0.0.1", "10.0.0.2"
# A node of the task's first choice (H100:2); --gpus from the run script decides how many it uses.
NODE = Machine(gpu_count=2, gpu_mem_gib=80.0, ram_gib=128.0)


@pytest.fixture(scope="module")
def task() -> dict:
    return yaml.safe_load(TASK.read_text())


def mount_path(task: dict) -> Path:
    (path,) = task["file_mounts"]
    return Path(path)


def test_the_task_asks_for_spot_gpus_on_any_cloud_a_bucket_and_recovery(task):
    resources = task["resources"]
    assert resources["use_spot"] is True and "cloud" not in resources and "infra" not in resources
    assert resources["job_recovery"]["max_restarts_on_errors"] > 0
    assert {accelerator.split(":")[1] for accelerator in resources["accelerators"]} == {"1", "2"}
    bucket = task["file_mounts"][str(mount_path(task))]
    assert bucket == {"name": "${CHECKPOINT_BUCKET}", "mode": "MOUNT_CACHED"}
    assert task["envs"] == {"CHECKPOINT_BUCKET": None, "HF_TOKEN": None}  # given at launch
    assert task["setup"].split() == ["make", "install"] and task["workdir"] == "."


def test_skypilot_loads_the_task_for_one_node_or_two(task, tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(tmp_path_factory.mktemp("home")))  # sky keeps its state under ~/.sky
        sky = pytest.importorskip("sky", reason="SkyPilot is not installed (the `skypilot` extra)")
        with pytest.raises(ValueError, match="CHECKPOINT_BUCKET"):
            sky.Task.from_yaml(str(TASK))
        loaded = sky.Task.from_yaml_config(yaml.safe_load(TASK.read_text()), env_overrides=ENVS)
        loaded.num_nodes = 2  # what `sky jobs launch --num-nodes 2` sets
    assert loaded.run == task["run"] and loaded.num_nodes == 2
    assert all(r.use_spot and r.cloud is None for r in loaded.resources)
    assert all(r.job_recovery == task["resources"]["job_recovery"] for r in loaded.resources)
    ((path, storage),) = loaded.storage_mounts.items()
    assert (Path(path), storage.name, storage.mode.value) == (mount_path(task), ENVS[0][1], "MOUNT_CACHED")


def run_script(task: dict, tmp_path: Path, nodes: int, rank: int, gpus: int) -> list[str]:
    """The arguments the run script gives `ftkit` under bash on node `rank` of `nodes`, `gpus` each."""
    stand_in = tmp_path / ".venv" / "bin" / "ftkit"
    stand_in.parent.mkdir(parents=True)
    stand_in.write_text(STAND_IN.format(python=sys.executable))
    stand_in.chmod(0o755)
    env = {
        **os.environ,
        "ARGV_FILE": str(tmp_path / "argv.json"),
        "SKYPILOT_NUM_NODES": str(nodes),
        "SKYPILOT_NODE_RANK": str(rank),
        "SKYPILOT_NODE_IPS": "\n".join([HEAD, PEER][:nodes]),
        "SKYPILOT_NUM_GPUS_PER_NODE": str(gpus),
    }
    done = subprocess.run(["bash", "-c", task["run"]], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads((tmp_path / "argv.json").read_text())


def parsed(argv: list[str]):
    """ftkit's own parser on argv, stopped before it would launch anything."""
    calls = []
    with mock.patch.object(cli, "_run", side_effect=lambda args: calls.append(args) or 0):
        assert cli.main(argv) == 0
    return calls[0]


@pytest.mark.parametrize(
    ("nodes", "rank", "gpus"),
    [(1, 0, 2), (1, 0, 1), (2, 0, 2), (2, 1, 2)],
    ids=["2gpu", "1gpu", "head", "peer"],
)
def test_each_node_runs_ftkit_train_resuming_into_the_bucket(task, tmp_path, nodes, rank, gpus):
    args = parsed(run_script(task, tmp_path, nodes, rank, gpus))
    assert args.command == "train" and args.backend == "auto" and args.gpus == gpus
    assert (REPO / args.config).is_file(), args.config
    name, overrides = train.split_items(args.items, args.config)
    assert "train.resume=auto" in overrides
    (output_dir,) = [item.split("=", 1)[1] for item in overrides if item.startswith("output_dir=")]
    assert Path(output_dir).is_relative_to(mount_path(task)) and Path(output_dir) != mount_path(task)

    cfg = load_recipe_config(name, args.config, overrides)
    nodes_seen = train.resolve_nodes(args, {})
    plan = train.plan_launch(args, overrides, cfg, NODE, nodes_seen, train.recipe_path(name))
    assert plan.processes == nodes * gpus and plan.per_node == gpus
    # The main process writes model and optimizer: nothing sharded crosses the nodes' separate mounts.
    assert plan.backend == ("single" if nodes * gpus == 1 else "ddp"), plan.reason
    if nodes > 1:
        at = plan.argv.index("--num_machines")
        assert plan.argv[at : at + 6] == [
            "--num_machines", str(nodes), "--machine_rank", str(rank), "--main_process_ip", HEAD
        ]  # fmt: skip
    else:
        assert "--num_machines" not in plan.argv
