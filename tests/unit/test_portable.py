"""Which checkpoints load exactly under a new launch, and what `ftkit export` refuses."""

import json

import pytest

from toolkit.checkpoint import MARKER, portable
from toolkit.commands import cli
from toolkit.errors import UserError


def marker(backend: str, world_size: int, zero_stage: int = 0) -> dict:
    return {"backend": backend, "world_size": world_size, "zero_stage": zero_stage}


@pytest.mark.parametrize(
    "saved, now, plan",
    [
        (marker("MULTI_CPU", 2), marker("NO", 1), "exact"),
        (marker("NO", 1), marker("MULTI_GPU", 4), "exact"),
        (marker("FSDP", 2), marker("FSDP", 2), "exact"),
        (marker("FSDP", 2), marker("FSDP", 4), "portable"),
        (marker("DEEPSPEED", 2, 2), marker("DEEPSPEED", 2, 2), "exact"),
        (marker("DEEPSPEED", 2, 2), marker("DEEPSPEED", 2, 3), "portable"),
        (marker("DEEPSPEED", 2, 2), marker("MULTI_CPU", 2), "portable"),
        (marker("MULTI_GPU", 2), marker("DEEPSPEED", 2, 3), "portable"),
        ({"backend": "DEEPSPEED", "world_size": 2}, marker("DEEPSPEED", 2, 2), "portable"),
        ({"backend": "FSDP", "world_size": 2}, marker("FSDP", 2), "exact"),
        # split models: exact only onto the same mesh; whole-tensor layouts go through the portable path
        ({**marker("MULTI_CPU", 2), "tp_size": 2}, {**marker("MULTI_CPU", 2), "tp_size": 2}, "exact"),
        ({**marker("MULTI_CPU", 2), "tp_size": 2}, marker("MULTI_CPU", 2), "portable"),
        (marker("NO", 1), {**marker("MULTI_CPU", 2), "tp_size": 2}, "portable"),
        ({**marker("FSDP", 4), "tp_size": 2}, marker("FSDP", 4), "portable"),
        ({**marker("FSDP", 4), "dp_replicate_size": 2}, marker("FSDP", 4), "portable"),
    ],
)
def test_resume_plan_loads_exactly_only_what_accelerate_can_load(saved, now, plan):
    assert portable.resume_plan(saved, now) == plan


def test_export_refuses_an_incomplete_checkpoint_and_an_unknown_layout(tmp_path, capsys):
    partial = tmp_path / "checkpoints" / ".step-3.tmp"
    partial.mkdir(parents=True)
    assert cli.main(["export", str(partial), "--out", str(tmp_path / "out")]) == 2
    assert f"not a complete checkpoint (no {MARKER})" in capsys.readouterr().err

    odd = tmp_path / "checkpoints" / "step-3"
    odd.mkdir()
    (odd / MARKER).write_text(json.dumps({"step": 3, **marker("NO", 1)}))
    (odd / "weights.pt").write_bytes(b"")
    with pytest.raises(UserError, match="unknown checkpoint layout"):
        portable.read_weights(odd)
    assert cli.main(["export", str(odd), "--out", str(tmp_path / "out")]) == 2
    assert "unknown checkpoint layout" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
