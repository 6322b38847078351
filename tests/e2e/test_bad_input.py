"""A user's mistake stops the recipe with one line naming the file, line or key, before anything that
looks like a finished model is written.

Launches: started warm (tests/warm.py; `FTKIT_TEST_LAUNCH=real` for the real launcher), except the rank held
back by a sitecustomize of the test's own, which only a fresh interpreter runs (a PYTHONPATH with start-up
code always launches for real).
"""

import json
import os

import pytest
from helpers import launch, recipe_command, run_launched, run_recipe

# Timing-sensitive: make test-e2e runs it with nothing beside it.
pytestmark = pytest.mark.alone


def bad_jsonl(tmp_path):
    path = tmp_path / "broken.jsonl"
    good = json.dumps(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    )
    path.write_text(f"{good}\n{good}\n{{not json\n")
    return path


CASES = {
    "unknown key": (lambda tmp: ["train.max_step=3"], "did you mean train.max_steps?"),
    "malformed jsonl": (
        lambda tmp: [f"data.train={bad_jsonl(tmp)}", "data.eval_fraction=0.5"],
        "broken.jsonl:3",
    ),
    "missing model": (
        lambda tmp: ["model.path=./no/such/model"],
        "model.path: ./no/such/model does not exist",
    ),
    "missing data": (lambda tmp: ["data.train=no/such/file.jsonl"], "no/such/file.jsonl"),
    "qlora on a width the 4-bit kernel cannot take": (
        lambda tmp: ["model.method=qlora"],
        "hidden_size 160 is not a multiple of the 4-bit block size 64 (for QLoRA)",
    ),
    "zero lr": (lambda tmp: ["train.learning_rate=0"], "train.learning_rate: must be positive"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_clear_line(tmp_path, case):
    make_overrides, expected = CASES[case]
    out = tmp_path / "run"
    result = run_recipe(out, *make_overrides(tmp_path), check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("finetune_llm: error:") and expected in last, result.stderr[-2000:]
    assert not (out / "final").exists() and not (out / "checkpoints").exists()


def test_output_dir_of_another_run_is_refused(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("someone else's run")
    result = run_recipe(out, check=False)
    assert result.returncode == 2 and "was not created by ftkit" in result.stderr
    assert (out / "notes.txt").exists()
    result = run_recipe(out, "train.overwrite=true", check=False)
    assert result.returncode == 2 and "was not created by ftkit" in result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


@pytest.mark.real_launch
def test_a_mistake_met_first_by_a_non_main_rank_is_shown_once(tmp_path):
    """Rank 0 is held back at start-up (a sitecustomize of the test's own), so rank 1 meets the launch
    check's refusal first, exits 2 and the launcher ends rank 0 before it can print: the line still shows,
    once."""
    hold = tmp_path / "hold"
    hold.mkdir()
    (hold / "sitecustomize.py").write_text(
        "import os, time\nif os.environ.get('RANK') == '0':\n    time.sleep(120)\n"
    )
    command, env = recipe_command(tmp_path / "run", "train.mixed_precision=fp16", launch=launch("ddp"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hold), env.get("PYTHONPATH")]))
    result = run_launched(command, env, timeout=300)
    shown = [line for line in result.stderr.splitlines() if line.startswith("finetune_llm: error:")]
    assert result.returncode != 0 and len(shown) == 1, result.stderr[-3000:]
    assert "train.mixed_precision fp16 on the command line" in shown[0] and "needs a GPU" in shown[0]
