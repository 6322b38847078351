"""A GRPO round's sample rollouts as the run folder keeps them (grpo/samples.py) and as the studio's run page
shows them: the first groups with their rewards, a conversation in the model's turns and the environment's,
the newest round first, a round written again kept once, and the text escaped on the page."""

import json
from types import SimpleNamespace

import torch
from fastapi.testclient import TestClient
from test_studio import BASE, write_run

from toolkit.checkpoint import rundir
from toolkit.grpo import samples
from toolkit.studio.app import create_app
from toolkit.studio.guard import Roots, allowed_hosts


class Tokens:
    """Decodes token t as the letter 'a' + t, '<' for 30 (the page must escape what a model writes)."""

    def decode(self, tokens, skip_special_tokens=False):
        return "".join("<" if t == 30 else chr(ord("a") + t) for t in tokens)


def rollout(round_index: int, mask=None):
    completions = torch.tensor([[0, 1, 2, 3], [4, 5, 0, 0], [6, 30, 0, 0], [7, 8, 9, 0], [1, 1, 1, 1]] * 2)
    return SimpleNamespace(
        round_index=round_index,
        prompt=torch.tensor([3, 3, 3, 3, 3, 1, 1, 1, 1, 1]),
        completions=completions,
        lengths=torch.tensor([4, 2, 2, 3, 4] * 2),
        rewards={"total": torch.arange(10, dtype=torch.float64) / 4, "format": torch.ones(10)},
        advantages=torch.linspace(-1, 1, 10),
        mask=mask,
    )


def test_a_round_keeps_its_first_groups_and_a_conversation_its_turns(tmp_path):
    run = SimpleNamespace(accelerator=SimpleNamespace(is_main_process=True), output_dir=tmp_path)
    prompts = SimpleNamespace(texts=["p0", "p1", "p2", "What is 1 + 2?"], answers=["0", "1", "2", "3"])
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 1, 1]] * 2)
    samples.record(run, rollout(0), prompts, Tokens(), group_size=5)
    samples.record(run, rollout(1, mask), prompts, Tokens(), group_size=5)
    samples.record(run, rollout(0), prompts, Tokens(), group_size=1)  # round 0 again, after a resume
    (tmp_path / samples.SAMPLES_FILE).open("a").write('{"round": 2, "samp')  # a line being written
    newest, again = samples.read(tmp_path)
    assert (newest["round"], again["round"], again["group_size"]) == (1, 0, 1)
    assert newest["prompts"] == ["What is 1 + 2?", "p1"] and newest["answers"] == ["3", "1"]
    assert len(newest["samples"]) == 10 and len(again["samples"]) == 2  # GROUPS groups of the round's
    first = newest["samples"][0]
    assert first["turns"] == [
        {"by": "model", "text": "ab"},
        {"by": "environment", "text": "c"},
        {"by": "model", "text": "d"},
    ]
    assert (first["rewards"], first["advantage"], first["tokens"]) == ({"total": 0.0, "format": 1.0}, -1.0, 4)
    assert [t["by"] for t in newest["samples"][4]["turns"]] == ["environment", "model"]
    assert json.loads((tmp_path / samples.SAMPLES_FILE).read_text().splitlines()[0])["samples"][0][
        "turns"
    ] == [{"by": "model", "text": "abcd"}]
    assert samples.SAMPLES_FILE in rundir.OUTPUTS  # an overwrite or delete of the run clears it too
    off = SimpleNamespace(accelerator=SimpleNamespace(is_main_process=False), output_dir=tmp_path / "other")
    samples.record(off, rollout(0), prompts, Tokens(), group_size=5)  # only the main process writes
    assert not (tmp_path / "other").exists()


def test_the_run_page_shows_the_newest_round_escaped(tmp_path):
    roots = Roots((tmp_path / "runs").resolve(), tmp_path.resolve())
    run_dir = write_run(roots.runs, "grpo", 3, 10, final=False)
    run = SimpleNamespace(accelerator=SimpleNamespace(is_main_process=True), output_dir=run_dir)
    prompts = SimpleNamespace(texts=["p0", "p1", "p2", "What is 1 + 2?"], answers=["0", "1", "2", "3"])
    samples.record(run, rollout(4), prompts, Tokens(), group_size=5)
    app = create_app(roots, None, allowed_hosts("127.0.0.1", 7860))
    with TestClient(app, base_url=BASE) as client:
        page = client.get("/run/grpo").text
    assert 'id="rollouts"' in page and "round 4" in page and "What is 1 + 2?" in page
    assert "g&lt;" in page and "g<" not in page  # the model's text escaped
    plain = client_page(roots, "plain", tmp_path)
    assert 'id="rollouts"' not in plain  # a run without rollouts shows none


def client_page(roots, name, tmp_path) -> str:
    write_run(roots.runs, name, 3, 10, final=False)
    app = create_app(roots, None, allowed_hosts("127.0.0.1", 7860))
    with TestClient(app, base_url=BASE) as client:
        return client.get(f"/run/{name}").text
