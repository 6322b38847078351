"""Accelerate configs as other projects ship them (tests/e2e/peer_configs/): accelerate-native DeepSpeed
settings without a JSON, a DeepSpeed JSON with concrete numbers, and FSDP1 as `accelerate config` writes
it, train on 2 gloo processes like one; FSDP1 also checkpoints, resumes and exports.

Launches: started warm (tests/warm.py; `FTKIT_TEST_LAUNCH=real` for the real launcher): accelerate's own
launcher still reads each peer config.
"""

import shutil
from pathlib import Path

import pytest
import torch
from helpers import free_port, launch, run_recipe, step_losses
from safetensors.torch import load_file

from toolkit.checkpoint.export import verify_export
from toolkit.commands import cli
from toolkit.launch.checks import launch_from_yaml

PEERS = Path(__file__).parent / "peer_configs"
SETTINGS = ["train.max_steps=6", "train.save_every_steps=3"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("peer-single") / "run"
    run_recipe(out, *SETTINGS, launch=launch("single", 1))
    return step_losses(out)


def peer(config: str) -> list[str]:
    return ["--config_file", str(PEERS / f"{config}.yaml"), "--main_process_port", str(free_port())]


@pytest.fixture(scope="module")
def fsdp1_lora(tmp_path_factory):
    out = tmp_path_factory.mktemp("peer-fsdp1") / "run"
    return out, run_recipe(out, *SETTINGS, launch=peer("fsdp1"))


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "config, backend_line",
    [
        ("zero3_native", "backend deepspeed ZeRO-3 (gloo)"),
        ("zero2_concrete", "backend deepspeed ZeRO-2 (gloo)"),
        ("zero3_alt_gather", "backend deepspeed ZeRO-3 (gloo)"),
    ],
)
def test_peer_deepspeed_config_trains_like_one_process(config, backend_line, one_process, tmp_path):
    out = tmp_path / "run"
    result = run_recipe(out, *SETTINGS, launch=peer(config))
    assert backend_line in result.stdout and "| world 2 |" in result.stdout
    assert len(step_losses(out)) == 6
    assert step_losses(out) == pytest.approx(one_process, rel=1e-3)
    assert (out / "checkpoints" / "step-3").is_dir() and (out / "final").is_dir()


@pytest.mark.multiproc
def test_peer_fsdp1_config_trains_like_one_process_and_exports(fsdp1_lora, one_process):
    launched = launch_from_yaml(PEERS / "fsdp1.yaml", gpu_count=0)
    assert (launched.backend, launched.fsdp_version, launched.world_size) == ("fsdp", 1, 2)
    out, result = fsdp1_lora
    assert "backend fsdp1 (gloo)" in result.stdout and "| world 2 |" in result.stdout
    assert step_losses(out) == pytest.approx(one_process, rel=1e-3)
    assert "[after] sample:" in result.stdout  # generation ran on the sharded model
    assert "Warning" not in result.stderr  # torch's deprecations inside FSDP1 checkpointing are filtered
    assert (out / "checkpoints" / "step-3" / "pytorch_model_fsdp_0").is_dir()
    assert verify_export(out / "final") > 0
    adapter = load_file(out / "final" / "adapter_model.safetensors")
    assert all(t.abs().sum() > 0 for name, t in adapter.items() if "lora_B" in name)  # trained, not zeros


@pytest.mark.multiproc
def test_peer_fsdp1_resumes_exactly_and_its_checkpoint_exports(fsdp1_lora, tmp_path):
    source, _ = fsdp1_lora
    exported = tmp_path / "export"
    assert cli.main(["export", str(source / "checkpoints" / "step-6"), "--out", str(exported)]) == 0
    got, final = (load_file(d / "adapter_model.safetensors") for d in (exported, source / "final"))
    assert got.keys() == final.keys() and all(torch.equal(got[k], final[k]) for k in final)

    out = tmp_path / "resumed"
    shutil.copytree(source, out)
    shutil.rmtree(out / "final")
    shutil.rmtree(out / "checkpoints" / "step-6")
    result = run_recipe(out, *SETTINGS, launch=peer("fsdp1"))
    assert "resumed from" in result.stdout and "step-3 at step 3" in result.stdout
    # Steps 5 and 6 follow updates made with the restored Adam moments: zeros would change both losses.
    assert step_losses(out) == pytest.approx(step_losses(source), rel=1e-6)


@pytest.mark.multiproc
def test_peer_fsdp1_full_fine_tune_trains_and_exports_like_one_process(tmp_path):
    full = [*SETTINGS, "model.method=full", "train.learning_rate=1e-4"]
    single, fsdp1 = tmp_path / "single", tmp_path / "fsdp1"
    run_recipe(single, *full, launch=launch("single", 1))
    run_recipe(fsdp1, *full, launch=peer("fsdp1"))
    assert step_losses(fsdp1) == pytest.approx(step_losses(single), rel=1e-3)
    assert verify_export(fsdp1 / "final") > 0
    got, expected = (load_file(run / "final" / "model.safetensors") for run in (fsdp1, single))
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.multiproc
def test_peer_fsdp1_full_state_dict_config_trains_and_checkpoints(one_process, tmp_path):
    # As TRL ships it (FULL_STATE_DICT, bf16 in the YAML), with the one fix docs/backends.md names for fp32.
    out = tmp_path / "run"
    result = run_recipe(out, *SETTINGS, launch=[*peer("fsdp1_full"), "--mixed_precision", "no"])
    assert "backend fsdp1 (gloo)" in result.stdout and "[before] sample:" in result.stdout
    assert step_losses(out) == pytest.approx(one_process, rel=1e-3)
    assert (out / "checkpoints" / "step-3" / "pytorch_model_fsdp_0").is_dir()
    assert verify_export(out / "final") > 0


@pytest.mark.multiproc
def test_peer_config_refused_by_plain_accelerate_launch_in_one_line_writing_nothing(tmp_path):
    out = tmp_path / "run"
    result = run_recipe(out, *SETTINGS, launch=peer("context_parallel"), check=False)
    # torchrun turns the recipe's exit 2 into its own 1 and reports the worker's code.
    assert result.returncode != 0 and "failed (exitcode: 2)" in result.stderr
    refusals = [line for line in result.stderr.splitlines() if line.startswith("finetune_llm: error:")]
    assert (
        len(refusals) == 1 and "parallelism_config_cp_size 2 is refused: context parallelism" in refusals[0]
    )
    assert not out.exists()
