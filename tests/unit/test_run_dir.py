"""A run's output_dir: ftkit deletes only what it wrote, one process writes a run at a time, a path that
cannot hold a run is one line, and a full or read-only disk leaves nothing half-written."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from accelerate import Accelerator
from helpers import REPO, tmpfs

from toolkit import checkpoint
from toolkit.checkpoint import export, rundir
from toolkit.commands import cli
from toolkit.config import RecipeConfig
from toolkit.errors import UserError, run_main
from toolkit.train.metrics import MetricsLog

pytestmark = pytest.mark.usefixtures("signal_handlers_restored")


def edge(recipe, capsys, *argv) -> tuple[int, str]:
    """The recipe run in this process as its command line runs it: (exit code, its one stderr line)."""
    code = run_main(recipe.main, ["train.max_steps=1", "data.max_length=64", *argv], "finetune_llm")
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if "error:" in line]
    assert len(lines) == 1, err[-2000:]
    return code, lines[0]


def finished_run(path):
    """What a finished run leaves (marker, config, metrics, a checkpoint, final/), without training one."""
    (path / "checkpoints" / "step-4").mkdir(parents=True)
    (path / "checkpoints" / "step-4" / checkpoint.MARKER).write_text('{"step": 4}')
    (path / "final").mkdir()
    (path / "final" / "adapter_model.safetensors").write_bytes(b"weights")
    for name in (rundir.CONFIG, "metrics.jsonl"):
        (path / name).write_text("x\n")
    (path / rundir.MARKER).write_text('{"tracker_dirs": []}\n')
    return path


def tree(path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


# --- overwrite and fresh starts --------------------------------------------------------------------------


def test_output_dir_dot_in_a_repository_is_never_touched(recipe, capsys, tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    (repo / ".git").mkdir(parents=True)
    (repo / "train.py").write_text("print('mine')\n")
    (repo / "config.yaml").write_text("mine: true\n")
    before = tree(repo)
    monkeypatch.chdir(repo)
    model = f"model.path={REPO / 'toolkit' / 'assets' / 'tiny-llama'}"  # the repository's, from elsewhere
    code, line = edge(recipe, capsys, "output_dir=.", "train.overwrite=true", model)
    assert code == 2 and "output_dir: . is not empty and was not created by ftkit" in line
    assert tree(repo) == before  # not even a lock file


@pytest.mark.parametrize("overwrite", ["false", "true"])
def test_a_marked_run_holding_a_foreign_file_is_refused(recipe, capsys, tmp_path, overwrite):
    out = finished_run(tmp_path / "run")
    (out / "notes.txt").write_text("my notes")
    before = tree(out)
    code, line = edge(
        recipe, capsys, f"output_dir={out}", f"train.overwrite={overwrite}", "train.resume=never"
    )
    assert code == 2 and "holds files ftkit did not write (notes.txt)" in line
    assert tree(out) == sorted([*before, rundir.LOCK])


def test_a_foreign_folder_inside_checkpoints_is_refused_too(tmp_path):
    out = finished_run(tmp_path / "run")
    (out / "checkpoints" / "my-backup").mkdir()
    with pytest.raises(UserError, match=r"did not write \(checkpoints/my-backup\)"):
        rundir.check_fresh_start(out, overwrite=True, resume="auto")
    with pytest.raises(UserError, match="holds files ftkit did not write"):
        rundir.clear_output_dir(out)
    assert (out / "checkpoints" / "my-backup").is_dir() and (out / "final").is_dir()


def test_a_finished_run_needs_overwrite_and_overwrite_removes_only_ftkits_files(tmp_path):
    out = finished_run(tmp_path / "run")
    for name in rundir.REFERENCE_LOGPS:  # a preference run's precomputed reference is ftkit's too
        (out / name).write_text("{}")
    with pytest.raises(UserError, match="holds another run; set train.overwrite=true"):
        rundir.check_fresh_start(out, overwrite=False, resume="never")
    rundir.check_fresh_start(out, overwrite=True, resume="never")
    lock = rundir.hold_lock(out)
    rundir.clear_output_dir(out)
    assert tree(out) == [rundir.LOCK]  # the lock this process holds stays
    lock.close()


def test_overwrite_unlinks_a_symlink_but_never_follows_it(tmp_path):
    out = finished_run(tmp_path / "run")
    elsewhere = tmp_path / "precious"
    elsewhere.mkdir()
    (elsewhere / "data.bin").write_text("keep me")
    (out / "final" / "adapter_model.safetensors").unlink()
    (out / "final").rmdir()
    (out / "final").symlink_to(elsewhere, target_is_directory=True)
    rundir.clear_output_dir(out)
    assert (elsewhere / "data.bin").read_text() == "keep me" and not (out / "final").exists()


def evaluated_run(path):
    """A finished run that `ftkit eval` then wrote its table into (eval/, recorded in the marker)."""
    out = finished_run(path)
    (out / rundir.EVAL_DIR).mkdir()
    for name in ("20260101-000000.md", "20260101-000000.json"):
        (out / rundir.EVAL_DIR / name).write_text("| task |\n")
    rundir.record_eval(out, ["20260101-000000.md", "20260101-000000.json"])
    return out


def test_an_evaluated_run_is_overwritten_whole(tmp_path):
    out = evaluated_run(tmp_path / "run")
    rundir.record_eval(out, ["20260102-000000.md"])  # a second evaluation adds to the first
    (out / rundir.EVAL_DIR / "20260102-000000.md").write_text("| task |\n")
    assert json.loads((out / rundir.MARKER).read_text())["tracker_dirs"] == []  # the rest is kept
    assert rundir.foreign_entries(out) == []
    rundir.check_fresh_start(out, overwrite=True, resume="never")
    rundir.clear_output_dir(out)
    assert tree(out) == []


@pytest.mark.parametrize(
    "put, named",
    [
        ("eval/mine.md", "eval/mine.md"),  # beside what ftkit eval wrote
        ("eval/sub/20260101-000000.md", "eval/sub"),  # a folder, under a name ftkit eval never writes
    ],
)
def test_a_file_put_beside_the_eval_tables_is_refused(tmp_path, put, named):
    out = evaluated_run(tmp_path / "run")
    (out / put).parent.mkdir(parents=True, exist_ok=True)
    (out / put).write_text("mine")
    before = tree(out)
    with pytest.raises(UserError, match=f"did not write \\({named}\\)"):
        rundir.check_fresh_start(out, overwrite=True, resume="never")
    with pytest.raises(UserError, match="holds files ftkit did not write"):
        rundir.clear_output_dir(out)
    assert tree(out) == before


def test_an_eval_folder_the_marker_does_not_record_is_refused(tmp_path):
    out = finished_run(tmp_path / "run")
    (out / rundir.EVAL_DIR).mkdir()
    (out / rundir.EVAL_DIR / "20260101-000000.md").write_text("mine")
    assert rundir.foreign_entries(out) == [rundir.EVAL_DIR]
    elsewhere = tmp_path / "precious"
    elsewhere.mkdir()
    (elsewhere / "20260101-000000.md").write_text("keep me")
    out = evaluated_run(tmp_path / "linked")
    for name in ("20260101-000000.md", "20260101-000000.json"):
        (out / rundir.EVAL_DIR / name).unlink()
    (out / rundir.EVAL_DIR).rmdir()
    (out / rundir.EVAL_DIR).symlink_to(elsewhere, target_is_directory=True)  # recorded names, not ftkit's
    assert rundir.foreign_entries(out) == [rundir.EVAL_DIR]


def test_eval_records_nothing_in_a_folder_ftkit_did_not_mark(tmp_path):
    (tmp_path / rundir.CONFIG).write_text("x: 1\n")
    rundir.record_eval(tmp_path, ["20260101-000000.md"])
    assert tree(tmp_path) == [rundir.CONFIG]


def test_a_run_that_never_saved_restarts_without_overwrite(tmp_path):
    """What an early failure or a stop during loading leaves: marker, config, before-training metrics."""
    out = tmp_path / "run"
    out.mkdir()
    (out / rundir.MARKER).write_text("{}\n")
    (out / rundir.CONFIG).write_text("x: 1\n")
    (out / "metrics.jsonl").write_text('{"step": 0, "eval_loss": 6.0}\n')
    (out / "checkpoints" / ".step-1.tmp").mkdir(parents=True)
    rundir.check_fresh_start(out, overwrite=False, resume="auto")
    rundir.clear_output_dir(out)
    assert tree(out) == []


@pytest.mark.parametrize("keep_last", [-1, 0, 1, 2])
def test_pruning_never_deletes_the_newest_checkpoint(tmp_path, keep_last):
    for step in (1, 2, 3):
        path = tmp_path / "checkpoints" / f"step-{step}"
        path.mkdir(parents=True)
        (path / checkpoint.MARKER).write_text(json.dumps({"step": step}))
    checkpoint.prune_checkpoints(tmp_path, keep_last, keep_best=False)
    left = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert left == {1: ["step-3"], 2: ["step-2", "step-3"]}.get(keep_last, ["step-1", "step-2", "step-3"])


# --- paths that cannot hold a run ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("where", "message"),
    [("file", "is a file, not a directory"), ("file/run", "lies under a file, not a directory")],
)
def test_output_dir_that_is_or_lies_under_a_file(recipe, capsys, tmp_path, where, message):
    (tmp_path / "file").write_text("a file")
    code, line = edge(recipe, capsys, f"output_dir={tmp_path / where}")
    assert code == 2 and message in line
    assert tree(tmp_path) == ["file"] and (tmp_path / "file").read_text() == "a file"


@pytest.mark.parametrize("where", ["", "run"])
def test_output_dir_that_cannot_be_written(recipe, capsys, small_disk, where):
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    code, line = edge(recipe, capsys, f"output_dir={small_disk / where}")
    message = "is not writable" if not where else "Read-only file system"
    assert code == 2 and message in line
    assert list(small_disk.iterdir()) == []


# --- one writer per run ----------------------------------------------------------------------------------


def test_a_second_writer_is_refused_naming_host_and_pid(recipe, capsys, tmp_path):
    out = tmp_path / "run"
    holder = rundir.hold_lock(out)
    code, line = edge(recipe, capsys, f"output_dir={out}")
    assert code == 2
    assert f"is in use by another run (host {socket.gethostname()} pid {os.getpid()})" in line
    assert tree(out) == [rundir.LOCK]
    holder.close()
    rundir.hold_lock(out).close()  # free again once its holder lets go


def test_kill_9_leaves_no_stale_lock(tmp_path):
    out = tmp_path / "run"
    code = (
        "import time; from pathlib import Path; from toolkit.checkpoint import rundir; "
        f"lock = rundir.hold_lock(Path({str(out)!r})); print('held', flush=True); time.sleep(300)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(UserError, match=f"pid {holder.pid}"):
        rundir.hold_lock(out)
    holder.kill()
    holder.wait()
    rundir.hold_lock(out).close()


# --- the model and generate ------------------------------------------------------------------------------


@pytest.fixture
def broken_models(tmp_path):
    source = REPO / "toolkit" / "assets" / "tiny-llama"
    truncated, no_tokenizer = tmp_path / "truncated", tmp_path / "no-tokenizer"
    for target in (truncated, no_tokenizer):
        target.mkdir()
        for file in source.iterdir():
            if not (target == no_tokenizer and file.name.startswith("tokenizer")):
                (target / file.name).write_bytes(file.read_bytes())
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    return {"truncated": truncated, "no tokenizer": no_tokenizer}


@pytest.mark.parametrize(
    ("model", "message"),
    [("truncated", "cannot load the model from"), ("no tokenizer", "cannot load the tokenizer from")],
)
def test_a_broken_model_dir_is_one_line(recipe, capsys, tmp_path, broken_models, model, message):
    out = tmp_path / "run"
    code, line = edge(recipe, capsys, f"output_dir={out}", f"model.path={broken_models[model]}")
    assert code == 2 and f"model.path: {message} {broken_models[model]}" in line
    assert not (out / "checkpoints").exists() and not (out / "final").exists()


def test_lora_target_modules_naming_no_module(recipe, capsys, tmp_path):
    out = tmp_path / "run"
    code, line = edge(recipe, capsys, f"output_dir={out}", "lora.target_modules=[nope]")
    assert code == 2 and "lora.target_modules: ['nope']: Target modules {'nope'} not found" in line
    assert not (out / "checkpoints").exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({}, "holds no model"),
        ({"notes.txt": "hello"}, "holds no model"),
        ({"config.json": "{}"}, "cannot load"),
    ],
)
def test_generate_on_a_dir_without_a_model(tmp_path, capsys, content, message):
    model = tmp_path / "model"
    model.mkdir()
    for name, text in content.items():
        (model / name).write_text(text)
    code = cli.main(["generate", "--model", str(model), "--prompt", "hi"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("ftkit generate: error: --model")
    assert message in err and sorted(p.name for p in model.iterdir()) == sorted(content)


def test_plan_on_a_config_with_zero_attention_heads(tmp_path, capsys):
    raw = json.loads((REPO / "toolkit" / "assets" / "tiny-llama" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "num_attention_heads": 0}))
    code = cli.main(["plan", "--model", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == (
        f"ftkit plan: error: --model {tmp_path}: config.json: num_attention_heads must be a positive "
        "integer, got 0"
    )


# --- ftkit export --out ----------------------------------------------------------------------------------


def export_out_cases(tmp_path):
    run = finished_run(tmp_path / "run")
    ckpt = run / "checkpoints" / "step-4"
    (tmp_path / "file.bin").write_text("mine")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "paper.tex").write_text("mine")
    (tmp_path / "holder").mkdir()
    (tmp_path / "holder" / ".ftkit-export").write_text("")
    (tmp_path / "holder" / "old-run").mkdir()
    (tmp_path / "holder" / "old-run" / rundir.MARKER).write_text("{}")
    return ckpt, {
        "the run": (run, "is or lies inside a training run"),
        "the checkpoint": (ckpt, "is or lies inside a training run"),
        "inside the run": (run / "exported", "is or lies inside a training run"),
        "inside the checkpoint": (ckpt / "hf", "is or lies inside a training run"),
        "an existing file": (tmp_path / "file.bin", "is an existing file"),
        "a non-empty dir": (tmp_path / "mine", "a non-empty directory that ftkit export did not write"),
        "an export holding a run": (tmp_path / "holder", "holds a training run"),
    }


CASES = [
    "the run",
    "the checkpoint",
    "inside the run",
    "inside the checkpoint",
    "an existing file",
    "a non-empty dir",
    "an export holding a run",
]


@pytest.mark.parametrize("case", CASES)
def test_export_out_that_would_replace_what_it_must_not(tmp_path, capsys, case):
    ckpt, cases = export_out_cases(tmp_path)
    out, message = cases[case]
    before = tree(tmp_path)
    code = cli.main(["export", str(ckpt), "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("ftkit export: error: --out")
    assert message in err
    assert tree(tmp_path) == before  # nothing written, nothing removed


# --- a full or read-only disk ----------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A real tmpfs of 3 MiB mounted for the test (root only: skipped with the reason for anyone else)."""
    with tmpfs(tmp_path / "disk", "3m") as disk:
        yield disk


def fill(disk, leave_bytes: int) -> None:
    stat = os.statvfs(disk)
    free = stat.f_bavail * stat.f_frsize
    with open(disk / "filler", "wb") as handle:
        handle.write(b"\0" * max(free - leave_bytes, 0))


def test_metrics_line_on_a_full_disk_is_one_line_and_no_torn_line(small_disk):
    log = MetricsLog(small_disk / "metrics.jsonl", enabled=True)
    log.write(1, loss=1.0)
    fill(small_disk, 0)
    with pytest.raises(UserError, match="metrics.jsonl: metrics line not written: No space left on device"):
        log.write(2, loss=0.5, padding="x" * 20000)
    lines = (small_disk / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1]


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))  # 0.5 MiB of weights


@pytest.mark.parametrize("fault", ["disk full", "read-only"])
def test_a_failed_checkpoint_save_keeps_the_previous_one(small_disk, fault):
    accelerator = Accelerator(cpu=True)
    model = small_model()
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    model(torch.ones(1, 256)).sum().backward()
    optimizer.step()
    out = small_disk / "run"
    first = checkpoint.save_checkpoint(accelerator, out, 1, {"tokens_seen": 10}, RecipeConfig())
    saved = tree(first)
    if fault == "disk full":
        fill(small_disk, 300_000)  # room for part of a checkpoint, not all of it
    else:
        subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    with pytest.raises(UserError) as caught:
        checkpoint.save_checkpoint(accelerator, out, 2, {"tokens_seen": 20}, RecipeConfig())
    message = str(caught.value)
    reason = "No space left on device" if fault == "disk full" else "Read-only file system"
    assert "\n" not in message and reason in message
    assert "step-1 is still the newest valid checkpoint" in message
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1"]
    assert checkpoint.latest_checkpoint(out) == first and tree(first) == saved


def test_final_export_on_a_full_disk_leaves_no_partial_files(small_disk):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tiny = REPO / "toolkit" / "assets" / "tiny-llama"
    model, tokenizer = AutoModelForCausalLM.from_pretrained(tiny), AutoTokenizer.from_pretrained(tiny)
    accelerator = Accelerator(cpu=True)
    fill(small_disk, 1_000_000)  # the tiny model's weights need about 9 MB
    with pytest.raises(UserError, match=r"final: model not exported: .*No space left on device"):
        export.export_model(accelerator, model, tokenizer, small_disk / "final", "auto")
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]
