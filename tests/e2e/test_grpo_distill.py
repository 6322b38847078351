"""On-policy distillation end to end: the embedded model (LoRA) distilled from a teacher that is the same
model with a fixed random adapter folded in (an adapter folder naming its base, loaded as model.adapter is),
on the teacher's signal alone. One process and DDP x2 give the same per-step loss and reverse KL, and the
reverse KL falls as the student learns. Two launches, shared by the module's tests."""

from pathlib import Path

import pytest
from helpers import REPO, run_script, start_adapter, train_lines

RECIPE = REPO / "recipes" / "grpo_llm.py"
STEPS = 6


def distill(out: Path, teacher: Path, processes: int = 0, config: str = ""):
    args = [
        f"output_dir={out}",
        "model.adapter=null",
        "train.learning_rate=1e-2",
        f"train.max_steps={STEPS}",
        "train.log_every_steps=1",
        "train.warmup_steps=0",
        "train.lr_scheduler=constant",
        "train.global_batch_size=16",
        "train.micro_batch_size=4",
        "data.max_length=64",
        "data.eval_fraction=0.02",
        "data.eval=null",
        "eval.exact_match_samples=0",
        "eval.max_batches=0",
        "grpo.num_generations=4",
        "grpo.max_new_tokens=8",
        "grpo.steps_per_generation=2",
        "grpo.rewards=[]",
        f"grpo.teacher={teacher}",
    ]
    return run_script(RECIPE, args, out, processes, config)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("distill")
    teacher = start_adapter(folder / "teacher")
    distill(folder / "one", teacher)
    distill(folder / "ddp", teacher, processes=2, config="ddp")
    return train_lines(folder / "one"), train_lines(folder / "ddp")


def test_the_reverse_kl_to_the_teacher_falls(runs):
    one, _ = runs
    assert [r["step"] for r in one] == list(range(1, STEPS + 1))
    kl = [r["teacher_kl"] for r in one]
    assert kl[0] > 0.05, kl  # the teacher is not the student
    assert kl[-1] < 0.7 * kl[0], kl
    assert all(r["reward"] == 0 and r["grad_norm"] > 0 for r in one)


def test_ddp_gives_one_processs_steps(runs):
    one, ddp = runs
    assert [r["step"] for r in ddp] == [r["step"] for r in one]
    scale = max(abs(r["loss"]) for r in one)
    for a, b in zip(one, ddp):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-3 * scale), a["step"]
        for key in ("teacher_kl", "grad_norm", "clip_frac"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-6), (a["step"], key)
