"""Pipeline parallelism (pipeline.size=2 on pp.yaml, and on pp_ddp.yaml: 2 stages x 2 replicas) runs the real
recipe on gloo CPU processes: one process's per-step loss under each schedule, exact resume, resume across
layouts, plain Hugging Face exports of the whole model.

Each run trains once for the module (a fixture several tests read): the LoRA runs on pp.yaml feed the
export, resume and cross-layout tests as well as the loss comparison.

Launches: started warm (tests/warm.py; `FTKIT_TEST_LAUNCH=real` for the real launcher), except the exact
resumes, which launch pp.yaml and pp_ddp.yaml for real.
"""

import shutil

import pytest
import torch
from helpers import (
    REPO,
    assert_export_is_the_trained_state,
    assert_same_weights,
    final_weights,
    launch,
    logged,
    marker,
    run_recipe,
    step_losses,
)
from safetensors.torch import load_file

from toolkit.checkpoint.export import verify_export
from toolkit.commands import cli

pytestmark = pytest.mark.multiproc

# The whole held-out set (eval.max_batches caps each rank's batches, so a capped set depends on the mesh);
# a few greedy answers, generated through the stages under a pipeline.
STEPS = ["train.max_steps=4", "train.save_every_steps=2", "eval.max_batches=0", "eval.exact_match_samples=4"]
FULL = ["model.method=full", "train.learning_rate=1e-4", *STEPS]
LORA = ["model.method=lora", "train.learning_rate=1e-3", *STEPS]
PP = ["pipeline.size=2"]
INTERLEAVED = [*PP, "pipeline.schedule=interleaved_1f1b", "pipeline.chunks_per_process=2"]
# The global batch of 8 over 2 replicas in micro-batches of 2: each pipeline steps 2 micro-batches (1F1B
# needs at least as many as stages).
MICRO_2 = ["train.micro_batch_size=2"]

# Preference tuning from the base model: LoRA (reference: the adapter switched off) and full (reference
# log-probs computed before training), both through the stages under a pipeline.
DPO = ["train.max_steps=2", "train.save_every_steps=2", "eval.max_batches=0", "model.adapter=null"]
DPO_LORA = [*DPO, "model.method=lora"]
DPO_CONFIG = str(REPO / "recipes" / "configs" / "demo-dpo.yaml")
DPO_RECIPE = REPO / "recipes" / "dpo_llm.py"

# name -> (recipe overrides, accelerate config and processes, or None for one plain process); names with
# "dpo" run the preference recipe.
RUNS = {
    "single-dpo-lora": (DPO_LORA, None),
    "pp-dpo-lora": ([*DPO_LORA, *PP], ("pp", 2)),
    "single-full": (FULL, None),
    "single-lora": (LORA, None),
    "pp-full": ([*FULL, *PP], ("pp", 2)),
    "pp_interleaved-lora": ([*LORA, *INTERLEAVED], ("pp", 2)),
    "pp_ddp-lora": ([*LORA, *PP, *MICRO_2], ("pp_ddp", 4)),
}


def answers(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if "] sample: " in line]


def launcher(where: tuple[str, int] | None) -> list[str] | None:
    return None if where is None else launch(*where)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (output_dir, result), each trained once for the module when first asked for."""
    done = {}

    def get(name: str):
        if name not in done:
            overrides, where = RUNS[name]
            out = tmp_path_factory.mktemp(name) / "run"
            recipe = dict(config=DPO_CONFIG, recipe=DPO_RECIPE) if "dpo" in name else {}
            done[name] = (out, run_recipe(out, *overrides, launch=launcher(where), **recipe))
        return done[name]

    return get


CASES = {  # run -> (its one-process twin, the start-up line's backend, the pipeline's line, world size)
    "pp-full": (
        "single-full",
        "backend pp 2 (gloo) | world 2 |",
        "pipeline: 2 processes, 1f1b, 2 micro-batches per step; decoder layers per stage [2, 2]",
        2,
    ),
    "pp_interleaved-lora": (
        "single-lora",
        "backend pp 2 (gloo) | world 2 |",
        "pipeline: 2 processes, 2 chunks per process, interleaved_1f1b, 2 micro-batches per step; "
        "decoder layers per stage [1, 1, 1, 1]",
        2,
    ),
    "pp_ddp-lora": (
        "single-lora",
        "backend pp 2 x ddp 2 (gloo) | world 4 |",
        "pipeline: 2 processes, 1f1b, 2 micro-batches per step; decoder layers per stage [2, 2]",
        4,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_trains_saves_exports_like_one_process(name, runs):
    twin, backend_line, pipeline_line, world = CASES[name]
    out, result = runs(name)
    reference, _ = runs(twin)
    assert backend_line in result.stdout and pipeline_line in result.stdout
    assert step_losses(out) == pytest.approx(step_losses(reference), rel=1e-3)
    # A gradient scaled by the micro-batches or the stages would hide under Adam; not in the norm.
    assert logged(out, "grad_norm") == pytest.approx(logged(reference, "grad_norm"), rel=1e-3)
    assert logged(out, "eval_tokens") == logged(reference, "eval_tokens")
    assert logged(out, "tokens_seen") == logged(reference, "tokens_seen")
    assert logged(out, "eval_loss") == pytest.approx(logged(reference, "eval_loss"), rel=1e-5)
    # Greedy answers through the stages are the whole model's: exact match and the sample answers.
    assert logged(out, "exact_match") == logged(reference, "exact_match")
    assert answers(result.stdout) == answers(runs(twin)[1].stdout) and len(answers(result.stdout)) == 2
    for step in (2, 4):
        saved = marker(out, step)
        assert (saved["world_size"], saved["pp_size"], saved["tp_size"]) == (world, 2, 1)
    assert verify_export(out / "final") > 0  # plain files from_pretrained loads, every layer's tensors
    assert_export_is_the_trained_state(out)
    assert_same_weights(final_weights(out), final_weights(reference))


def test_pipeline_batch_split_is_by_replicas(runs):
    """The processes of one pipeline share their batches: only the replicas split the global batch."""
    _, result = runs("pp-full")
    assert "global batch 8 = micro 4 x GA 2 x data-parallel 1 (world 2 / pp 2)" in result.stdout
    _, result = runs("pp_ddp-lora")
    assert "global batch 8 = micro 2 x GA 2 x data-parallel 2 (world 4 / pp 2)" in result.stdout


# The interleaved schedule's resume is the same checkpoint code as 1F1B's (folded).
@pytest.mark.real_launch
@pytest.mark.parametrize("name", ["pp-full", "pp_ddp-lora"])
def test_pipeline_resumes_exactly(name, runs, tmp_path):
    source, _ = runs(name)
    overrides, where = RUNS[name]
    out = tmp_path / "run"
    shutil.copytree(source, out)
    shutil.rmtree(out / "checkpoints" / "step-4")
    shutil.rmtree(out / "final")
    result = run_recipe(out, *overrides, "train.resume=auto", launch=launcher(where))
    assert "resumed from" in result.stdout and "step-2 at step 2" in result.stdout
    # The same processes redo the same sums in the same order: steps 3 and 4, bit for bit.
    assert step_losses(out)[2:] == step_losses(source)[2:]
    assert logged(out, "grad_norm")[2:] == logged(source, "grad_norm")[2:]
    exported, expected = final_weights(out), final_weights(source)
    assert exported.keys() == expected.keys() and all(torch.equal(exported[k], expected[k]) for k in expected)


# Each direction once, full fine-tuning (every moment) out of the stages and LoRA into them; the other two
# pairings passed too and were folded.
CROSS = {  # id -> (checkpoint's run, the continuing run's overrides and launch, how its marker reads)
    "pp-full-to-single": ("pp-full", (FULL, None), "MULTI_CPU world 2 pp 2"),
    "single-lora-to-pp": ("single-lora", ([*LORA, *INTERLEAVED], ("pp", 2)), "NO world 1"),
}


@pytest.mark.parametrize("case", list(CROSS))
def test_checkpoint_continues_on_another_layout_with_its_optimizer(case, runs, tmp_path):
    """Through the portable path: a stage's layers from the whole weights, the moments by name (a
    one-process optimizer.bin keeps them by position, named in the whole model's order), the schedule at
    its step."""
    name, (overrides, where), saved_as = CROSS[case]
    source, _ = runs(name)
    out = tmp_path / "run"
    resume = f"train.resume={source / 'checkpoints' / 'step-2'}"
    result = run_recipe(out, *overrides, resume, launch=launcher(where))
    assert (
        f"resumed weights, optimizer and learning-rate schedule from a {saved_as} checkpoint" in result.stdout
    )
    assert step_losses(out) == pytest.approx(step_losses(source)[2:], rel=1e-3)
    assert logged(out, "lr") == pytest.approx(logged(source, "lr")[2:], rel=1e-6)
    assert_same_weights(final_weights(out), final_weights(source))


def test_ftkit_export_of_a_pipeline_checkpoint_gives_the_final_adapter(runs, tmp_path):
    out, _ = runs("pp_interleaved-lora")
    assert cli.main(["export", str(out / "checkpoints" / "step-4"), "--out", str(tmp_path / "export")]) == 0
    exported, final = load_file(tmp_path / "export" / "adapter_model.safetensors"), final_weights(out)
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)


@pytest.mark.parametrize("name, twin", [("pp-dpo-lora", "single-dpo-lora")])
def test_preference_recipe_through_the_stages_is_one_process(name, twin, runs):
    """Policy and reference log-probs through the stages (the adapter off), the pair objective on the last
    stage: the per-step loss, rewards and held-out metrics of one process. (Full fine-tuning, its reference
    precomputed through the stages, passed too and was folded.)"""
    out, result = runs(name)
    reference, _ = runs(twin)
    assert "backend pp 2" in result.stdout
    for key in ("loss", "grad_norm", "reward_margin", "logps_chosen", "eval_loss", "eval_reward_margin"):
        assert logged(out, key) == pytest.approx(logged(reference, key), rel=1e-3, abs=1e-6), key
    assert logged(out, "exact_match") == logged(reference, "exact_match")
    assert verify_export(out / "final") > 0
