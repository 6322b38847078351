"""A save that fails half-way (a full disk) keeps the previous checkpoint and says so in one line."""

import errno
import json
import os

import pytest
from accelerate import Accelerator

from toolkit import checkpoint
from toolkit.errors import UserError


def test_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    accelerator = Accelerator(cpu=True)
    output_dir = tmp_path / "run"
    first = checkpoint.save_checkpoint(accelerator, output_dir, 1, {"tokens_seen": 10})

    def fill_the_disk(path):
        os.makedirs(path, exist_ok=True)
        (tmp_path / "run" / "checkpoints" / ".step-2.tmp" / "half-written.bin").write_bytes(b"x")
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(accelerator, "save_state", fill_the_disk)
    with pytest.raises(UserError) as caught:
        checkpoint.save_checkpoint(accelerator, output_dir, 2, {"tokens_seen": 20})
    message = str(caught.value)
    assert "No space left on device" in message and "step-1 is still the newest valid checkpoint" in message
    assert checkpoint.latest_checkpoint(output_dir) == first
    assert sorted(p.name for p in (output_dir / "checkpoints").iterdir()) == ["step-1"]
    assert json.loads((first / checkpoint.MARKER).read_text())["tokens_seen"] == 10
