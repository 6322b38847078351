"""data.streaming end to end on two processes: a run stopped after a checkpoint and launched again trains
on exactly the rows, and reaches exactly the losses, of a run that never stopped.

Launches: started warm (tests/warm.py; `FTKIT_TEST_LAUNCH=real` for the real launcher): what the runs compute
is what is tested.
"""

from __future__ import annotations

import shutil

import pytest
from helpers import launch, run_recipe, step_losses

STREAMING = [
    "data.streaming=true",
    "train.max_steps=6",
    "train.save_every_steps=3",
    "train.micro_batch_size=2",
]


@pytest.mark.multiproc
def test_streaming_resumes_mid_stream_exactly(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache-straight"))
    straight = tmp_path / "straight"
    result = run_recipe(straight, *STREAMING, launch=launch("ddp"))
    assert "data: streaming" in result.stdout
    # The run died after step 3: keep only what it had written by then, and relaunch on a machine that
    # never saw this stream (an empty cache: the position follows from the step alone).
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-6")
    shutil.rmtree(resumed / "final")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache-resumed"))
    result = run_recipe(resumed, *STREAMING, launch=launch("ddp"))
    assert "resumed from" in result.stdout
    assert len(step_losses(straight)) == 6
    assert step_losses(resumed) == step_losses(straight)
