"""A damaged, poisoned or mismatched checkpoint never trains on and never runs code: each case derives a
copy from one small run per backend, launches or exports it, and checks the exit code, the one line it
printed and what is on disk afterwards.

Launches: started warm (tests/warm.py; `FTKIT_TEST_LAUNCH=real` for the real launcher): what the runs compute
and print is what is tested.
"""

import json
import os
import pickle
import re
import shutil

import pytest
import torch
from helpers import REPO, launch, run_recipe
from safetensors.torch import load_file, save_file

from toolkit.checkpoint import MARKER
from toolkit.checkpoint.save import damage as checkpoint_damage
from toolkit.checkpoint.save import file_entry
from toolkit.commands import cli
from toolkit.train.metrics import read_metrics

BASE = ["train.max_steps=2", "train.save_every_steps=1", "eval.max_batches=1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """backend -> output_dir of a 2-step run with checkpoints step-1 and step-2, trained when first asked."""
    done = {}

    def get(name: str):
        if name not in done:
            out = tmp_path_factory.mktemp(name) / "run"
            run_recipe(out, *BASE, launch=launch(name, 2))
            done[name] = out
        return done[name]

    return get


class Planted:
    """A pickle that creates `path` when unpickled by a loader that runs what a file asks for."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def copy_run(source, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(source, out)
    shutil.rmtree(out / "final")
    return out


def rewrite(checkpoint, relative: str, write) -> None:
    """Replace one file and record its new size in the manifest, as a forger who edits the marker would."""
    write(checkpoint / relative)
    marker = json.loads((checkpoint / MARKER).read_text())
    marker["files"][relative] = file_entry(checkpoint / relative)
    (checkpoint / MARKER).write_text(json.dumps(marker))


def assert_one_line_error(result, *expected: str) -> None:
    """A single process exits 2 with one line and no traceback; under `accelerate launch` each rank prints
    that same line, no traceback comes from ftkit's code, and the launcher reports the failure."""
    errors = [line for line in result.stderr.splitlines() if line.startswith("finetune_llm: error:")]
    assert errors and len(set(errors)) == 1, result.stderr[-3000:]
    assert all(e in errors[0] for e in expected), errors[0]
    assert str(REPO / "toolkit") not in result.stderr and 'finetune_llm.py", line' not in result.stderr
    if "accelerate.commands.launch" in result.args:
        assert result.returncode != 0
    else:
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert result.stderr.strip().splitlines()[-1] == errors[0]


def assert_one_error_line(err: str, command: str, *expected: str) -> None:
    errors = [line for line in err.splitlines() if line.startswith(f"ftkit {command}: error:")]
    assert len(errors) == 1 and all(e in errors[0] for e in expected), err
    assert "Traceback" not in err


def resume(out, *overrides, processes: int = 1, backend: str = "ddp"):
    """Relaunch the run in `out` for one more step (one process: replicated checkpoints load exactly)."""
    more = ["train.max_steps=3", "train.save_every_steps=1", "eval.max_batches=1", *overrides]
    return run_recipe(out, *more, launch=launch(backend, processes) if processes > 1 else None, check=False)


def losses(out) -> list[int]:
    return [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


# --- damage: the newest checkpoint is skipped with one warning, the previous one is used -----------------


def flip_a_bit(checkpoint) -> None:
    """One bit of Adam's moments flipped, the size unchanged: only the manifest's CRC-32 tells."""
    data = bytearray((checkpoint / "optimizer.bin").read_bytes())
    data[-5] ^= 0x01
    (checkpoint / "optimizer.bin").write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, reason",
    [
        (
            lambda c: (c / "model.safetensors").write_bytes((c / "model.safetensors").read_bytes()[:1000]),
            "bytes",
        ),
        (flip_a_bit, "optimizer.bin does not match its checksum"),
    ],
    ids=["truncated", "a flipped bit"],
)
def test_damaged_newest_checkpoint_is_skipped_with_one_warning(runs, tmp_path, damage, reason):
    out = copy_run(runs("ddp"), tmp_path)
    damage(out / "checkpoints" / "step-2")
    result = resume(out)
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stdout.splitlines() if "skipping damaged checkpoint" in line]
    assert len(warnings) == 1 and "step-2" in warnings[0] and reason in warnings[0], result.stdout
    assert f"resumed from {out / 'checkpoints' / 'step-1'} at step 1" in result.stdout
    assert losses(out) == [1, 2, 3] and (out / "final").is_dir()


def test_every_checkpoint_damaged_is_one_line_and_nothing_trains(runs, tmp_path):
    out = copy_run(runs("ddp"), tmp_path)
    for step in (1, 2):
        (out / "checkpoints" / f"step-{step}" / "scheduler.bin").unlink()
    result = resume(out)
    assert_one_line_error(result, "every checkpoint is damaged")
    assert losses(out) == [1, 2] and not (out / "final").exists()


def test_nan_weights_stop_the_run_and_the_export(runs, tmp_path, capsys):
    out = copy_run(runs("ddp"), tmp_path)
    newest = out / "checkpoints" / "step-2"
    weights = load_file(newest / "model.safetensors")
    name = next(n for n in weights if "lora_B" in n)
    weights[name] = torch.full_like(weights[name], float("nan"))
    rewrite(newest, "model.safetensors", lambda path: save_file(weights, path, metadata={"format": "pt"}))
    result = resume(out)
    assert_one_line_error(result, "step-2", "weights are not finite")
    assert losses(out) == [1, 2] and not (out / "final").exists()
    assert not (out / "checkpoints" / "step-3").exists()
    export = tmp_path / "export"
    assert cli.main(["export", str(newest), "--out", str(export)]) == 2
    assert_one_error_line(capsys.readouterr().err, "export", "step-2", "weights are not finite")
    assert not export.exists() and not (tmp_path / "export.tmp").exists()


def test_torn_last_metrics_line_is_dropped_with_a_warning(runs, tmp_path):
    out = copy_run(runs("ddp"), tmp_path)
    with (out / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 3, "loss": 1.2')
    result = resume(out)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "dropped a torn last line" in result.stdout
    assert losses(out) == [1, 2, 3]


def test_unreadable_random_states_are_a_warning(runs, tmp_path):
    out = copy_run(runs("ddp"), tmp_path)
    step = out / "checkpoints" / "step-2"
    size = (step / "random_states_0.pkl").stat().st_size
    (step / "random_states_0.pkl").write_bytes(b"\0" * size)  # the same size: the checksum tells
    assert checkpoint_damage(step) == (
        "random_states_0.pkl does not match its checksum (its bytes changed after the save)"
    )
    # With the marker rewritten to match (a forger's edit), the unpickling allow-list still refuses it.
    rewrite(step, "random_states_0.pkl", lambda path: path.write_bytes(b"\0" * size))
    result = resume(out)
    assert result.returncode == 0, result.stderr[-3000:]
    warned = [line for line in result.stdout.splitlines() if "random states not restored" in line]
    assert len(warned) == 1 and "random_states_0.pkl" in warned[0]
    assert losses(out) == [1, 2, 3]


# --- where a resume may start, and what may change ------------------------------------------------------


def test_resume_from_a_checkpoint_into_a_new_output_dir_starts_a_new_run(runs, tmp_path):
    source = runs("ddp")
    before = sorted(p.name for p in (source / "checkpoints").iterdir())
    out = tmp_path / "branch"
    result = resume(out, f"train.resume={source / 'checkpoints' / 'step-1'}", "train.max_steps=2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "at step 1" in result.stdout
    assert losses(out) == [2] and (out / "final").is_dir() and (out / "checkpoints" / "step-2").is_dir()
    assert sorted(p.name for p in (source / "checkpoints").iterdir()) == before


def test_resume_from_a_checkpoint_into_another_run_is_refused(runs, tmp_path):
    other = copy_run(runs("fsdp"), tmp_path)  # a run of its own: another seed, so another data order
    config = other / "config.yaml"
    config.write_text(re.sub(r"(?m)^seed: \d+$", "seed: 7", config.read_text()))
    assert "seed: 7" in config.read_text()
    before = sorted(str(p.relative_to(other)) for p in other.rglob("*"))
    result = resume(other, f"train.resume={runs('ddp') / 'checkpoints' / 'step-1'}")
    assert_one_line_error(result, "holds another run")
    assert sorted(str(p.relative_to(other)) for p in other.rglob("*")) == before


def test_resume_from_a_checkpoint_into_a_folder_ftkit_did_not_write_is_refused(runs, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("someone's notes")
    result = resume(other, f"train.resume={runs('ddp') / 'checkpoints' / 'step-1'}")
    assert_one_line_error(result, "not created by ftkit")
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]


def test_changed_learning_rate_is_listed_and_used(runs, tmp_path):
    out = copy_run(runs("ddp"), tmp_path)
    result = resume(out, "train.learning_rate=0.005", "train.lr_scheduler=constant")
    assert result.returncode == 0, result.stderr[-3000:]
    changed = [line for line in result.stdout.splitlines() if line.startswith("config changed since step-2")]
    assert len(changed) == 1, result.stdout
    assert "train.learning_rate 0.002 -> 0.005" in changed[0] and "train.max_steps 2 -> 3" in changed[0]
    step3 = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] == 3 and "lr" in r]
    assert step3[0]["lr"] == pytest.approx(0.005)


# One key is enough here: which keys are refused is tests/unit/test_checkpoint_integrity.py's.
@pytest.mark.parametrize("override, key", [("lora.r=8", "lora.r")])
def test_changed_model_or_data_is_refused_naming_the_key(runs, tmp_path, override, key):
    out = copy_run(runs("ddp"), tmp_path)
    result = resume(out, override)
    assert_one_line_error(result, key, "cannot change on resume")
    assert losses(out) == [1, 2] and not (out / "final").exists()


# --- nothing in a checkpoint runs code ------------------------------------------------------------------


def plant(checkpoint, relative: str, witness) -> None:
    rewrite(checkpoint, relative, lambda path: torch.save({"module": Planted(witness)}, path))


@pytest.mark.multiproc
@pytest.mark.parametrize("relative", ["pytorch_model/mp_rank_00_model_states.pt"])
def test_export_of_a_planted_deepspeed_file_is_refused(runs, tmp_path, capsys, relative):
    out = copy_run(runs("zero2"), tmp_path)
    witness = tmp_path / "ran"
    plant(out / "checkpoints" / "step-2", relative, witness)
    export = tmp_path / "export"
    assert cli.main(["export", str(out / "checkpoints" / "step-2"), "--out", str(export)]) == 2
    assert_one_error_line(
        capsys.readouterr().err, "export", "mp_rank_00_model_states.pt: refused to load", "system"
    )
    assert not witness.exists() and not export.exists()


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "relative, processes",
    [
        # Every *.pt of the checkpoint is checked before exact or portable resume is chosen: one file of
        # one resume is the case (two ranks refusing once: the planted DCP metadata below).
        ("pytorch_model/mp_rank_00_model_states.pt", 1)
    ],
    ids=["model states, resume on one process"],
)
def test_resume_of_a_planted_deepspeed_file_is_refused(runs, tmp_path, relative, processes):
    out = copy_run(runs("zero2"), tmp_path)
    witness = tmp_path / "ran"
    plant(out / "checkpoints" / "step-2", relative, witness)
    result = resume(out, processes=processes, backend="zero2")
    assert_one_line_error(result, relative.split("/")[-1], "refused to load")
    assert not witness.exists() and losses(out) == [1, 2] and not (out / "final").exists()


def plant_metadata(checkpoint, witness) -> None:
    relative = "pytorch_model_fsdp_0/.metadata"
    rewrite(checkpoint, relative, lambda path: path.write_bytes(pickle.dumps(Planted(witness))))


@pytest.mark.multiproc
def test_export_of_a_planted_dcp_metadata_is_refused(runs, tmp_path, capsys):
    out = copy_run(runs("fsdp"), tmp_path)
    witness = tmp_path / "ran"
    plant_metadata(out / "checkpoints" / "step-2", witness)
    export = tmp_path / "export"
    assert cli.main(["export", str(out / "checkpoints" / "step-2"), "--out", str(export)]) == 2
    assert_one_error_line(capsys.readouterr().err, "export", ".metadata: refused to load", "system")
    assert not witness.exists() and not export.exists()


@pytest.mark.multiproc
def test_resume_of_a_planted_dcp_metadata_is_refused(runs, tmp_path):
    out = copy_run(runs("fsdp"), tmp_path)
    witness = tmp_path / "ran"
    plant_metadata(out / "checkpoints" / "step-2", witness)
    result = resume(out, processes=2, backend="fsdp")
    assert_one_line_error(result, ".metadata", "refused to load")
    assert not witness.exists() and losses(out) == [1, 2] and not (out / "final").exists()
