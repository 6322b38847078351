"""recipes/grpo_llm.py end to end on the embedded model: metrics, export, exact resume inside a generation
round and at its end, a user's reward function, and every shipped accelerate config giving one process's
per-step loss, rewards, KL and gradient norm (seeded sampling makes the completions the same).

The rewards are chosen so the bare tiny model's completions differ within a group (the exact-answer reward
is zero for all of them): minus the length, and whether the completion holds a "1". Two optimizer steps per
round and a KL term make the ratio, the clipping and the reference all count.

Launches: started warm (tests/warm.py; `FTKIT_TEST_LAUNCH=real` for the real launcher): what the runs compute
is what is tested.
"""

import shutil
from pathlib import Path

import pytest
from helpers import (
    REPO,
    assert_export_is_the_trained_state,
    run_script,
    short_grpo_args,
    start_adapter,
    tiny_moe,
    train_lines,
)

from toolkit.checkpoint import RECIPE_STATE
from toolkit.commands import cli

RECIPE = REPO / "recipes" / "grpo_llm.py"
STEPS = 4
COMPARED = ("loss", "reward", "kl", "clip_frac", "grad_norm", "completion_len", "advantage_std")


def run_grpo(out: Path, *overrides: str, processes: int = 0, config: str = "", method: str = "lora"):
    args = [
        *short_grpo_args(out, STEPS, 16, 4),
        f"model.method={method}",
        f"train.learning_rate={'2e-3' if method == 'lora' else '2e-4'}",
        "train.save_every_steps=1",
        "data.max_length=64",
        "data.eval_fraction=0.02",
        "grpo.num_generations=4",
        "grpo.max_new_tokens=8",
        "grpo.steps_per_generation=2",
        "grpo.beta=0.05",
        "grpo.rewards=[length,format]",
        "grpo.format_pattern=.*1.*",
        *overrides,
    ]
    return run_script(RECIPE, args, out, processes, config)


def assert_same_steps(expected: list[dict], got: list[dict], rel: float, label: str) -> None:
    """Every compared metric of every step within `rel`; the loss within `rel` of the run's loss scale (its
    largest step loss): its terms cancel (each group's advantages sum to zero), so a step's loss can sit near
    zero, where rounding that is small against the terms is large against the sum (tensor parallel's split
    sums: 4e-6 on a 0.0029 loss whose run peaks at 0.094)."""
    assert [r["step"] for r in got] == [r["step"] for r in expected], label
    scale = max(abs(r["loss"]) for r in expected)
    for a, b in zip(expected, got):
        for key in COMPARED:
            close = {"abs": rel * scale} if key == "loss" else {"rel": rel, "abs": 1e-6}
            assert b[key] == pytest.approx(a[key], **close), (label, a["step"], key)


def resume_from_step(out: Path, step: int) -> None:
    """Leave the run as if it had stopped right after checkpointing `step`."""
    for later in (out / "checkpoints").glob("step-*"):
        if int(later.name[5:]) > step:
            shutil.rmtree(later)
    shutil.rmtree(out / "final")


@pytest.fixture(scope="module", params=["lora", "full"])
def single(request, tmp_path_factory):
    """One process's run and the settings every run of its method repeats: LoRA starts from a trained
    adapter (merged into the base, so it is also the KL reference), which every backend below merges the
    same way; full fine-tuning keeps a separate reference model."""
    folder = tmp_path_factory.mktemp(f"grpo-{request.param}")
    if request.param == "full":
        reference = [f"grpo.reference_model={REPO / 'toolkit' / 'assets' / 'tiny-llama'}"]
    else:
        reference = [f"model.adapter={start_adapter(folder / 'start')}"]
    result = run_grpo(folder / "run", *reference, method=request.param)
    return request.param, folder / "run", result, reference


def test_run_learns_logs_its_metrics_and_exports(single):
    method, out, result, _ = single
    lines = train_lines(out)
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    for key in (*COMPARED, "reward_length", "reward_format", "zero_std_frac", "generation_share"):
        assert key in lines[-1], key
    # Rounds start at steps 1 and 3: only those generate; the second step of a round is off-policy.
    assert [r["generation_s"] > 0 for r in lines] == [True, False, True, False]
    assert lines[0]["kl"] == 0 and lines[1]["kl"] > 0
    assert all(r["grad_norm"] > 0 for r in lines)
    assert len({r["reward"] for r in lines}) > 1
    exported = "adapter_config.json" if method == "lora" else "model.safetensors"
    assert (out / "final" / exported).is_file()
    if method == "lora":  # the adapter it started from goes with the one it trained
        assert (out / "final" / "start_adapter" / "adapter_config.json").is_file()


def test_checkpoints_keep_the_round_in_progress_and_export_like_the_others(single, tmp_path):
    method, out, _, _ = single
    assert (out / "checkpoints" / "step-1" / RECIPE_STATE).is_file()
    assert_export_is_the_trained_state(out)
    if method == "lora":
        assert cli.main(["export", str(out / "checkpoints" / "step-2"), "--out", str(tmp_path / "x")]) == 0
        assert (tmp_path / "x" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("stop_after", [1, 2])
def test_resume_continues_exactly(single, stop_after, tmp_path):
    """Step 1 leaves its round half trained (the resumed run must train on the very same completions);
    step 2 ends it (the resumed run generates the next round itself)."""
    method, out, _, reference = single
    if method == "full" and stop_after == 2:
        pytest.skip("the end of a round is the same code for both methods")
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    resume_from_step(copy, stop_after)
    run_grpo(copy, *reference, method=method)
    assert_same_steps(train_lines(out), train_lines(copy), 1e-6, f"resume after {stop_after}")


def test_a_users_reward_function_from_a_file(tmp_path):
    rewards = tmp_path / "my_rewards.py"
    rewards.write_text(
        "def digits(prompts, completions, answers):\n"
        "    return [sum(ch.isdigit() for ch in c) / 8 for c in completions]\n"
    )
    out = tmp_path / "run"
    run_grpo(
        out,
        f"grpo.rewards=[{rewards}:digits,length]",
        "grpo.reward_weights=[2.0,1.0]",
        "train.max_steps=1",
        "train.save_every_steps=0",
    )
    (line,) = train_lines(out)
    assert line["reward_digits"] > 0
    assert line["reward"] == pytest.approx(2 * line["reward_digits"] + line["reward_length"], abs=1e-9)


# ZeRO-1, ZeRO-3 with offload and HSDP are left to SFT's and DPO's matrices: GRPO's generation sees
# ZeRO-1's parameters as ZeRO-2's, offload moves only the optimizer step, and HSDP's 4 ranks are plain
# data parallelism to GRPO's rollout; fsdp_tp is the mesh whose shares are gathered over both dimensions
# (TP alone, whose rollout takes the plain branch as DDP's does, was folded into it). DDP was folded into
# the MoE case below (DDP, LoRA) and ZeRO-2 into ZeRO-3: both keep whole weights for the rollout, as one
# process does. LoRA runs start from a trained adapter on every backend here.
MATRIX = ["fsdp", "zero3", "fsdp_tp"]
FOUR_PROCESSES = ("fsdp_tp",)  # 2 data-parallel x 2 tensor-parallel
# Full fine-tuning with a separate reference where parameters are sharded or gathered unlike DDP.
FULL_MATRIX = ["fsdp", "zero3"]


@pytest.mark.multiproc
@pytest.mark.parametrize("config", MATRIX)
def test_backend_gives_one_process_steps(config, single, tmp_path):
    method, out, _, reference = single
    if method == "full" and config not in FULL_MATRIX:
        pytest.skip("full fine-tuning here is FSDP's and ZeRO-3's case for the policy and the reference")
    run = tmp_path / "run"
    processes = 4 if config in FOUR_PROCESSES else 2
    run_grpo(run, *reference, "train.save_every_steps=0", processes=processes, config=config, method=method)
    assert_same_steps(train_lines(out), train_lines(run), 1e-3, f"{config} {method}")


@pytest.mark.multiproc
def test_a_mixture_of_experts_gives_one_process_steps_and_router_balance(tmp_path):
    """Qwen3-MoE (LoRA) under DDP against one process whose micro-batch is the two processes' together:
    each process's k-th micro-batch is its half of that one (rollout.share_of), so the router balance,
    pooled over the processes, sees the same tokens, and every step agrees."""
    model = tiny_moe(tmp_path / "moe")
    common = [f"model.path={model}", "moe.router_aux_loss_coef=0.1", "train.save_every_steps=0"]
    run_grpo(tmp_path / "single", *common, "train.micro_batch_size=8")
    run_grpo(tmp_path / "ddp", *common, processes=2, config="ddp")
    expected, got = train_lines(tmp_path / "single"), train_lines(tmp_path / "ddp")
    assert_same_steps(expected, got, 1e-3, "moe ddp")
    balance = [line["router_aux_loss"] for line in expected]
    assert [line["router_aux_loss"] for line in got] == pytest.approx(balance, rel=1e-5)
