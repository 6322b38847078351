"""recipes/grpo_llm.py sampling with the vLLM engine (grpo.generation=vllm) on tiny-llama-q64, whose head
size (32) vLLM's CPU attention serves: LoRA with its adapter hot-loaded each round and full fine-tuning with
its weights reloaded each round, each on one process with an engine ftkit starts itself and on ZeRO-3 x2
(LoRA: with an engine the test started, grpo.vllm.url), the same per-step loss; the engine's
log-probabilities against the trainer's; resume mid-round; the refusal of a model it cannot serve. The LoRA
runs distill on-policy from a perturbed copy of the model (grpo.teacher) beside the reward, so the teacher's
scoring of the engine's samples is in every LoRA comparison.

These need .venv-vllm (`make install-vllm`) and skip, saying so, where it is missing; `make test-vllm` runs
them. Rewards: whether a completion holds an "s" (most of the bare model's random completions do, not all),
so groups differ and the adapter moves from the first round.
"""

import contextlib
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import REPO, launch, run_launched, run_script, short_grpo_args, train_lines
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from toolkit.engine import client
from toolkit.engine.server import ENGINE_VENV, Engine, ServeSpec
from toolkit.errors import USER_ERROR_EXIT_CODE
from toolkit.grpo.config import GrpoConfig
from toolkit.train.metrics import read_metrics

pytestmark = pytest.mark.skipif(
    not (ENGINE_VENV / ".installed").is_file(),  # written once `make install-vllm` has finished
    reason=f"no engine environment at {ENGINE_VENV}: `make install-vllm` builds it, `make test-vllm` runs it",
)

RECIPE = REPO / "recipes" / "grpo_llm.py"
MODEL = REPO / "toolkit" / "assets" / "tiny-llama-q64"
STEPS = 4
LORA_RANK = 8
# The engine's and the trainer's log-probabilities of the same sampled tokens, both in float32 and both of
# the tempered distribution (grpo.temperature 0.7): measured here at 1.7e-7 to 2.1e-7 mean and 9.5e-7 max at
# temperature 1 (the adapter left unsynced: 4.5e-2 mean in the second round; the trainer untempered at 0.7:
# the gap is that of two distributions, far above these).
GAP_MEAN, GAP_MAX = 1e-5, 5e-5


def run_args(out, *overrides: str, method: str = "lora") -> list[str]:
    per_method = {
        "lora": ["train.learning_rate=5e-3"],
        "full": ["train.learning_rate=2e-4", f"grpo.reference_model={MODEL}"],
    }
    return [
        *short_grpo_args(out, STEPS, 16, 4),
        f"model.path={MODEL}",
        f"model.method={method}",
        f"lora.r={LORA_RANK}",
        f"lora.alpha={2 * LORA_RANK}",
        *per_method[method],
        "train.save_every_steps=1",
        "data.max_length=64",
        "data.eval_fraction=0.02",
        "grpo.num_generations=4",
        "grpo.max_new_tokens=8",
        "grpo.temperature=0.7",
        "grpo.steps_per_generation=2",
        "grpo.beta=0.05",
        "grpo.rewards=[format]",
        "grpo.format_pattern=.*s.*",
        "grpo.generation=vllm",
        *overrides,
    ]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> list[str]:
    """The LoRA runs' grpo.teacher: the served model, every weight moved by 3 of its tensor's stds of noise
    (its reverse KL from the model: about 0.3 a token), its tokenizer kept."""
    folder = tmp_path_factory.mktemp("teacher") / "model"
    shutil.copytree(MODEL, folder)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    noise = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=noise) * p.std() * 3)
    model.save_pretrained(folder)
    return [f"grpo.teacher={folder}"]


def distilled(method: str, request) -> list[str]:
    return request.getfixturevalue("teacher") if method == "lora" else []


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One engine for the runs that connect to one (grpo.vllm.url), started the way ftkit starts its own."""
    log = tmp_path_factory.mktemp("engine") / "vllm.log"
    served = Engine.start(ServeSpec(str(MODEL), "float32", 128, lora_rank=LORA_RANK), log)
    try:
        served.wait_ready(600)
        yield served
    finally:
        served.stop()


def test_a_seeded_round_past_one_scheduler_step_is_sampled_whole(engine):
    """The demo's round shape (64 seeded requests of 38-token prompts: 2432 tokens, past vLLM's 2048-token
    step) and one prompt as long as the engine takes: split over steps, vLLM's CPU engine died rewinding
    a seeded generator (server.py, WHOLE_PREFILLS)."""
    prompts = [[4 + (i * 37 + j * 11) % 2000 for j in range(38)] for i in range(64)] + [[5] * 120]
    sampling = GrpoConfig(max_new_tokens=4)
    done = client.complete(engine.url, "base", prompts, list(range(len(prompts))), sampling, [2])
    assert [len(c.tokens) > 0 for c in done] == [True] * len(prompts)
    assert client.healthy(engine.url)
    # A group asked for in one request (n 4, grpo.vllm.n_per_prompt) is the four asked one by one, seeded
    # seed, seed + 1, ...: the same tokens and log-probs.
    sampling = GrpoConfig(max_new_tokens=8, temperature=0.7)
    at_once = client.complete(engine.url, "base", prompts[:3], [7, 70, 700], sampling, [2], n=4)
    one_by_one = client.complete(
        engine.url,
        "base",
        [p for p in prompts[:3] for _ in range(4)],
        [s + g for s in (7, 70, 700) for g in range(4)],
        sampling,
        [2],
    )
    assert [c.tokens for c in at_once] == [c.tokens for c in one_by_one]
    flat = lambda done: [logp for c in done for logp in c.logps]  # noqa: E731
    assert flat(at_once) == pytest.approx(flat(one_by_one), abs=1e-6)
    assert len({tuple(c.tokens) for c in at_once}) > 3  # the group's completions differ


class EngineKiller(threading.Thread):
    """SIGKILLs the run's own engine (the vLLM server writing to OUT/engine/vllm.log, a child of the run's
    process) while a round's requests are in flight: once step `after` is logged (the round before it is
    trained) and two or more requests to it are open. `killed`: (its pid, the requests open) once done."""

    def __init__(self, out, after: int):
        super().__init__(daemon=True)
        self.out, self.after, self.done = out, after, threading.Event()
        self.killed: tuple[int, int] | None = None
        self.error: BaseException | None = None  # raised by __exit__: a watcher that died says why

    def run(self) -> None:
        try:
            self.watch()
        except BaseException as exc:
            self.error = exc

    def watch(self) -> None:
        while not self.done.is_set() and self.after not in [r["step"] for r in logged_steps(self.out)]:
            time.sleep(0.1)
        pid = port = None
        while not self.done.is_set():
            if pid is None:  # looked for until found: one look can fall between /proc's entries changing
                pid = own_engine(self.out)
                port = pid and int(cmdline(pid)[cmdline(pid).index("--port") + 1])
                time.sleep(0 if pid else 0.05)
                continue
            requests = open_requests(port)
            if requests >= 2:
                os.kill(pid, signal.SIGKILL)
                self.killed = (pid, requests)
                return
            time.sleep(0.002)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.join()
        if self.error is not None:
            raise self.error


def logged_steps(out) -> list[dict]:
    """The steps logged so far; a line the run is writing as it is read is left for the next look."""
    return [r for r in read_metrics(out / "metrics.jsonl", on_torn_tail=lambda _: None) if "loss" in r]


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def open_files(pid: int) -> list[str]:
    files = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            files.append(os.readlink(fd))
    return files


def own_engine(out) -> int | None:
    """The pid of the vLLM server writing OUT/engine/vllm.log (the run's first engine copy: only an engine
    the run started writes there), None when there is none yet."""
    log = str(out / "engine" / "vllm.log")
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError):
            pid = int(proc.name)
            if "vllm.entrypoints.openai.api_server" in cmdline(pid) and log in open_files(pid):
                return pid
    return None


def open_requests(port: int) -> int:
    """Connections to `port` its server holds open (ESTABLISHED, local side)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            count += state == "01" and int(local.rsplit(":", 1)[1], 16) == port
    return count


def launched(args: list[str], out, processes: int = 0, config: str = ""):
    """`run_script` that returns whatever the run ended with."""
    head = [
        sys.executable,
        *(["-m", "accelerate.commands.launch", *launch(config, processes)] if config else []),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    return run_launched([*head, str(RECIPE), *args], env, keep=out)


@pytest.fixture(scope="module", params=["lora", "full"])
def own(request, tmp_path_factory):
    """One process, the engine started by the run itself: (method, output_dir, result, killed). LoRA: two
    copies of it (grpo.vllm.replicas 2) asked a request per completion (grpo.vllm.n_per_prompt false: the
    ZeRO-3 run below asks one engine for a group at once, and gets the same steps), the first copy killed
    while round 1's requests are in flight, and restarted (grpo.vllm.restarts unset); killed: what
    EngineKiller killed (None for full fine-tuning, left alone, a group a request)."""
    out = tmp_path_factory.mktemp(f"grpo-engine-{request.param}") / "run"
    copies = ["grpo.vllm.replicas=2", "grpo.vllm.n_per_prompt=false"] if request.param == "lora" else []
    args = run_args(out, *copies, *distilled(request.param, request), method=request.param)
    if request.param == "full":
        return request.param, out, run_script(RECIPE, args, out), None
    with EngineKiller(out, after=2) as killer:
        result = run_script(RECIPE, args, out)
    return request.param, out, result, killer.killed


@pytest.fixture(scope="module")
def zero3(own, request, tmp_path_factory):
    """ZeRO-3 on two processes: LoRA on the shared engine; a full fine-tune on its own, since reloading
    whole weights changes what an engine serves to every run. Full: its engine killed while round 1's
    requests are in flight with grpo.vllm.restarts 0 and no checkpoint due: (output_dir, the relaunch's
    result, the killed launch's result, what EngineKiller killed)."""
    method = own[0]
    out = tmp_path_factory.mktemp(f"grpo-engine-zero3-{method}") / "run"
    shared = [f"grpo.vllm.url={request.getfixturevalue('engine').url}"] if method == "lora" else []
    args = run_args(out, *shared, *distilled(method, request), method=method)
    if method == "lora":
        return out, run_script(RECIPE, args, out, 2, "zero3"), None, None
    lost_args = [*args, "grpo.vllm.restarts=0", "train.save_every_steps=0"]
    with EngineKiller(out, after=2) as killer:
        lost = launched(lost_args, out, 2, "zero3")
    return out, run_script(RECIPE, args, out, 2, "zero3"), lost, killer.killed


def test_the_run_starts_its_engine_says_where_and_stops_it(own):
    method, out, result, _ = own
    said = re.findall(
        r"engine: vLLM started by ftkit at (\S+)( \(replica \d of 2\))? in [\d.]+ s; log: (\S+)",
        result.stdout,
    )
    logs = ["vllm.log", "vllm-2.log"] if method == "lora" else ["vllm.log"]
    assert [(copy, log) for _, copy, log in said] == [
        (f" (replica {i + 1} of 2)" if method == "lora" else "", str(out / "engine" / name))
        for i, name in enumerate(logs)
    ], result.stdout[-2000:]
    for url, _, log in said:
        assert url.startswith("http://127.0.0.1:") and Path(log).is_file()
        assert not client.healthy(url)  # stopped with the run
    assert own_engine(out) is None  # and so is the one started again after a kill (LoRA)
    # Only the last round's weights are kept (an adapter under a new name each round, the one before dropped).
    kept = "adapter-round-1" if method == "lora" else "weights-round-1"
    assert [p.name[:15] for p in (out / "engine").glob("*-round-*")] == [kept]


def test_trains_on_the_engines_samples_with_the_weights_synced_each_round(own):
    method, out, _, _ = own
    lines = train_lines(out)
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    assert [r["sync_s"] > 0 for r in lines] == [True, False, True, False]  # rounds start at steps 1 and 3
    assert all(r["advantage_std"] > 0 and r["grad_norm"] > 0 for r in lines)
    assert not any("wake_s" in r or "sleep_s" in r for r in lines)  # vLLM's CPU engine never sleeps
    assert lines[1]["kl"] > 0 and lines[-1]["kl"] > 0  # the adapter moved the policy from the reference
    # Round 2 samples from the weights trained in round 1: an unsynced engine would sample from the base.
    for r in lines:
        assert r["engine_logprob_gap_mean"] < GAP_MEAN and r["engine_logprob_gap_max"] < GAP_MAX, r
    # LoRA: the teacher scored the engine's samples, each step's reverse-KL estimate logged.
    kls = [r.get("teacher_kl") for r in lines]
    assert all(math.isfinite(kl) and kl > 0 for kl in kls) if method == "lora" else kls == [None] * STEPS, kls


def test_zero3_on_two_processes_gets_the_same_steps(own, zero3):
    """The main process sends the same requests with the same seeds whatever the layout (and here to another
    engine): the completions, and so every step, are the same."""
    expected, got = train_lines(own[1]), train_lines(zero3[0])
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    if own[0] == "lora":
        assert "engine: vLLM at http://" in zero3[1].stdout  # the user's engine, not one it started
    for a, b in zip(expected, got, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-3), a["step"]
        for key in ("reward", "completion_len", "advantage_std"):
            assert b[key] == pytest.approx(a[key], rel=1e-6), (a["step"], key)
        assert b["kl"] == pytest.approx(a["kl"], rel=1e-3, abs=1e-6), a["step"]
        assert b.get("teacher_kl", 0) == pytest.approx(a.get("teacher_kl", 0), rel=1e-3, abs=1e-6), a["step"]
        assert b["engine_logprob_gap_max"] < GAP_MAX
    # Each round's sync gathered the adapter alone (its float32 weights), or the whole weights it wrote.
    assert [r["sync_gathered_mb"] > 0 for r in got] == [True, False, True, False]
    if own[0] == "lora":
        weights, _ = stored(zero3[0] / "final" / "adapter_model.safetensors")
        sent_mb = weights * 4 / 2**20
        assert sent_mb < stored(MODEL / "model.safetensors")[0] * 4 / 2**20 / 10
    else:
        sent_mb = stored(zero3[0] / "engine" / "weights-round-1" / "model.safetensors")[1] / 2**20
    assert all(r["sync_gathered_mb"] == pytest.approx(sent_mb, rel=1e-6) for r in got if r["sync_s"] > 0)


def stored(file) -> tuple[int, int]:
    """(weights, bytes) a safetensors file holds."""
    weights = size = 0
    with safe_open(str(file), framework="pt") as handle:
        for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
            count = math.prod(handle.get_slice(name).get_shape())
            weights += count
            size += count * handle.get_tensor(name).element_size()
    return weights, size


def test_an_engine_killed_mid_round_is_started_again_and_the_round_goes_on(own):
    """LoRA, one process: the engine ftkit started is SIGKILLed while round 1's requests are out; the run
    restarts it with the adapter it served and sends the round again (every step the same as the
    undisturbed runs': test_zero3_on_two_processes_gets_the_same_steps, and the relaunch below)."""
    method, out, result, killed = own
    if method == "full":
        pytest.skip("the full fine-tune's engine is killed under ZeRO-3, without restarts (below)")
    assert killed is not None, "the engine was not caught with a round in flight"
    said = re.findall(
        r"grpo.vllm: the engine \(replica 1 of 2\) exited \(code -9\): .*; "
        r"ftkit restarted it \(1 of grpo.vllm.restarts 2\) in [\d.]+ s.*",
        result.stdout,
    )
    assert len(said) == 1, result.stdout[-3000:]
    assert "its log: " + str(out / "engine" / "vllm.log") in said[0]
    log = (out / "engine" / "vllm.log").read_text(errors="replace")
    assert (
        log.count("Initializing a V1 LLM engine") == 2
    )  # the first server's output kept, the second's after it
    assert [r["step"] for r in train_lines(out)] == list(range(1, STEPS + 1))


def test_an_engine_lost_without_restarts_saves_the_steps_and_the_relaunch_matches(own, zero3):
    """Full fine-tuning, ZeRO-3 x2, grpo.vllm.restarts 0, no checkpoint due: the engine SIGKILLed while
    round 1's requests are out; the run saves step 2, ends in one line naming the log's reason and the
    command that continues; that relaunch re-samples round 1 with its seeds and finishes as one process
    undisturbed did (test_zero3_on_two_processes_gets_the_same_steps compares every step)."""
    if own[0] == "lora":
        pytest.skip("the LoRA run's engine is restarted (above)")
    out, relaunch, lost, killed = zero3
    assert killed is not None, "the engine was not caught with a round in flight"
    assert lost.returncode != 0
    lines = [line for line in lost.stderr.splitlines() if "grpo.vllm: the engine" in line]
    assert lines and len(set(lines)) == 1, lost.stderr[-3000:]  # the same line from both processes
    assert re.search(
        r"grpo_llm: error: grpo.vllm: the engine exited \(code -9\): .*; its log: \S+vllm.log; "
        r"checkpoint of step 2 in \S+/checkpoints/step-2; continue: accelerate launch <launch options> "
        r"\S+grpo_llm.py .*train.resume=auto$",
        lines[0],
    ), lines[0]
    assert (
        'grpo_llm.py", line' not in lost.stderr
    )  # no traceback through the recipe (torchrun prints its own)
    assert "resum" in relaunch.stdout


def test_a_relaunch_after_a_stop_mid_round_resumes_exactly(own, request, tmp_path):
    """Stopped after step 1 (its round half trained): the relaunch trains on the saved completions, then
    syncs the resumed adapter to an engine (another one than the run started) and samples the next round."""
    if own[0] == "full":
        pytest.skip("resuming is the same code for both methods; the sync is tested above")
    engine = request.getfixturevalue("engine")
    copy = tmp_path / "run"
    shutil.copytree(own[1], copy)
    for later in (copy / "checkpoints").glob("step-*"):
        if int(later.name[5:]) > 1:
            shutil.rmtree(later)
    shutil.rmtree(copy / "final")
    overrides = [f"grpo.vllm.url={engine.url}", *distilled(own[0], request)]
    result = run_script(RECIPE, run_args(copy, *overrides), copy)
    assert "resum" in result.stdout and "engine: vLLM at http://" in result.stdout  # it sampled round 2
    expected, got = train_lines(own[1]), train_lines(copy)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(expected, got, strict=True):
        for key in ("loss", "reward", "kl", "grad_norm", "teacher_kl"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (a["step"], key)


def test_a_model_the_cpu_engine_cannot_serve_is_one_line(tmp_path):
    """tiny-llama's head size (40), which vLLM's CPU attention refuses at its first forward pass minutes into
    the engine's start, is one line before the run writes anything (the refusal read from the engine's log,
    for a model ftkit cannot read ahead: tests/unit/test_engine.py)."""
    out = tmp_path / "run"
    args = run_args(out, f"model.path={REPO / 'toolkit' / 'assets' / 'tiny-llama'}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, str(RECIPE), *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=600
    )
    assert result.returncode == USER_ERROR_EXIT_CODE, result.stderr[-2000:]
    assert "the CPU engine cannot serve" in result.stderr and "head_dim=40" in result.stderr
    assert "Traceback" not in result.stderr and not out.exists()


# grpo.async_rounds=1: six rounds of two steps, checkpoints after steps 3 (mid-round), 6, 9, on the shared
# engine. The bare model's logits are nearly flat (std 0.16 over 2048 tokens): 80% of its completions hold
# an "s" whatever an adapter does; sampled from each position's two likeliest tokens (top_k 2), 6% do at
# first, and the adapter learns within a few rounds to pick the one with an "s" (at 5e-2 the KL reached 1.8
# by step 3 and the reward fell to 0). The engine's top-2 log-probs, lifted by the trainer's kept mass, meet
# the trainer's whole softmax in round 0 (unlifted, 5.7 nats apart: the bound below catches it).
AHEAD_STEPS = 12
AHEAD = [
    "grpo.async_rounds=1",
    f"train.max_steps={AHEAD_STEPS}",
    "train.save_every_steps=3",
    "train.learning_rate=1e-2",
    "grpo.top_k=2",
]


@pytest.fixture(scope="module")
def ahead(engine, tmp_path_factory):
    """One process, round k+1 generated while round k trains: (output_dir, result)."""
    out = tmp_path_factory.mktemp("grpo-engine-ahead") / "run"
    return out, run_script(RECIPE, run_args(out, *AHEAD, f"grpo.vllm.url={engine.url}"), out)


def rounds_of(lines: list[dict]) -> list[dict]:
    """Per round, its first step's line with `ended`: when its last step ended (its first's: `time`)."""
    rounds = {}
    for r in lines:
        times = rounds.setdefault((r["generation_started_at"], r["generation_ended_at"]), dict(r, ended=0.0))
        times["ended"] = max(times["ended"], r["time"])
    return sorted(rounds.values(), key=lambda r: r["generation_started_at"])


def test_async_rounds_generate_the_next_round_while_this_one_trains(ahead):
    out, _ = ahead
    lines = train_lines(out)
    assert [r["step"] for r in lines] == list(range(1, AHEAD_STEPS + 1))
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in lines)
    # Round 0 is generated before anything trains; every later one with the weights of a round before.
    assert [r["staleness"] for r in lines] == [0, 0] + [1] * (AHEAD_STEPS - 2)
    rounds = rounds_of(lines)
    assert len(rounds) == AHEAD_STEPS // 2
    for before, after in zip(rounds, rounds[1:]):
        # Round k+1's requests were out while round k trained: sent before its first step ended (`time`),
        # back after its training began.
        assert after["generation_started_at"] < before["time"] <= before["ended"]
        assert after["generation_ended_at"] > before["training_started_at"]
    # The engine's weights are a round old: its log-probs differ from the trainer's by far more than the
    # numerical gap of a synced round (round 0), which the importance weights correct.
    assert lines[0]["engine_logprob_gap_max"] < GAP_MAX
    assert all(r["engine_logprob_gap_mean"] > 10 * GAP_MEAN for r in lines[2:])
    # It learns all the same: the last two rounds' completions hold an "s" far more often than the first two.
    first, last = (sum(r["reward"] for r in part) / 4 for part in (lines[:4], lines[-4:]))
    assert last > first + 0.5, (first, last)


def test_async_rounds_on_zero3_get_the_same_steps(ahead, engine, tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo-engine-ahead-zero3") / "run"
    run_script(RECIPE, run_args(out, *AHEAD, f"grpo.vllm.url={engine.url}"), out, 2, "zero3")
    expected, got = train_lines(ahead[0]), train_lines(out)
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for a, b in zip(expected, got, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-3), a["step"]
        for key in ("reward", "completion_len", "staleness"):
            assert b[key] == pytest.approx(a[key], rel=1e-6), (a["step"], key)


def test_async_rounds_resume_exactly_after_a_stop_mid_round(ahead, engine, tmp_path):
    """Stopped after step 3 (round 1 half trained, round 2 in flight and kept by the checkpoint)."""
    copy = tmp_path / "run"
    shutil.copytree(ahead[0], copy)
    for later in (copy / "checkpoints").glob("step-*"):
        if int(later.name[5:]) > 3:
            shutil.rmtree(later)
    shutil.rmtree(copy / "final")
    result = run_script(RECIPE, run_args(copy, *AHEAD, f"grpo.vllm.url={engine.url}"), copy)
    assert "resum" in result.stdout
    expected, got = train_lines(ahead[0]), train_lines(copy)
    assert [r["step"] for r in got] == list(range(1, AHEAD_STEPS + 1))
    for a, b in zip(expected, got, strict=True):
        for key in ("loss", "reward", "kl", "grad_norm", "staleness"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (a["step"], key)
