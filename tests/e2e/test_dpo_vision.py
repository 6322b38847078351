"""recipes/dpo_llm.py on image pairs: a tiny random Qwen2.5-VL (LoRA, its projector trained) learns which
colour a square is from pairs whose chosen answer names the right colour and the rejected one a wrong
colour (TRL's layout, images relative to the data file, a few pairs text only). Two launches: one process
with the live reference (the adapter off), and ZeRO-3 on two with the reference log-probs precomputed,
which gives one process's per-step loss and rewards, so both references met the same pixels as the policy;
each run exports.

Launches: started warm (tests/warm.py; `FTKIT_TEST_LAUNCH=real` for the real launcher): what the runs compute
is what is tested.
"""

import json

import pytest
from helpers import COLOURS, REPO, launch, logged, run_recipe, square_image, step_losses, tiny_qwen_vl

from toolkit.checkpoint.export import verify_export
from toolkit.preference.reference import FILE as REFERENCE_FILE

pytestmark = pytest.mark.multiproc

RECIPE = REPO / "recipes" / "dpo_llm.py"
PAIRS = 24
# Text-only pairs: two among the training pairs, and the odd eval pairs, so that on two processes one
# rank's eval (and reference) batches hold no image while the other's do (the masked stand-in image).
TEXT_ONLY = {5, 11, 21, 23}


def pair_record(i: int, folder) -> dict:
    """Pair `i`: a square of one colour, the right colour chosen over a wrong one."""
    if i in TEXT_ONLY:
        return {"prompt": "Say ok.", "chosen": "ok", "rejected": "no"}
    names = list(COLOURS)
    right, wrong = names[i % len(names)], names[(i + 1 + (i // len(names)) % 3) % len(names)]
    ref = f"img/{i}.png"
    square_image(folder / ref, right)
    question = [{"type": "image"}, {"type": "text", "text": "What colour?"}]
    return {
        "prompt": [{"role": "user", "content": question}],
        "chosen": [{"role": "assistant", "content": right}],
        "rejected": [{"role": "assistant", "content": wrong}],
        "images": [ref],
    }


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo-vision")
    records = [pair_record(i, root / "data") for i in range(PAIRS)]
    train, held = root / "data" / "train.jsonl", root / "data" / "eval.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in records[:20]))
    held.write_text("".join(json.dumps(r) + "\n" for r in records[20:]))
    return tiny_qwen_vl(root / "qwen"), train, held


def run_dpo(out, setup, config: str, processes: int, *overrides: str):
    model, train, held = setup
    return run_recipe(
        out,
        f"model.path={model}",
        "model.adapter=null",
        "model.method=lora",
        "vision.train_projector=true",
        f"data.train={train}",
        f"data.eval={held}",
        "train.learning_rate=1e-2",
        "train.max_steps=3",
        "train.micro_batch_size=2",
        "train.lr_scheduler=constant",
        "eval.exact_match_samples=2",
        "dpo.sft_weight=0",
        *overrides,
        recipe=RECIPE,
        launch=launch(config, processes),
    )


@pytest.fixture(scope="module")
def single(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "run"
    return out, run_dpo(out, setup, "single", 1)


def test_image_pairs_train_and_export(single):
    out, result = single
    assert "20 train pairs" in result.stdout and "0 truncated, 0 dropped" in result.stdout
    assert "vision: qwen2_5_vl" in result.stdout
    losses = step_losses(out)
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert logged(out, "eval_reward_margin")[-1] > 0
    assert len(logged(out, "exact_match")) == 2  # greedy answers to the eval prompts, with their images
    assert verify_export(out / "final") > 0
    assert (out / "final" / "preprocessor_config.json").is_file()


def test_zero3_with_a_precomputed_reference_gives_one_process_loss(single, setup, tmp_path):
    """The one process's reference is live (the adapter switched off), this one precomputed: equal
    rewards mean both met the same pixels. (DDP with the live reference passed too, and was folded.)"""
    expected, _ = single
    out = tmp_path / "run"
    result = run_dpo(out, setup, "zero3", 2, "dpo.precompute_reference=true")
    assert "| world 2 |" in result.stdout
    assert (out / REFERENCE_FILE).is_file()
    assert step_losses(out) == pytest.approx(step_losses(expected), rel=1e-3)
    # Rewards are beta x the policy's log-ratio to the reference: a reference scored on other pixels moves
    # them by whole nats.
    for key in ("rewards_chosen", "rewards_rejected", "eval_reward_margin"):
        assert logged(out, key) == pytest.approx(logged(expected, key), rel=1e-2, abs=1e-4), key
    assert verify_export(out / "final") > 0
