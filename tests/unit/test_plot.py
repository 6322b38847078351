"""`ftkit plot`: a PNG from metrics.jsonl, several runs overlaid, clear errors for bad input."""

import json
import math

import pytest

from toolkit.commands import cli
from toolkit.commands.plot import draw_runs, plot_runs, read_run
from toolkit.errors import UserError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(directory, loss_scale: float = 1.0, steps: int = 20):
    """A metrics.jsonl shaped like the recipe's: a train line per step, an eval line every 5 steps."""
    directory.mkdir(parents=True)
    lines = []
    for step in range(1, steps + 1):
        loss = loss_scale * (1 + 2 * math.exp(-step / 6))
        lines.append(
            {
                "step": step,
                "loss": loss,
                "lr": 1e-4 * min(1.0, step / 5),
                "grad_norm": 0.5,
                "tokens_per_s": 1200.0 + 10 * step,
                "tokens_seen": 900 * step,
                "step_time_s": 0.3,
                "time": 1700000000.0 + step,
            }
        )
        if step % 5 == 0:
            lines.append(
                {
                    "step": step,
                    "eval_loss": loss * 0.95,
                    "eval_ppl": math.exp(loss * 0.95),
                    "time": 1700000000.5 + step,
                }
            )
    (directory / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return directory


def test_writes_a_png_beside_the_metrics(tmp_path):
    run = write_run(tmp_path / "ddp")
    out = plot_runs([run])
    assert out == run / "metrics.png"
    assert out.read_bytes().startswith(PNG_SIGNATURE) and out.stat().st_size > 10_000


def test_overlays_runs_with_their_names_as_legend(tmp_path):
    runs = [write_run(tmp_path / "ddp"), write_run(tmp_path / "zero3", loss_scale=1.1)]
    figure = draw_runs([(run.name, read_run(run)) for run in runs])
    loss_panel = figure.axes[0]
    assert [t.get_text() for t in loss_panel.get_legend().get_texts()] == ["ddp", "zero3"]
    assert len(loss_panel.lines) == 4  # train and eval loss of each run
    out = tmp_path / "compare.png"
    assert cli.main(["plot", str(runs[0]), str(runs[1]), "--out", str(out)]) == 0
    assert out.read_bytes().startswith(PNG_SIGNATURE)


def test_same_directory_names_are_told_apart(tmp_path):
    runs = [write_run(tmp_path / "a" / "run"), write_run(tmp_path / "b" / "run")]
    from toolkit.commands.plot import labels_for

    assert labels_for(runs) == [str(runs[0]), str(runs[1])]


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no metrics.jsonl"),
        ("", "no metrics logged yet"),
        ('{"step": 1, "loss": 2.0}\n{"step": 2, "loss"\n', "metrics.jsonl:2: not valid JSON"),
    ],
)
def test_bad_input_is_a_user_error(tmp_path, content, message):
    run = tmp_path / "run"
    run.mkdir()
    if content is not None:
        (run / "metrics.jsonl").write_text(content)
    with pytest.raises(UserError, match=message):
        plot_runs([run])


def test_cli_reports_a_missing_run_in_one_line(tmp_path, capsys):
    assert cli.main(["plot", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "no metrics.jsonl" in err and err.count("\n") == 1


def test_preference_runs_get_reward_accuracy_and_margin_beside_the_loss(tmp_path):
    run = tmp_path / "dpo"
    run.mkdir()
    lines = [
        {
            "step": s,
            "loss": 0.7 - 0.01 * s,
            "lr": 1e-4,
            "tokens_per_s": 100.0,
            "reward_accuracy": 0.1 * s,
            "reward_margin": 0.05 * s,
        }
        for s in range(1, 6)
    ]
    lines.append({"step": 5, "eval_loss": 0.6, "eval_reward_accuracy": 0.7, "eval_reward_margin": 0.3})
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    figure = draw_runs([("dpo", read_run(run))])
    titles = [ax.get_title() for ax in figure.axes]
    assert titles[:3] == [
        "loss (eval dashed)",
        "reward accuracy (eval dashed)",
        "reward margin (eval dashed)",
    ]
    assert [len(ax.lines) for ax in figure.axes[:3]] == [2, 2, 2]
    sft = draw_runs([("sft", read_run(write_run(tmp_path / "sft")))])
    assert len(sft.axes) == 3  # SFT runs keep their three panels
