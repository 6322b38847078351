"""`make gpu-check` in smoke mode, so the kit cannot rot where no GPU exists: the plan's comparison and its
verdict, the summary of a run's metrics, the report, and one tiny case of the plan part and of TRL's side
run for real on the CPU."""

import json
import subprocess
import sys

import pytest
from helpers import REPO

sys.path.insert(0, str(REPO / "bench"))
import gpu_check  # noqa: E402
from gpu_report import render  # noqa: E402

H100 = {"device": "NVIDIA H100 80GB HBM3", "gpus": 1, "memory_gib": 79, "driver": "580.1", "cuda": "13.0"}
H100 |= {"torch": "2.13.0", "date": "2026-11-25", "smoke": False}
SMOKE = {"device": "CPU (no GPU found)", "gpus": 0, "cuda": None, "driver": None, "torch": "2.13.0"}
SMOKE |= {"date": "2026-11-25", "smoke": True}


@pytest.mark.parametrize(
    "measured_mib, verdict", [(1000, "ok"), (1100 / 1.1 + 1, "ok"), (1100 / 0.94, "off")]
)
def test_the_plan_verdict_is_on_its_total_against_the_reserve_and_the_context(measured_mib, verdict):
    plan = {"total": 1100 * 2**20, "overhead": 500 * 2**20}
    run = {"peak_mem_mb": 550.0, "peak_reserved_mb": measured_mib - 480, "outside_allocator_mb": 480.0}
    values = gpu_check.plan_comparison(plan, run, smoke=False)
    assert values["verdict"] == verdict
    assert values["ratio"] == pytest.approx(1100 / measured_mib)
    assert values["tensors_ratio"] == pytest.approx(600 / 550)
    assert gpu_check.plan_comparison(plan, {"peak_mem_mb": 90.0}, smoke=True)["verdict"].startswith("smoke")
    over = gpu_check.plan_comparison(plan, {**run, "peak_reserved_mb": 1100 / 1.11 - 480}, smoke=False)
    assert over["verdict"] == "off"  # more than 10% over


def test_a_runs_summary_skips_its_first_step_and_keeps_the_peaks(tmp_path):
    lines = [
        {"step": 1, "loss": 3.0, "tokens_per_s": 10.0, "peak_mem_mb": 5.0, "mfu": 0.1},
        {"step": 2, "loss": 2.0, "tokens_per_s": 100.0, "peak_mem_mb": 7.0, "mfu": 0.4},
        {"step": 3, "loss": 1.0, "tokens_per_s": 300.0, "peak_mem_mb": 6.0, "mfu": 0.5},
        {"eval_loss": 1.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = gpu_check.summarise(tmp_path / "metrics.jsonl", 12.0)
    assert summary["tokens_per_s"] == 200.0 and summary["mfu"] == pytest.approx(0.45)
    assert summary["peak_mem_mb"] == 7.0 and summary["loss"] == 1.0 and summary["losses"] == [3.0, 2.0, 1.0]
    assert "to_first_step_s" not in summary and "compile_cache_hits" not in summary


def test_a_startup_summary_counts_from_the_launch_and_keeps_the_compile_cache_counters(tmp_path):
    lines = [
        {"step": 1, "compile_cache_hits": 7, "compile_cache_misses": 0, "time": 1050.0},
        {
            "step": 1,
            "loss": 3.0,
            "tokens_per_s": 10.0,
            "peak_mem_mb": 5.0,
            "step_time_s": 5.5,
            "time": 1054.0,
        },
        {"step": 2, "loss": 2.0, "tokens_per_s": 100.0, "peak_mem_mb": 7.0, "time": 1055.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = gpu_check.summarise(tmp_path / "metrics.jsonl", 30.0, started_at=1031.0)
    assert summary["to_first_step_s"] == 23.0 and summary["first_step_s"] == 5.5
    assert summary["compile_cache_hits"] == 7 and summary["compile_cache_misses"] == 0


def test_the_report_puts_each_machine_and_day_in_its_own_section():
    rows = [
        {"part": "plan", "case": "llama-1b lora seq 512 micro 1", "ratio": 1.02, "verdict": "ok", **H100},
        {"part": "speed", "case": "ftkit", "tokens_per_s": 12345.6, **H100},
        {"part": "plan", "case": "llama-1b lora seq 32 micro 1", "verdict": "smoke: CPU peak RSS", **SMOKE},
    ]
    report = render(rows)
    assert "## 2026-11-25: NVIDIA H100 80GB HBM3, 1 GPU(s), 79 GiB, driver 580.1, CUDA 13.0" in report
    assert "## 2026-11-25: CPU (no GPU found), 0 GPU(s)" in report
    assert report.count("Smoke mode: no GPU was found") == 1
    assert "| llama-1b lora seq 512 micro 1 | 1.02 | ok |" in report and "| ftkit | 12,346 |" in report
    assert report.index("H100") < report.index("CPU (no GPU found)")


def test_the_smoke_mode_runs_a_plan_case_and_the_trl_side_for_real(tmp_path, monkeypatch):
    kit = gpu_check.Kit(True, tmp_path, gpu_check.device_info(True))
    monkeypatch.setattr(gpu_check, "plan_cases", lambda kit: [("llama-1b", "lora", 64, 2)])
    gpu_check.part_plan(kit)
    (row,) = kit.rows
    assert row["part"] == "plan" and "error" not in row, row
    assert row["predicted_mib"] > row["tensors_mib"] > 0 and row["allocated_mib"] > 0
    assert row["verdict"] == "smoke: CPU peak RSS, not GPU memory"
    assert json.loads((tmp_path / "results.jsonl").read_text())["case"] == "llama-1b lora seq 64 micro 2"
    out = tmp_path / "trl.json"
    command = [
        sys.executable,
        "gpu_trl.py",
        str(kit.model("llama-1b")),
        str(kit.data()),
        str(out),
        "64",
        "2",
        "2",
    ]
    done = subprocess.run(command, cwd=REPO / "bench", capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    trl = json.loads(out.read_text())
    assert trl["tokens_per_s"] > 0 and trl["peak_mem_mb"] > 0 and trl["loss"] > 0


def test_an_unknown_part_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["plans"])
    assert exit_info.value.code == 2
    assert (
        "no part 'plans': the parts are startup, large, plan, speed, compile, paths, multi"
        in capsys.readouterr().err
    )


def test_a_work_folder_that_is_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("mine")
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--work", str(tmp_path / "file"), "plan"])
    assert exit_info.value.code == 2 and "not a directory" in capsys.readouterr().err
    assert (tmp_path / "file").read_text() == "mine"


def test_a_rerun_in_the_same_work_folder_skips_what_it_recorded_and_the_report_ends_with_findings(tmp_path):
    kit = gpu_check.Kit(True, tmp_path, {"device": "cpu"})
    assert not kit.done("plan", "llama-1b lora seq 128 micro 4")
    kit.record("plan", "llama-1b lora seq 128 micro 4", ratio=1.0)
    again = gpu_check.Kit(True, tmp_path, {"device": "cpu"})
    assert again.done("plan", "llama-1b lora seq 128 micro 4")
    assert not again.done("plan", "llama-1b qlora seq 128 micro 4")
    report = render(kit.rows, "## Findings\n\n- one")
    assert report.endswith("## Findings\n\n- one\n") and "llama-1b lora seq 128 micro 4" in report


def test_a_model_folder_is_whole_or_rebuilt_and_a_full_disk_is_one_line(tmp_path, monkeypatch):
    import gpu_models

    out = tmp_path / "models" / "llama-1b"
    stale = out.with_name("llama-1b.partial")
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_text("cut short")
    assert gpu_models.build("llama-1b", out, smoke=True) == out
    assert (out / "config.json").is_file() and not stale.exists()

    usage = gpu_models.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(gpu_models.shutil, "disk_usage", lambda _: usage._replace(free=2**30))
    with pytest.raises(SystemExit, match=r"has 1.0 GiB free, llama-8b needs .* GiB"):
        gpu_models.build("llama-8b", tmp_path / "models" / "llama-8b", smoke=False)
    assert not (tmp_path / "models" / "llama-8b").exists()
    assert not (tmp_path / "models" / "llama-8b.partial").exists()
