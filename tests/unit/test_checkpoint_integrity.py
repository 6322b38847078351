"""In-process checks behind a safe resume: the manifest, a torn metrics line, pickles under an allow-list,
config changes on resume, the schedule a resumed run continues, and code shipped with a model."""

import json
import os
import pickle

import pytest
import torch
import yaml
from accelerate import Accelerator

from toolkit import checkpoint
from toolkit.checkpoint import safe_load
from toolkit.checkpoint.resume import FIXED, FREE, config_changes
from toolkit.checkpoint.save import file_entry
from toolkit.commands import cli
from toolkit.config import RecipeConfig, TrainConfig, load_config
from toolkit.errors import UserError
from toolkit.train import optim
from toolkit.train.metrics import read_metrics, truncate_after
from toolkit.typed_yaml import to_dict


class Planted:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


@pytest.fixture
def saved(tmp_path):
    """output_dir with two real checkpoints (a small linear model, its optimizer and scheduler)."""
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    accelerator.prepare(model, optimizer, scheduler)
    out = tmp_path / "run"
    for step in (1, 2):
        checkpoint.save_checkpoint(accelerator, out, step, {"tokens_seen": step}, RecipeConfig())
    return out


def test_an_intact_checkpoint_has_no_damage(saved):
    assert checkpoint.damage(saved / "checkpoints" / "step-2") == ""


@pytest.mark.parametrize(
    "harm, reason",
    [
        (lambda c: (c / "model.safetensors").write_bytes(b"{}"), "model.safetensors has 2 bytes"),
        (lambda c: (c / "optimizer.bin").unlink(), "optimizer.bin is missing"),
        (lambda c: (c / checkpoint.MARKER).write_text("{"), "unreadable"),
        (lambda c: (c / checkpoint.MARKER).unlink(), "unfinished save"),
    ],
    ids=["truncated", "missing", "torn marker", "no marker"],
)
def test_damage_names_the_file_and_the_reason(saved, harm, reason):
    harm(saved / "checkpoints" / "step-2")
    assert reason in checkpoint.damage(saved / "checkpoints" / "step-2")


def test_a_bad_safetensors_header_of_the_same_size_is_damage(saved):
    file = saved / "checkpoints" / "step-2" / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:12] = b"\xff\xff\xff\xff"
    file.write_bytes(bytes(data))
    assert "unreadable safetensors header" in checkpoint.damage(file.parent)


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.bin"])
def test_a_flipped_bit_of_the_same_size_is_damage(saved, name):
    file = saved / "checkpoints" / "step-2" / name
    data = bytearray(file.read_bytes())
    data[-3] ^= 0x04  # past any header: a value's bit, the size unchanged
    file.write_bytes(bytes(data))
    assert (
        checkpoint.damage(file.parent)
        == f"{name} does not match its checksum (its bytes changed after the save)"
    )


def test_a_checkpoint_of_an_older_ftkit_with_sizes_only_still_loads(saved):
    step = saved / "checkpoints" / "step-2"
    marker = json.loads((step / checkpoint.MARKER).read_text())
    assert all(set(entry) == {"size", "crc32"} for entry in marker["files"].values())
    marker["files"] = {name: entry["size"] for name, entry in marker["files"].items()}
    (step / checkpoint.MARKER).write_text(json.dumps(marker))
    assert checkpoint.damage(step) == ""
    (step / "optimizer.bin").unlink()
    assert checkpoint.damage(step) == "optimizer.bin is missing"


def test_the_marker_waits_for_files_another_node_writes_late(tmp_path):
    """Rank 1's file reaches the main node's view of a shared filesystem late, and first in part: the wait
    ends when it is whole. A file that never arrives is named with its rank, and nothing is marked."""
    import threading

    from toolkit.checkpoint.save import wait_visible

    (tmp_path / "mine.bin").write_bytes(b"x" * 10)
    (tmp_path / "theirs.bin").write_bytes(b"y" * 3)
    seen = [{"mine.bin": 10}, {"theirs.bin": 8}]
    late = threading.Timer(0.6, lambda: (tmp_path / "theirs.bin").write_bytes(b"y" * 8))
    late.start()
    assert wait_visible(tmp_path, seen, timeout_s=10, poll_s=0.05) == ""
    late.join()
    seen.append({"gone.bin": 5})
    error = wait_visible(tmp_path, seen, timeout_s=0.3, poll_s=0.05)
    assert error.startswith("gone.bin (5 bytes, seen by rank 2) did not reach this node in 0.3 s")


def test_newest_intact_skips_a_damaged_newest_with_one_line(saved):
    (saved / "checkpoints" / "step-2" / "scheduler.bin").unlink()
    said = []
    assert checkpoint.newest_intact(saved, said.append) == saved / "checkpoints" / "step-1"
    assert len(said) == 1 and "step-2" in said[0] and "scheduler.bin is missing" in said[0]
    assert (saved / "checkpoints" / "step-2").is_dir()  # skipped, not deleted


def test_every_checkpoint_damaged_is_an_error(saved):
    for step in (1, 2):
        (saved / "checkpoints" / f"step-{step}" / "optimizer.bin").unlink()
    with pytest.raises(UserError, match="every checkpoint is damaged"):
        checkpoint.newest_intact(saved, lambda line: None)


def test_a_torn_last_metrics_line_is_dropped_with_a_warning(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    said = []
    truncate_after(path, 2, say=said.append)
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    assert len(said) == 1 and "metrics.jsonl:3: dropped a torn last line" in said[0]


def test_a_bad_metrics_line_before_the_last_is_still_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1\n{"step": 2}\n')
    with pytest.raises(UserError, match="metrics.jsonl:1: not valid JSON"):
        read_metrics(path)


def test_a_planted_torch_pickle_is_refused_and_never_runs(tmp_path):
    witness, file = tmp_path / "ran", tmp_path / "states.pt"
    torch.save({"module": Planted(witness)}, file)
    with pytest.raises(UserError, match=r"states.pt: refused to load: it needs (posix|os)\.system"):
        safe_load.check_torch_file(file, safe_load.deepspeed_types())
    assert not witness.exists()


def test_a_planted_dcp_metadata_is_refused_and_never_runs(tmp_path):
    witness = tmp_path / "ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Planted(witness)))
    with pytest.raises(UserError, match=r"\.metadata: refused to load"):
        safe_load.check_dcp(tmp_path)
    assert not witness.exists()


def test_real_dcp_metadata_and_bytes_items_pass_the_allow_list(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"weight": torch.ones(3), "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.99)}]}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    safe_load.check_dcp(tmp_path)
    assert "weight" in safe_load.read_dcp_metadata(tmp_path).state_dict_metadata


def test_a_planted_dcp_bytes_item_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    witness = tmp_path / "ran"
    dcp.save({"extra": Planted(witness)}, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    assert not witness.exists()
    with pytest.raises(UserError, match="refused to load extra"):
        safe_load.check_dcp(tmp_path)
    assert not witness.exists()


def test_config_changes_that_shape_training_are_listed():
    base = to_dict(load_config(None))
    now = to_dict(load_config(None, ["train.learning_rate=0.01", "data.num_workers=2", "output_dir=x"]))
    assert config_changes(base, now) == [
        "data.num_workers 0 -> 2",
        f"train.learning_rate {base['train']['learning_rate']!r} -> 0.01",
    ]


@pytest.mark.parametrize(
    "override",
    ["model.method=full", "lora.r=4", "data.max_length=32", "seed=1", "train.global_batch_size=32"],
)
def test_config_changes_of_model_or_data_are_refused(override):
    base = to_dict(load_config(None))
    with pytest.raises(UserError, match=f"{override.split('=')[0]} .* cannot change on resume"):
        config_changes(base, to_dict(load_config(None, [override])))


def test_every_fixed_key_names_a_config_key():
    sections = to_dict(RecipeConfig())
    for key in FIXED + FREE:
        head, _, rest = key.partition(".")
        assert head in sections and (not rest or rest in sections[head]), key


def test_a_resumed_schedule_uses_the_new_peak_rate_and_decay():
    old, new = TrainConfig(learning_rate=1e-3, max_steps=10), TrainConfig(learning_rate=5e-3, max_steps=20)
    param = torch.nn.Parameter(torch.zeros(2))
    first = torch.optim.AdamW([param], lr=old.learning_rate, weight_decay=0.1)
    schedule = optim.build_scheduler(first, old)
    for _ in range(4):
        schedule.step()
    resumed = torch.optim.AdamW([param], lr=new.learning_rate, weight_decay=0.0)
    resumed_schedule = optim.build_scheduler(resumed, new)
    built = optim.hyperparameters(resumed)
    resumed.load_state_dict(first.state_dict())
    resumed_schedule.load_state_dict(schedule.state_dict())
    assert resumed.param_groups[0]["lr"] == pytest.approx(1e-3 * optim.lr_factor(4, old))  # the bug: old rate
    optim.continue_schedule(resumed, resumed_schedule, built)
    assert resumed.param_groups[0]["lr"] == pytest.approx(5e-3 * optim.lr_factor(4, new))
    assert resumed.param_groups[0]["weight_decay"] == 0.0
    resumed_schedule.step()
    assert resumed.param_groups[0]["lr"] == pytest.approx(5e-3 * optim.lr_factor(5, new))


def custom_code_model(tmp_path, witness):
    """A model directory whose config asks for its own Python code; importing that code creates `witness`."""
    model = tmp_path / "custom-model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "model_type": "planted",
                "auto_map": {"AutoConfig": "planted.Config", "AutoModelForCausalLM": "planted.Model"},
            }
        )
    )
    (model / "planted.py").write_text(f"open({str(witness)!r}, 'w').close()\n")
    return model


def test_export_ignores_trust_remote_code_saved_in_a_checkpoint(saved, tmp_path, capsys):
    witness = tmp_path / "ran"
    model = custom_code_model(tmp_path, witness)
    step = saved / "checkpoints" / "step-2"
    config = yaml.safe_load((step / checkpoint.CONFIG).read_text())
    config["model"].update(path=str(model), trust_remote_code=True)
    (step / checkpoint.CONFIG).write_text(yaml.safe_dump(config))
    marker = json.loads((step / checkpoint.MARKER).read_text())
    marker["files"][checkpoint.CONFIG] = file_entry(step / checkpoint.CONFIG)
    (step / checkpoint.MARKER).write_text(json.dumps(marker))
    out = tmp_path / "export"
    assert cli.main(["export", str(step), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "ships its own modelling code" in err, err
    assert not witness.exists() and not out.exists()


def test_generate_runs_no_model_code_without_the_flag(tmp_path, capsys):
    witness = tmp_path / "ran"
    model = custom_code_model(tmp_path, witness)
    assert cli.main(["generate", "--model", str(model), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "ships its own modelling code" in err, err
    assert not witness.exists()
