"""Every count, size, cadence, ratio and word a recipe config takes is checked when it loads: a value out of
its declared range stops the recipe with one line naming the key, the value and what is allowed, before
anything is written."""

import typing

import pytest
from helpers import REPO

from toolkit import config, fields, typed_yaml
from toolkit.commands import cli
from toolkit.errors import run_main
from toolkit.plan import request

BAD = [
    ("train.keep_last=-1", "train.keep_last: must be >= 0, got -1"),
    ("train.save_every_steps=-5", "train.save_every_steps: must be >= 0, got -5"),
    ("train.save_every_minutes=-1", "train.save_every_minutes: must be >= 0, got -1.0"),
    ("train.log_every_steps=0", "train.log_every_steps: must be positive, got 0"),
    ("train.eval_every_steps=-1", "train.eval_every_steps: must be >= 0, got -1"),
    ("train.warmup_steps=-1", "train.warmup_steps: must be >= 0, got -1"),
    ("train.max_grad_norm=-1", "train.max_grad_norm: must be >= 0, got -1.0"),
    ("train.min_lr_ratio=5", "train.min_lr_ratio: must be in [0, 1], got 5.0"),
    ("train.weight_decay=-0.1", "train.weight_decay: must be >= 0, got -0.1"),
    ("train.adam_betas=[0.9]", "train.adam_betas: must be a list of 2 values, got [0.9]"),
    ("train.adam_betas=[0.9,1.5]", "train.adam_betas: item 1: must be in [0, 1), got 1.5"),
    ("train.micro_batch_size=0", "train.micro_batch_size: must be positive, got 0"),
    ("train.global_batch_size=-8", "train.global_batch_size: must be positive, got -8"),
    ("train.nonfinite_patience=0", "train.nonfinite_patience: must be positive, got 0"),
    ("train.stall_timeout_minutes=0", "train.stall_timeout_minutes: must be positive, got 0.0"),
    ("lora.r=0", "lora.r: must be positive, got 0"),
    ("lora.alpha=-16", "lora.alpha: must be positive, got -16"),
    ("lora.dropout=1", "lora.dropout: must be in [0, 1), got 1.0"),
    ("data.num_workers=-1", "data.num_workers: must be >= 0, got -1"),
    ("data.max_length=0", "data.max_length: must be positive, got 0"),
    ("data.eval_fraction=1", "data.eval_fraction: must be in [0, 1), got 1.0"),
    ("data.weights=[1,-1]", "data.weights: item 1: must be >= 0, got -1.0"),
    ("eval.max_new_tokens=0", "eval.max_new_tokens: must be positive, got 0"),
    ("eval.max_batches=-1", "eval.max_batches: must be >= 0, got -1"),
    ("eval.exact_match_samples=-3", "eval.exact_match_samples: must be >= 0, got -3"),
    ("seed=-1", "seed: must be in [0, 4294967295], got -1"),
    ("model.method=prefix", "model.method: 'prefix' is not one of full, lora, qlora"),
    ("model.dtype=int8", "model.dtype: 'int8' is not one of float32, bfloat16, float16, auto"),
    ("model.attn_implementation=flash", "model.attn_implementation: 'flash' is not one of auto, sdpa, eager"),
    ("train.lr_scheduler=step", "train.lr_scheduler: 'step' is not one of cosine, linear, constant"),
    ("train.mixed_precision=fp8", "train.mixed_precision: 'fp8' is not one of no, bf16, fp16"),
    ("log.trackers=[foo]", "log.trackers: item 0: 'foo' is not one of tensorboard, wandb, mlflow, trackio"),
]


pytestmark = pytest.mark.usefixtures("signal_handlers_restored")


@pytest.mark.parametrize(("override", "message"), BAD, ids=[b[0] for b in BAD])
def test_out_of_range_value_is_one_line_and_nothing_is_written(recipe, tmp_path, capsys, override, message):
    out = tmp_path / "run"
    extra = ["data.train=[a.jsonl, b.jsonl]"] if override.startswith("data.weights") else []
    code = run_main(recipe.main, [f"output_dir={out}", *extra, override], "finetune_llm")
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"finetune_llm: error: command line: {message}"), lines
    assert "Traceback" not in captured.err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_every_default_passes_its_own_declaration(tmp_path):
    """Each key written out at its default value goes through the same check as a user's value."""
    path = tmp_path / "defaults.yaml"
    typed_yaml.save_config(config.RecipeConfig(), path)
    assert config.load_config(path) == config.RecipeConfig()


def test_every_count_size_and_ratio_key_declares_its_range():
    """No numeric key is left open: each one carries a Range (or a fixed set of words)."""

    def open_keys(cls, prefix=""):
        hints = typing.get_type_hints(cls, include_extras=True)
        for name, hint in hints.items():
            if hasattr(hint, "__dataclass_fields__"):
                yield from open_keys(hint, f"{prefix}{name}.")
            elif hint in (int, float):
                yield prefix + name

    assert list(open_keys(config.RecipeConfig)) == []
    assert list(open_keys(request.PlanRequest)) == []


def test_cli_choices_and_docs_come_from_the_declarations(capsys):
    assert fields.choices(config.Method) == ("full", "lora", "qlora")
    with pytest.raises(SystemExit):
        cli.main(["plan", "--model", "x", "--method", "prefix"])
    assert "choose from 'full', 'lora', 'qlora'" in capsys.readouterr().err
    docs = typed_yaml.field_docs(config.RecipeConfig)
    assert docs["model.method"].endswith("Allowed: one of full, lora, qlora.")
    assert docs["train.min_lr_ratio"].endswith("Allowed: in [0, 1].")
    assert docs["train.adam_betas"].endswith("Allowed: 2 values, each in [0, 1).")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--gpus", "0"], "ftkit plan: error: --gpus must be positive, got 0"),
        (["--lora-dropout", "1"], "ftkit plan: error: --lora-dropout must be in [0, 1), got 1.0"),
        (["--micro-batch", "0"], "ftkit plan: error: --micro-batch must be positive, got 0"),
    ],
)
def test_plan_options_are_checked_by_the_same_declarations(capsys, options, message):
    code = cli.main(["plan", "--model", str(REPO / "toolkit" / "assets" / "tiny-llama"), *options])
    assert code == 2
    assert capsys.readouterr().err.strip() == message


@pytest.mark.parametrize("key", ["model.path", "model.adapter"])
def test_a_missing_model_folder_is_one_line_and_nothing_is_written(recipe, tmp_path, capsys, key):
    """A model (or adapter) folder a run names but that does not exist yet, such as an earlier stage's
    output, stops the recipe before it claims output_dir."""
    out, missing = tmp_path / "run", tmp_path / "earlier" / "final"
    code = run_main(recipe.main, [f"output_dir={out}", f"{key}={missing}"], "finetune_llm")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"finetune_llm: error: {key}: {missing} does not exist"], err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_an_init_adapter_that_cannot_start_the_run_is_one_line_and_nothing_is_written(
    recipe, tmp_path, capsys
):
    """lora.init_adapter missing, or with another rank than lora.r: refused before output_dir is claimed."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16, "use_dora": false}')
    cases = {
        str(tmp_path / "none"): f"lora.init_adapter: {tmp_path / 'none'} is not an adapter directory",
        str(adapter): f"lora.r is 16, the adapter at lora.init_adapter ({adapter}) has 8",
    }
    out = tmp_path / "run"
    for where, message in cases.items():
        code = run_main(recipe.main, [f"output_dir={out}", f"lora.init_adapter={where}"], "finetune_llm")
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and message in err[0], err
        assert not out.exists()
