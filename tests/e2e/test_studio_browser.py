"""`ftkit studio` in a real browser (Debian's chromium driven by Playwright): one studio on an empty runs
folder and one short demo run, started from the form, serve every test below, in file order. Each test
saves a screenshot of its page into docs/ (docs/studio.md shows them)."""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from helpers import REPO

from toolkit.studio import runs
from toolkit.train.metrics import read_metrics

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DOCS = REPO / "docs" / "studio"
RUN = "demo"
# Steps slow enough to stop in the middle, checkpoints to resume from, a short held-out check.
DEMO_FORM = {
    "name": RUN,
    "max_steps": "50",
    "save_every_steps": "5",
    "log_every_steps": "1",
    "exact_match_samples": "20",
}
LAUNCH_S = 300  # a launch's start, its evaluations and its steps on a loaded two-core machine

if not Path(CHROMIUM).is_file():
    pytest.skip(
        f"{CHROMIUM} is missing: run `make install-browser` (Debian's chromium)", allow_module_level=True
    )
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed: make install")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_studio(runs_dir: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "toolkit.commands.cli",
            "studio",
            "--runs",
            str(runs_dir),
            "--port",
            str(port),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.5)
    proc.kill()
    raise AssertionError("the studio did not answer within 120 s")


@pytest.fixture(scope="module")
def studio(tmp_path_factory):
    runs_dir = tmp_path_factory.mktemp("studio") / "runs"
    port = free_port()
    state = {"proc": start_studio(runs_dir, port), "url": f"http://127.0.0.1:{port}", "runs": runs_dir}
    state["restart"] = lambda: state.update(proc=start_studio(runs_dir, port))
    yield state
    for name in os.listdir(runs_dir / runs.STUDIO_DIR) if (runs_dir / runs.STUDIO_DIR).is_dir() else []:
        record = runs.read_record(runs_dir, name)
        if record.get("pgid") and runs.read_exit(runs_dir, name) is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(record["pgid"], signal.SIGKILL)
    state["proc"].terminate()
    state["proc"].wait(timeout=30)


@pytest.fixture(scope="module")
def page(studio):
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_default_timeout(60_000)
        yield page
        browser.close()


def shot(page, name: str) -> None:
    DOCS.mkdir(exist_ok=True)
    page.screenshot(path=str(DOCS / f"{name}.png"), full_page=True)


def status(page) -> str:
    return page.locator("#status").inner_text()


def wait_for_status(page, text: str, timeout_s: float = LAUNCH_S) -> None:
    page.wait_for_function(
        "t => (document.querySelector('#status') || {}).innerText?.startsWith(t)",
        arg=text,
        timeout=timeout_s * 1000,
    )


def loss_points(page) -> int:
    return int(page.locator("#chart-loss").get_attribute("data-points") or 0)


def check(page, studio, values: dict, upload: tuple | None = None):
    page.goto(studio["url"] + "/new")
    for name, value in values.items():
        field = page.locator(f"[name={name}]")
        if field.evaluate("e => e.tagName") == "SELECT":
            field.evaluate(
                "(e, v) => { if (![...e.options].some(o => o.value === v)) e.add(new Option(v, v)); }", value
            )
            field.select_option(value)
        else:
            field.fill(value)
    if upload:
        page.set_input_files(
            "[name=upload]", files=[{"name": upload[0], "mimeType": "application/json", "buffer": upload[1]}]
        )
    page.click("#check")
    page.wait_for_load_state()


WRONG = [
    ("name", {"name": "../escape"}, "name: '../escape' is not a run name"),
    ("recipe", {"name": "w", "recipe": "ppo"}, "recipe ppo: not one of"),
    ("model", {"name": "w", "model": "../../etc"}, "lies outside the runs folder"),
    ("data", {"name": "w", "data": "missing.jsonl"}, "data.train: missing.jsonl does not exist"),
    ("method", {"name": "w", "method": "full8"}, "model.method: 'full8' is not one of"),
    ("backend", {"name": "w", "backend": "warp"}, "--backend warp: not one of"),
    ("max_steps", {"name": "w", "max_steps": "ten"}, "train.max_steps"),
    ("learning_rate", {"name": "w", "learning_rate": "-1"}, "train.learning_rate"),
    ("global_batch_size", {"name": "w", "global_batch_size": "0"}, "train.global_batch_size"),
    ("micro_batch_size", {"name": "w", "micro_batch_size": "x"}, "train.micro_batch_size"),
    ("max_length", {"name": "w", "max_length": "many"}, "data.max_length"),
    ("lora_r", {"name": "w", "lora_r": "0"}, "lora.r"),
    ("save_every_steps", {"name": "w", "save_every_steps": "-5"}, "train.save_every_steps"),
    ("log_every_steps", {"name": "w", "log_every_steps": "0"}, "train.log_every_steps"),
    ("exact_match_samples", {"name": "w", "exact_match_samples": "some"}, "eval.exact_match_samples"),
]


@pytest.mark.parametrize(("field", "values", "message"), WRONG, ids=[w[0] for w in WRONG])
def test_each_wrong_value_is_named_beside_its_field_and_nothing_starts(page, studio, field, values, message):
    check(page, studio, values)
    error = page.locator(f".error[data-field={field}]")
    assert message in error.inner_text()
    assert not page.locator("#command").count()
    assert [p.name for p in studio["runs"].iterdir() if p.name != runs.STUDIO_DIR] == []
    if field == "backend":
        shot(page, "new-run-error")


def test_a_bad_upload_is_refused_and_not_kept(page, studio):
    check(page, studio, {"name": "w"}, upload=("rows.jsonl", b'{"messages": [}\n'))
    assert "upload: line 1: not valid JSON" in page.locator(".error[data-field=upload]").inner_text()
    assert not list(studio["runs"].rglob("*.jsonl"))


def test_the_demo_starts_from_the_form_trains_live_stops_and_resumes(page, studio):
    check(page, studio, {**DEMO_FORM, "backend": "single"})
    command = page.locator("#command").inner_text()
    assert (
        command.startswith("ftkit train sft --backend single output_dir=") and "train.max_steps=50" in command
    )
    assert "recommended:" in page.locator("#plan").inner_text()
    assert "chat template" in page.locator("#check-lines").inner_text()
    shot(page, "new-run")
    page.click("#start")
    page.wait_for_url(f"**/run/{RUN}?message=started")
    page.wait_for_function(
        "() => +(document.querySelector('#chart-loss')?.dataset.points || 0) >= 2", timeout=LAUNCH_S * 1000
    )
    first = loss_points(page)
    page.wait_for_function(
        f"() => +document.querySelector('#chart-loss').dataset.points > {first}", timeout=30_000
    )
    assert status(page) == "running"
    shot(page, "run")
    page.click("#stop")
    wait_for_status(page, "stopped, resumable", 120)
    assert "stopped by SIGINT after step" in status(page)
    stopped_at = int(page.locator("#progress").inner_text().split()[1])
    assert 0 < stopped_at < 50
    page.goto(studio["url"] + "/")
    row = page.locator(f"tr[data-run={RUN}]")
    assert "stopped, resumable" in row.inner_text()
    shot(page, "runs")

    page.goto(studio["url"] + f"/run/{RUN}")
    page.click("#resume")
    wait_for_status(page, "running")
    # The studio goes away and comes back: the run trains on, and the new studio finds it from its folder.
    studio["proc"].terminate()
    studio["proc"].wait(timeout=30)
    studio["restart"]()
    page.goto(studio["url"] + f"/run/{RUN}")
    # "starting" only in the moment between the run's lock going and its waiter writing the exit code
    assert status(page).split(",")[0] in ("running", "finished", "starting")
    wait_for_status(page, "finished")
    log = (studio["runs"] / runs.STUDIO_DIR / RUN / "output.log").read_text()
    assert f"resumed from {studio['runs'] / RUN}/checkpoints/step-{stopped_at} at step {stopped_at}" in log
    assert page.locator("#result").inner_text().startswith("result: held-out exact match ")
    steps = [r["step"] for r in read_metrics(studio["runs"] / RUN / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, 51))  # the resumed run continued where the stop left it


def test_chat_answers_from_the_fine_tuned_run_and_its_base(page, studio):
    page.goto(studio["url"] + "/chat")
    page.select_option("[name=left]", f"run:{RUN}")
    page.select_option("[name=right]", "path:toolkit/assets/tiny-llama")
    page.fill("[name=prompt]", "What is 38 + 47?")
    page.click("#ask")
    page.wait_for_function(
        "() => ['left', 'right'].every(s => document.getElementById('answer-' + s).dataset.done)",
        timeout=180_000,
    )
    tuned = page.locator("#answer-left").inner_text().strip()
    assert tuned and "[error]" not in tuned and any(c.isdigit() for c in tuned)
    assert page.locator("#answer-right").inner_text().strip()
    shot(page, "chat")
    # An answer that calls a tool (as the tool-use demo's models do) shows the call as one, apart from text.
    shown = page.evaluate(
        """() => { const d = document.createElement('div');
        showAnswer(d, 'Let me add.<tool_call>{"name": "add", "arguments": {"a": 38, "b": 47}}</tool_call>');
        return [d.querySelector('.tool-call')?.textContent, d.firstChild.textContent]; }"""
    )
    assert shown == ['tool call: {"name": "add", "arguments": {"a": 38, "b": 47}}', "Let me add."]


def test_two_runs_overlay(page, studio):
    # A second run folder, as one started from a command line elsewhere would leave it.
    shutil.copytree(
        studio["runs"] / RUN, studio["runs"] / "demo-copy", ignore=shutil.ignore_patterns("*.lock")
    )
    page.goto(studio["url"] + f"/compare?run={RUN}&run=demo-copy")
    page.wait_for_function("() => +(document.querySelector('#chart-loss')?.dataset.lines || 0) >= 4")
    assert int(page.locator("#chart-loss").get_attribute("data-lines")) == 4  # loss and eval loss of each
    shot(page, "compare")


def test_evaluate_and_export(page, studio):
    page.goto(studio["url"] + f"/tools?run={RUN}")
    page.fill("[name=limit]", "10")
    page.click("#eval")
    page.select_option("[name=kind]", "merged")
    page.click("#export")
    ended = "() => [...document.querySelectorAll('.job .status')].every(s => s.innerText != 'running')"
    page.wait_for_function(ended, timeout=LAUNCH_S * 1000)
    jobs = page.locator(".job").all_inner_texts()
    assert all(" · done · " in job for job in jobs), jobs
    assert (studio["runs"] / f"{RUN}-merged" / "config.json").is_file()
    eval_job = next(job for job in jobs if "ftkit eval" in job)
    assert "| task | metric | fine-tuned | base |" in eval_job and "| ftkit_sums | exact_match |" in eval_job
    export_job = next(job for job in jobs if "ftkit export" in job)
    assert f"to {studio['runs'] / RUN}-merged" in export_job  # where the files went
    if page.locator("#gguf-missing").count():
        assert "llama.cpp is not installed" in page.locator("#gguf-missing").inner_text()
    else:  # llama.cpp installed (make install-export): one GGUF file too
        page.select_option("[name=kind]", "q8_0")
        page.click("#export")
        page.wait_for_function(ended, timeout=LAUNCH_S * 1000)
        assert all(" · done · " in job for job in page.locator(".job").all_inner_texts())
        assert list((studio["runs"] / f"{RUN}-gguf").glob("*.gguf"))
    shot(page, "tools")


class Attacker(BaseHTTPRequestHandler):
    """A page on another origin whose form starts a run on the studio as soon as it loads."""

    target = ""

    def do_GET(self):
        body = (
            f'<form id="f" method="post" action="{self.target}/new"><input name="name" value="planted">'
            '<input name="action" value="start"></form><script>f.submit()</script>'
        ).encode()
        self.send_response(200)
        self.send_header("content-type", "text/html")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_start_from_another_origin_is_refused(page, studio):
    Attacker.target = studio["url"]
    server = HTTPServer(("127.0.0.1", free_port()), Attacker)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        page.goto(f"http://127.0.0.1:{server.server_port}/")
        page.wait_for_url(f"{studio['url']}/new")
        assert page.locator("body").inner_text().startswith("refused:")
    finally:
        server.shutdown()
    assert not (studio["runs"] / "planted").exists() and not runs.read_record(studio["runs"], "planted")


def test_a_non_loopback_start_without_authentication_is_refused(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "toolkit.commands.cli",
            "studio",
            "--host",
            "0.0.0.0",
            "--runs",
            str(tmp_path / "r"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert (
        done.stderr.strip().startswith("ftkit studio: error: --host 0.0.0.0:")
        and len(done.stderr.splitlines()) == 1
    )
    assert not (tmp_path / "r").exists()
