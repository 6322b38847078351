"""Accelerate configs as other projects ship them (tests/e2e/peer_configs/): accelerate-native DeepSpeed
settings without a JSON, and a DeepSpeed JSON with concrete numbers, train on 2 gloo processes like one."""

from pathlib import Path

import pytest
from helpers import free_port, launch, run_recipe, step_losses

from toolkit.distributed import refuse_unsupported
from toolkit.errors import UserError
from toolkit.launch_check import launch_from_yaml

PEERS = Path(__file__).parent / "peer_configs"
SETTINGS = ["train.max_steps=6", "train.save_every_steps=3"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("peer-single") / "run"
    run_recipe(out, *SETTINGS, launch=launch("single", 1))
    return step_losses(out)


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "config, backend_line",
    [
        ("zero3_native", "backend deepspeed ZeRO-3 (gloo)"),
        ("zero2_concrete", "backend deepspeed ZeRO-2 (gloo)"),
    ],
)
def test_peer_deepspeed_config_trains_like_one_process(config, backend_line, one_process, tmp_path):
    out = tmp_path / "run"
    peer = ["--config_file", str(PEERS / f"{config}.yaml"), "--main_process_port", str(free_port())]
    result = run_recipe(out, *SETTINGS, launch=peer)
    assert backend_line in result.stdout and "| world 2 |" in result.stdout
    assert len(step_losses(out)) == 6
    assert step_losses(out) == pytest.approx(one_process, rel=1e-3)
    assert (out / "checkpoints" / "step-3").is_dir() and (out / "final").is_dir()


def test_peer_fsdp1_config_reads_as_fsdp1_and_is_refused_without_gpus():
    launched = launch_from_yaml(PEERS / "fsdp1.yaml", gpu_count=0)
    assert (launched.backend, launched.fsdp_version, launched.world_size) == ("fsdp", 1, 2)
    with pytest.raises(UserError, match="asks for FSDP1, which torch runs on GPUs only"):
        refuse_unsupported(launched)
    assert launch_from_yaml(PEERS / "fsdp1.yaml", gpu_count=2).on_cpu is False
