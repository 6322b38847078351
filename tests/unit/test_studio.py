"""`ftkit studio` in-process: what it reads from run folders, and one test per rule for strangers (the
browser drives the whole page in tests/e2e/test_studio_browser.py)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from toolkit.checkpoint import rundir
from toolkit.checkpoint.rundir import LOCK, MARKER
from toolkit.commands.cli import main
from toolkit.errors import UserError
from toolkit.studio import jobs, runner, runs
from toolkit.studio.app import create_app
from toolkit.studio.guard import Roots, allowed_hosts
from toolkit.studio.metrics import MAX_POINTS, MetricsReader

REPO = Path(__file__).resolve().parents[2]
BASE = "http://127.0.0.1:7860"


def write_run(root: Path, name: str, steps: int, max_steps: int, final: bool, checkpoints=()) -> Path:
    """A run folder as a run leaves it: marker, config, metrics (eval before and, when finished, after)."""
    run_dir = root / name
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / MARKER).write_text("{}\n")
    (run_dir / "config.yaml").write_text(
        f"output_dir: {run_dir}\nmodel:\n  path: toolkit/assets/tiny-llama\n  method: lora\n"
        f"lora:\n  use_dora: false\ntrain:\n  max_steps: {max_steps}\n"
    )
    lines = [{"step": 0, "eval_loss": 6.0, "exact_match": 0.1, "time": 1.0}]
    lines += [
        {"step": s, "loss": 6.0 - s / 10, "lr": 1e-3, "step_time_s": 0.5, "time": 1.0 + s}
        for s in range(1, steps + 1)
    ]
    if final:
        lines.append({"step": max_steps, "eval_loss": 2.0, "exact_match": 0.55, "time": 99.0})
        (run_dir / "final").mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    for step in checkpoints:
        (run_dir / "checkpoints" / f"step-{step}").mkdir()
    return run_dir


@pytest.fixture
def roots(tmp_path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "data").mkdir()
    return Roots((tmp_path / "runs").resolve(), (tmp_path / "data").resolve())


@pytest.fixture
def client(roots):
    app = create_app(roots, None, allowed_hosts("127.0.0.1", 7860))
    with TestClient(app, base_url=BASE) as client:
        yield client


def test_status_and_result_read_from_the_folder(roots):
    write_run(roots.runs, "done", 10, 10, final=True, checkpoints=[10])
    write_run(roots.runs, "halted", 4, 10, final=False, checkpoints=[4])
    write_run(roots.runs, "early", 2, 10, final=False)
    views = {v.name: v for v in (runs.summarize(roots.runs, d) for d in runs.run_dirs(roots.runs))}
    assert views["done"].status == "finished"
    assert views["done"].result == "held-out exact match 10.0% -> 55.0%"
    assert (views["halted"].status, views["halted"].resumable, views["halted"].step) == ("stopped", True, 4)
    assert views["early"].status == "failed"
    assert "terminal" in views["early"].reason  # started outside the studio: its reason is not on disk
    assert views["done"].recipe == "sft" and views["done"].method == "lora"


def test_a_held_lock_is_running_and_the_log_gives_a_failure_its_line(roots):
    run_dir = write_run(roots.runs, "live", 3, 10, final=False)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl,sys,time; h=open(sys.argv[1],'a'); fcntl.flock(h, fcntl.LOCK_EX); "
            "print('locked', flush=True); time.sleep(60)",
            str(run_dir / LOCK),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        view = runs.summarize(roots.runs, run_dir)
        assert view.status == "running" and view.eta_s == pytest.approx(7 * 0.5)
    finally:
        holder.kill()
        holder.wait()
    record = runs.record_dir(roots.runs, "live")
    record.mkdir(parents=True)
    (record / "launch.json").write_text(json.dumps({"argv": [], "pid": 0, "created": True}))
    (record / "output.log").write_text("noise\nfinetune_llm: error: data.train: x.jsonl does not exist\n")
    (record / "exit").write_text("2\n")
    view = runs.summarize(roots.runs, run_dir)
    assert (view.status, view.reason) == ("failed", "finetune_llm: error: data.train: x.jsonl does not exist")


def test_metrics_downsampled_with_the_last_point_exact_and_read_as_they_grow(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": s, "loss": float(s), "lr": 0.1} for s in range(1, 20_001)]
    lines += [{"step": s, "eval_loss": 2.0} for s in range(1000, 20_001, 1000)]  # a rarer kind of line
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    reader = MetricsReader()
    series, read = reader.series(path)
    assert read == len(lines) and len(series["eval_loss"]) == 20  # every line of a rare kind
    loss = series["loss"]
    assert len(loss) == MAX_POINTS and loss[-1] == [20_000, 20_000.0] and loss[0][0] <= 30
    assert all(a[0] < b[0] for a, b in zip(loss, loss[1:]))
    with path.open("a") as handle:
        handle.write(
            json.dumps({"step": 20_001, "loss": 1.0}) + "\n" + '{"step": 20002, "lo'
        )  # being written
    series, read = reader.series(path)
    assert series["loss"][-1] == [20_001, 1.0] and read == len(lines) + 1
    path.write_text(json.dumps({"step": 1, "loss": 3.0}) + "\n")  # a resume rewrites the file
    assert reader.series(path) == ({"loss": [[1, 3.0]]}, 1)


def test_a_non_loopback_host_without_authentication_is_refused(capsys):
    assert main(["studio", "--host", "0.0.0.0", "--runs", "/nonexistent/never-made"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--token" in err and "--password-file" in err
    assert not Path("/nonexistent/never-made").exists()


def test_a_token_is_needed_when_set(roots):
    app = create_app(roots, "s3cret-token", allowed_hosts("127.0.0.1", 7860))
    with TestClient(app, base_url=BASE) as client:
        assert client.get("/").status_code == 401
        assert client.get("/?token=wrong").status_code == 401
        assert client.get("/?token=s3cret-token").status_code == 200
        assert client.get("/").status_code == 200  # the cookie it set
    with TestClient(app, base_url=BASE) as client:  # no cookie: the header alone
        assert client.get("/", headers={"authorization": "Bearer wrong"}).status_code == 401
        assert client.get("/", headers={"authorization": "Bearer s3cret-token"}).status_code == 200


def test_every_changing_route_refuses_another_origin(client, roots):
    write_run(roots.runs, "halted", 4, 10, final=False, checkpoints=[4])
    posts = [r.path for r in client.app.routes if "POST" in getattr(r, "methods", ())]
    assert {"/new", "/run/{name}/stop", "/run/{name}/resume", "/run/{name}/delete", "/api/chat"} <= set(posts)
    for path in posts:
        url = path.replace("{name}", "halted")
        for headers in ({"origin": "http://evil.example"}, {"sec-fetch-site": "cross-site"}):
            response = client.post(
                url, headers=headers, data={"name": "x", "action": "start", "confirm": "halted"}
            )
            assert response.status_code == 403, (url, headers)
    assert sorted(p.name for p in roots.runs.iterdir()) == ["halted"]  # nothing started, nothing written
    for framework_route in ("/docs", "/redoc", "/openapi.json"):
        assert client.get(framework_route).status_code == 404


def test_another_host_name_is_refused(client):
    assert client.get("/", headers={"host": "rebound.example:7860"}).status_code == 403
    assert client.get("/", headers={"host": "localhost:7860"}).status_code == 200


@pytest.mark.parametrize("field", ["model", "data"])
def test_paths_out_of_the_roots_are_refused(roots, tmp_path, field):
    (tmp_path / "outside").mkdir()
    (roots.data / "link").symlink_to(tmp_path / "outside")
    for value in ("../outside", "link", str(tmp_path / "outside")):
        shown = runner.preview(runner.NewRun(name="r", **{field: value}), roots)
        assert "lies outside the runs folder" in shown.errors[field], value
    assert list(roots.runs.iterdir()) == []


def test_an_upload_over_the_cap_is_refused_and_nothing_is_kept(roots):
    app = create_app(roots, None, allowed_hosts("127.0.0.1", 7860), max_upload_mb=0.001)
    with TestClient(app, base_url=BASE) as client:
        big = b'{"messages": []}\n' * 100
        page = client.post(
            "/new", data={"name": "up", "action": "preview"}, files={"upload": ("d.jsonl", big)}
        )
        assert "larger than 0.001 MiB" in page.text
        small = b"not json\n"
        page = client.post(
            "/new", data={"name": "up", "action": "preview"}, files={"upload": ("d.jsonl", small)}
        )
        assert "upload: line 1: not valid JSON" in page.text
    assert not any(p.is_file() for p in roots.runs.rglob("*"))


def test_the_form_sets_no_key_but_its_own(roots):
    form = runner.NewRun.from_form(
        {"name": "r", "model.trust_remote_code": "true", "max_steps": "5 model.trust_remote_code=true"}
    )
    items = runner.overrides_of(form, roots, roots.runs / "r")
    assert not any("trust_remote_code" in item.split("=", 1)[0] for item in items)
    shown = runner.preview(form, roots)
    assert "train.max_steps" in shown.errors["max_steps"]


def test_delete_only_what_the_studio_created_and_only_once_confirmed(client, roots):
    other = write_run(roots.runs, "theirs", 4, 10, final=False, checkpoints=[4])
    assert client.post("/run/theirs/delete", data={"confirm": "theirs"}).status_code == 400
    assert other.is_dir()
    mine = write_run(roots.runs, "mine", 4, 10, final=False, checkpoints=[4])
    record = runs.record_dir(roots.runs, "mine")
    record.mkdir(parents=True)
    (record / "launch.json").write_text(json.dumps({"argv": [], "pid": 0, "created": True}))
    (record / "exit").write_text("75\n")
    response = client.post("/run/mine/delete", data={"confirm": ""})
    assert response.status_code == 400 and "type the run's name" in response.text and mine.is_dir()
    assert client.post("/run/mine/delete", data={"confirm": "mine"}).status_code == 200  # redirected to /
    assert not mine.exists() and not record.exists() and other.is_dir()


def test_a_foreign_file_in_a_created_run_stops_its_deletion(client, roots):
    mine = write_run(roots.runs, "mine", 4, 10, final=False, checkpoints=[4])
    (mine / "notes.txt").write_text("mine, not ftkit's")
    record = runs.record_dir(roots.runs, "mine")
    record.mkdir(parents=True)
    (record / "launch.json").write_text(json.dumps({"argv": [], "pid": 0, "created": True}))
    (record / "exit").write_text("75\n")
    response = client.post("/run/mine/delete", data={"confirm": "mine"})
    assert response.status_code == 400 and "notes.txt" in response.text
    assert (mine / "notes.txt").read_text() == "mine, not ftkit's"


def test_a_created_run_that_was_evaluated_is_deleted_whole(client, roots):
    mine = write_run(roots.runs, "mine", 4, 10, final=True, checkpoints=[4])
    (mine / "eval").mkdir()
    (mine / "eval" / "20260101-000000.md").write_text("| task |\n")
    rundir.record_eval(mine, ["20260101-000000.md"])  # as `ftkit eval` (the Evaluate button) leaves it
    record = runs.record_dir(roots.runs, "mine")
    record.mkdir(parents=True)
    (record / "launch.json").write_text(json.dumps({"argv": [], "pid": 0, "created": True}))
    (record / "exit").write_text("0\n")
    (mine / "eval" / "notes.md").write_text("mine, not ftkit's")
    response = client.post("/run/mine/delete", data={"confirm": "mine"})
    assert response.status_code == 400 and "eval/notes.md" in response.text
    (mine / "eval" / "notes.md").unlink()
    assert client.post("/run/mine/delete", data={"confirm": "mine"}).status_code == 200
    assert not mine.exists() and not record.exists()


def test_run_names_stay_inside_the_runs_folder(client, roots, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (roots.runs / "escape").symlink_to(tmp_path / "elsewhere")
    for name in ("..", "escape", "a/b"):
        shown = runner.preview(runner.NewRun(name=name), roots)
        assert shown.errors.get("name"), name
    assert client.get("/run/escape").status_code == 400


def test_stop_signals_the_process_group_and_the_waiter_records_the_exit(roots):
    """The waiter leads its own session; SIGINT to the group reaches the command, whose exit is recorded."""
    script = (
        "import signal, sys, time; signal.signal(signal.SIGINT, lambda *a: sys.exit(75)); "
        "print('up', flush=True); time.sleep(60)"
    )
    run_dir = roots.runs / "sleeper"
    run_dir.mkdir()
    (run_dir / MARKER).write_text("{}\n")
    pid = runner.launch(roots.runs, "sleeper", [sys.executable, "-c", script], created=True)
    log = runs.record_dir(roots.runs, "sleeper") / "output.log"
    deadline = time.monotonic() + 30
    while "up" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert os.getpgid(pid) == pid != os.getpgrp()
    assert runs.stop_run(roots.runs, run_dir) == f"sent SIGINT to process group {pid}"
    while runs.read_exit(roots.runs, "sleeper") is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert runs.read_exit(roots.runs, "sleeper") == 75


def test_eval_and_export_jobs_refuse_bad_input_before_anything_runs(roots):
    run_dir = write_run(roots.runs, "done", 10, 10, final=True, checkpoints=[10])
    with pytest.raises(UserError, match="--tasks: 'a; rm -rf' is not a comma-separated list"):
        jobs.start_eval(roots, run_dir, "a; rm -rf", "")
    with pytest.raises(UserError, match="--limit: 'all' is not a positive number"):
        jobs.start_eval(roots, run_dir, "ftkit_sums", "all")
    with pytest.raises(UserError, match="export: 'zip' is not merged or one of"):
        jobs.start_export(roots, run_dir, "zip")
    missing = jobs.gguf_missing()
    if missing:  # llama.cpp not installed: the exporter's own line, and no job
        with pytest.raises(UserError, match="llama.cpp is not installed"):
            jobs.start_export(roots, run_dir, "q8_0")
    assert not runs.record_dir(roots.runs, "done").exists()


def test_a_run_started_elsewhere_is_stopped_through_the_group_of_its_lock_holder(roots):
    run_dir = write_run(roots.runs, "theirs", 3, 10, final=False)
    script = (
        "import fcntl, signal, sys, time; h = open(sys.argv[1], 'a'); fcntl.flock(h, fcntl.LOCK_EX); "
        "signal.signal(signal.SIGINT, lambda *a: sys.exit(75)); print('locked', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", script, str(run_dir / LOCK)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert runs.stop_run(roots.runs, run_dir) == f"sent SIGINT to process group {holder.pid}"
        assert holder.wait(timeout=30) == 75
    finally:
        holder.kill()
    with pytest.raises(UserError, match="stop: theirs is not running"):
        runs.stop_run(roots.runs, run_dir)
