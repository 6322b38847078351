"""The families of 2025-26 on sharded backends: a hybrid with gated DeltaNet layers (Qwen3.5), multi-head
latent attention with routed experts (DeepSeek-V3), a Mamba-2 hybrid with experts (Nemotron-H) and a
short-convolution hybrid (LFM2), each trained with LoRA on packed rows (the hybrids' recurrent layers run
per example) under ZeRO-3 and FSDP2 on 2 gloo processes, with one process's per-step losses on the same
global batch, and exported (Qwen3.5's full fine-tuning too, whose ZeRO-3 export kept a legacy prefix);
Gemma-4 (natively image-text-to-text) on rows with images in every data layout, under ZeRO-3 (its towers
partitioned) against one process.

Launches: started warm (tests/warm.py; `FTKIT_TEST_LAUNCH=real` for the real launcher): what is tested is
the model under each backend, and every shipped config keeps a real launch elsewhere.
"""

import pytest
from helpers import assert_same_weights, final_weights, image_layouts, launch, logged, run_recipe, step_losses
from tiny_families import tiny_family
from tiny_vision_families import tiny_gemma4

pytestmark = pytest.mark.multiproc

STEPS = 3
SETTINGS = [f"train.max_steps={STEPS}", "train.learning_rate=2e-3", "eval.max_batches=1", "data.packing=true"]
# What a packed run of each family says of its recurrent layers.
PER_EXAMPLE = {
    "qwen3_5_text": "packing: qwen3_5_text's gated DeltaNet layers run each example on its own",
    "nemotron_h": "packing: nemotron_h's Mamba-2 layers run each example on its own",
    "lfm2": "packing: lfm2's short convolution layers run each example on its own",
    "deepseek_v3": "",
}
UNION = "train.micro_batch_size=8"  # one process's micro-batch: the two processes' 4 rows each together
BACKENDS = {"fsdp": "backend fsdp2 (gloo)", "zero3": "backend deepspeed ZeRO-3"}
FAMILIES = ("qwen3_5_text", "deepseek_v3", "nemotron_h", "lfm2")
CASES = [(family, backend) for family in FAMILIES for backend in BACKENDS]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """family -> (its settings, the output_dir of one process on the union micro-batch), trained once when
    first asked for."""
    done = {}

    def get(family: str):
        if family not in done:
            model = tiny_family(tmp_path_factory.mktemp(family) / "model", family)
            settings = [f"model.path={model}", *SETTINGS]
            out = tmp_path_factory.mktemp(f"{family}-single") / "run"
            run_recipe(out, *settings, UNION, launch=launch("single", 1))
            done[family] = settings, out
        return done[family]

    return get


@pytest.mark.parametrize("family, backend", CASES, ids=[f"{f}-{b}" for f, b in CASES])
def test_a_2026_family_trains_like_one_process(family, backend, single, tmp_path):
    settings, reference = single(family)
    out = tmp_path / "run"
    result = run_recipe(out, *settings, launch=launch(backend))
    assert BACKENDS[backend] in result.stdout
    assert "lora: adapters on " in result.stdout and PER_EXAMPLE[family] in result.stdout
    assert len(step_losses(out)) == STEPS
    assert step_losses(out) == pytest.approx(step_losses(reference), rel=1e-3)
    assert logged(out, "grad_norm") == pytest.approx(logged(reference, "grad_norm"), rel=1e-4)
    assert (out / "final" / "adapter_model.safetensors").is_file()


@pytest.fixture(scope="module")
def gemma4_runs(tmp_path_factory):
    """Gemma-4's settings on the image layouts and its one-process run."""
    root = tmp_path_factory.mktemp("gemma4")
    data = image_layouts(root / "layouts")
    model = tiny_gemma4(root / "model")
    settings = [
        f"model.path={model}",
        f"data.train=[{','.join(str(p) for p in data)}]",
        "data.eval=null",
        "data.eval_fraction=0.1",
        "data.max_length=160",
        "train.learning_rate=1e-2",
        f"train.max_steps={STEPS}",
    ]
    out = root / "single"
    run_recipe(out, *settings, launch=launch("single", 1))
    return settings, out


def test_gemma4_trains_on_image_rows_under_zero3_like_one_process(gemma4_runs, tmp_path):
    settings, reference = gemma4_runs
    out = tmp_path / "run"
    result = run_recipe(out, *settings, launch=launch("zero3"))
    assert BACKENDS["zero3"] in result.stdout and "vision: " in result.stdout
    assert len(step_losses(out)) == STEPS
    assert step_losses(out) == pytest.approx(step_losses(reference), rel=1e-3)
    assert logged(out, "grad_norm") == pytest.approx(logged(reference, "grad_norm"), rel=1e-4)
    assert (out / "final" / "adapter_model.safetensors").is_file()


def test_qwen3_5_full_fine_tuning_under_zero3_exports_like_one_process(single, tmp_path):
    settings, _ = single("qwen3_5_text")
    full = [*settings, "model.method=full", "train.learning_rate=1e-4"]
    run_recipe(tmp_path / "one", *full, UNION, launch=launch("single", 1))
    run_recipe(tmp_path / "zero3", *full, launch=launch("zero3"))
    assert step_losses(tmp_path / "zero3") == pytest.approx(step_losses(tmp_path / "one"), rel=1e-3)
    one, sharded = final_weights(tmp_path / "one"), final_weights(tmp_path / "zero3")
    assert sharded.keys() == one.keys() and any(
        name.startswith("model.layers.0.linear_attn.") for name in one
    )
    assert_same_weights(sharded, one)
