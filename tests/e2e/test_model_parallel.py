"""The model-parallel configs (tp.yaml, fsdp_tp.yaml, hsdp.yaml) run the real recipes on gloo CPU processes:
one process's per-step loss, exact resume, resume across layouts, plain Hugging Face exports.

4-process meshes are slow on a small machine: each config trains once per recipe here, and the runs are
module fixtures that several tests read.

Launches: started warm (tests/warm.py; `FTKIT_TEST_LAUNCH=real` for the real launcher), except tp-lora (the
real `ftkit train`), hsdp-full and fsdp_tp's resume, which launch for real (each config's real launch).
"""

import shutil

import pytest
import torch
from helpers import (
    assert_export_is_the_trained_state,
    assert_same_weights,
    final_weights,
    free_port,
    launch,
    logged,
    marker,
    run_ftkit_train,
    run_recipe,
    step_losses,
    write_yaml,
)
from safetensors.torch import load_file

from toolkit.checkpoint.export import verify_export
from toolkit.commands import cli
from toolkit.train.metrics import read_metrics

pytestmark = pytest.mark.multiproc

# The whole held-out set (eval.max_batches caps each rank's batches, so a capped set depends on the mesh).
STEPS = ["train.max_steps=4", "train.save_every_steps=2", "eval.max_batches=0"]
FULL = ["model.method=full", "train.learning_rate=1e-4", *STEPS]
LORA = ["model.method=lora", "train.learning_rate=1e-3", *STEPS]
# The global batch of 8 split over 4 data-parallel processes (hsdp) needs micro-batches of 2.
MICRO_2 = ["train.micro_batch_size=2"]


PLAIN_FSDP_MESH = {
    "distributed_type": "FSDP",
    "num_processes": 2,
    "fsdp_config": {"fsdp_version": 2},
    "parallelism_config": {"parallelism_config_dp_shard_size": 2},
}


def yaml_launch(folder, content: dict) -> list[str]:
    return ["--config_file", str(write_yaml(folder, content)), "--main_process_port", str(free_port())]


def eval_losses(out) -> list[float]:
    return [r["eval_loss"] for r in read_metrics(out / "metrics.jsonl") if "eval_loss" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> output_dir, each trained once for the module when first asked for."""
    done = {}
    recipes = {
        "single-full": lambda out: run_recipe(out, *FULL),
        "single-lora": lambda out: run_recipe(out, *LORA),
        "tp-full": lambda out: run_recipe(out, *FULL, launch=launch("tp")),
        "tp-lora": lambda out: run_ftkit_train(out, "tp", *LORA),
        "fsdp_tp-full": lambda out: run_recipe(out, *FULL, launch=launch("fsdp_tp", 4)),
        "hsdp-full": lambda out: run_recipe(out, *FULL, *MICRO_2, launch=launch("hsdp", 4)),
        # plain FSDP2 written with a parallelism_config, as `accelerate config` may write it
        "fsdp_mesh-full": lambda out: run_recipe(out, *FULL, launch=yaml_launch(out.parent, PLAIN_FSDP_MESH)),
    }

    def get(name: str):
        if name not in done:
            out = tmp_path_factory.mktemp(name) / "run"
            done[name] = (out, recipes[name](out))
        return done[name]

    return get


CASES = {  # run -> (its one-process twin, the start-up line's backend, world size, tp size)
    "tp-full": ("single-full", "backend tp 2 (gloo) | world 2 |", 2, 2),
    "tp-lora": ("single-lora", "backend tp 2 (gloo) | world 2 |", 2, 2),
    "fsdp_tp-full": ("single-full", "backend fsdp2 2 x tp 2 (gloo) | world 4 |", 4, 2),
    "hsdp-full": ("single-full", "backend hsdp 2 x 2 (gloo) | world 4 |", 4, 1),
    "fsdp_mesh-full": ("single-full", "backend fsdp2 (gloo) | world 2 |", 2, 1),
}


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.real_launch) if n in ("hsdp-full", "tp-lora") else n for n in CASES],
)
def test_mesh_trains_saves_exports_like_one_process(name, runs):
    twin, line, world, tp = CASES[name]
    out, result = runs(name)
    reference, _ = runs(twin)
    assert line in result.stdout
    assert step_losses(out) == pytest.approx(step_losses(reference), rel=1e-3)
    # Adam would hide a gradient scaled by the TP size; the norm and the counted tokens would not.
    assert logged(out, "grad_norm") == pytest.approx(logged(reference, "grad_norm"), rel=1e-3)
    assert logged(out, "eval_tokens") == logged(reference, "eval_tokens")
    assert logged(out, "tokens_seen") == logged(reference, "tokens_seen")
    for step in (2, 4):
        saved = marker(out, step)
        assert (saved["world_size"], saved["tp_size"]) == (world, tp)
    assert verify_export(out / "final") > 0  # plain files from_pretrained loads, whole tensors
    assert_export_is_the_trained_state(out)
    # The trained model against one process's: its held-out loss, and (full fine-tunes) each weight. LoRA's
    # B matrices start at zero, so after 4 Adam steps an element is all update, and rounding in the
    # split sums moves some by a few percent of the tensor's scale (measured 1.9%, with eval losses equal).
    assert eval_losses(out) == pytest.approx(eval_losses(reference), rel=1e-5)
    if name.endswith("-full"):
        assert_same_weights(final_weights(out), final_weights(reference))


def test_tp_batch_split_is_by_data_parallel_size(runs):
    """Both TP ranks train on the same batches: GA doubles against 2 data-parallel processes."""
    _, result = runs("tp-full")
    assert "global batch 8 = micro 4 x GA 2 x data-parallel 1 (world 2 / tp 2)" in result.stdout
    _, result = runs("fsdp_tp-full")
    assert "global batch 8 = micro 4 x GA 1 x data-parallel 2 (world 4 / tp 2)" in result.stdout


# On the mesh holding both of TP's and FSDP2's splits; TP's own layout comes back through the portable path
# (test_checkpoint_continues_on_another_layout_with_its_optimizer below, one process -> TP).
@pytest.mark.real_launch
@pytest.mark.parametrize("name, config, processes", [("fsdp_tp-full", "fsdp_tp", 4)])
def test_mesh_resumes_exactly(name, config, processes, runs, tmp_path):
    source, _ = runs(name)
    out = tmp_path / "run"
    shutil.copytree(source, out)
    shutil.rmtree(out / "checkpoints" / "step-4")
    shutil.rmtree(out / "final")
    result = run_recipe(out, *FULL, "train.resume=auto", launch=launch(config, processes))
    assert "resumed from" in result.stdout and "step-2 at step 2" in result.stdout
    assert step_losses(out) == pytest.approx(step_losses(source), rel=1e-6)
    assert logged(out, "grad_norm") == pytest.approx(logged(source, "grad_norm"), rel=1e-6)
    assert_same_weights(final_weights(out), final_weights(source))


@pytest.mark.parametrize(
    "name, config, saved_as",
    [("tp-full", "ddp", "MULTI_CPU world 2 tp 2"), ("single-full", "tp", "NO world 1")],
    ids=["tp-to-ddp", "single-to-tp"],
)
def test_checkpoint_continues_on_another_layout_with_its_optimizer(name, config, saved_as, runs, tmp_path):
    """Through the portable path: weights whole or cut into the split model's parts, the moments by name
    (a whole-tensor optimizer.bin keeps them by position, named through the optimizer built the same way),
    the schedule at its step."""
    source, _ = runs(name)
    out = tmp_path / "run"
    result = run_recipe(
        out, *FULL, f"train.resume={source / 'checkpoints' / 'step-2'}", launch=launch(config)
    )
    assert (
        f"resumed weights, optimizer and learning-rate schedule from a {saved_as} checkpoint" in result.stdout
    )
    assert step_losses(out) == pytest.approx(step_losses(source)[2:], rel=1e-5)
    assert logged(out, "lr") == pytest.approx(logged(source, "lr")[2:], rel=1e-6)
    assert_same_weights(final_weights(out), final_weights(source))


# The preference path on a tensor-parallel mesh (a start adapter merged before the split, the adapter-off
# reference, per-token log-probs of the split model) is GRPO's fsdp_tp case (tests/e2e/test_grpo_recipe.py);
# DPO's pair loss adds no collective, and its held-out pass over ranks sharing batches runs in the pipeline's
# DPO case (tests/e2e/test_pipeline.py).


def test_ftkit_export_of_a_split_checkpoint_gives_the_final_adapter(runs, tmp_path):
    out, _ = runs("tp-lora")
    assert cli.main(["export", str(out / "checkpoints" / "step-4"), "--out", str(tmp_path / "export")]) == 0
    exported, final = load_file(tmp_path / "export" / "adapter_model.safetensors"), final_weights(out)
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)
