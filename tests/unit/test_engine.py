"""The generation engine's part that needs no engine: how it is started (never a checkpoint's code unless
asked), its one-line failures (not installed, port in use, not reachable, a refusal in its log), the
GRPO settings it refuses, and the log-probability gap it is measured by."""

import http.server
import re
import socket
import subprocess
import threading
from pathlib import Path

import pytest
import torch

from toolkit.engine import client, server
from toolkit.engine.server import (
    Engine,
    ServeSpec,
    check_cpu_head_size,
    engine_python,
    free_port,
    serve_command,
)
from toolkit.errors import UserError
from toolkit.grpo.config import load_grpo_config
from toolkit.grpo.engine import EngineSampler, logprob_gap
from toolkit.grpo.engine_start import served_base

Q64 = Path(__file__).resolve().parents[2] / "toolkit" / "assets" / "tiny-llama-q64"

REPO = Path(__file__).resolve().parents[2]


def fake_venv(tmp_path: Path) -> Path:
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").write_text("")
    return tmp_path / "venv"


def test_a_missing_engine_environment_names_make_install_vllm(tmp_path):
    with pytest.raises(
        UserError, match=r"no engine environment at .*nowhere; build it with `make install-vllm`"
    ):
        engine_python(tmp_path / "nowhere")
    with pytest.raises(UserError, match="make install-vllm"):
        Engine.start(ServeSpec("m", "float32", 64), tmp_path / "log", venv=tmp_path / "nowhere")


def test_a_port_in_use_is_one_line_before_anything_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UserError, match=f"grpo.vllm.port: 127.0.0.1:{port} is in use"):
            Engine.start(ServeSpec("m", "float32", 64), tmp_path / "log", port=port, venv=fake_venv(tmp_path))
    assert not (tmp_path / "log").exists()


def test_an_engine_nobody_listens_for_is_not_reachable():
    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    assert not client.healthy(url)
    with pytest.raises(UserError, match=f"the engine at {url} is not reachable"):
        client.load_adapter(url, "round-0", "/tmp/adapter")


def test_an_engine_still_starting_says_so_every_while_and_gives_up_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(server, "STILL_STARTING_S", 0.3)
    process = subprocess.Popen(["sleep", "60"], start_new_session=True)  # alive, never answering
    engine = Engine(f"http://127.0.0.1:{free_port('127.0.0.1')}", process, tmp_path / "vllm.log")
    said = []
    with pytest.raises(UserError, match=r"did not answer within 2 s; its log: .*vllm.log$"):
        engine.wait_ready(2.0, say=said.append)
    assert len(said) >= 3 and all(
        re.fullmatch(
            r"engine: still starting, \d+ s of grpo.vllm.start_timeout_s 2; its log: .*vllm.log", line
        )
        for line in said
    ), said
    assert process.poll() is not None  # stopped


def test_an_engine_of_yours_must_answer_and_serve_the_base_before_the_run_writes():
    closed = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    with pytest.raises(UserError, match=f"grpo.vllm.url: no engine answers at {closed}/health"):
        server.check_answers(closed)

    class OtherModel(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"data": [{"id": "Qwen/Qwen3-0.6B"}]}' if "models" in self.path else b"")

        def log_message(self, *args):
            pass

    other = http.server.HTTPServer(("127.0.0.1", 0), OtherModel)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{other.server_address[1]}"
    try:
        with pytest.raises(UserError, match="serves Qwen/Qwen3-0.6B, not 'base': start it with --served-mod"):
            server.check_answers(url)
    finally:
        other.shutdown()


def test_an_engine_is_lost_when_it_exited_or_gives_no_answer_not_when_it_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(server, "LOST_GRACE_S", 0.5)

    class Healthy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    up = http.server.HTTPServer(("127.0.0.1", 0), Healthy)
    threading.Thread(target=up.serve_forever, daemon=True).start()
    try:
        healthy = Engine(f"http://127.0.0.1:{up.server_address[1]}")
        assert (
            healthy.lost(UserError("grpo.vllm: the engine at ... refused /v1/load_lora_adapter: bad")) == ""
        )
    finally:
        up.shutdown()
    closed = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    gone = client.Unreachable(f"grpo.vllm: the engine at {closed} is not reachable (refused)")
    assert (
        Engine(closed).lost(gone) == f"stopped answering (the engine at {closed} is not reachable (refused))"
    )
    log = tmp_path / "vllm.log"
    log.write_text("(EngineCore pid=7) ERROR RuntimeError: CPU Generator does not use offset\n")
    process = subprocess.Popen(["false"])
    process.wait()
    exited = Engine(closed, process, log, "m").lost(gone)
    assert exited == f"exited (code 1): RuntimeError: CPU Generator does not use offset; its log: {log}"


def test_an_exited_engine_says_what_its_log_refused(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text(
        "WARNING ... OSError: [Errno 24] Too many open files\n"
        "(Worker pid=1) ERROR RuntimeError: Unsupported CPU attention configuration: head_dim=40 isa=1\n"
    )
    process = subprocess.Popen(["false"])
    process.wait()
    engine = Engine("http://127.0.0.1:1", process, log, "models/tiny")
    with pytest.raises(UserError, match=r"cannot serve models/tiny: .* head size \(head_dim=40\); its log: "):
        engine.check_alive()
    log.write_text("ValueError: something else\n")
    with pytest.raises(UserError, match=r"exited \(code 1\): .*ValueError: something else; its log: "):
        engine.check_alive()


def test_the_engine_runs_no_checkpoint_code_unless_asked_and_fits_the_lora_rank():
    python = Path("/venv/bin/python")
    command = serve_command(python, ServeSpec("m", "float32", 64, lora_rank=12), "127.0.0.1", 8000)
    assert "--trust-remote-code" not in command
    assert command[command.index("--max-lora-rank") + 1] == "16"  # vLLM takes 8, 16, 32, ...
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert "--enable-lora" not in serve_command(python, ServeSpec("m", "float32", 64), "127.0.0.1", 8000)
    asked = serve_command(python, ServeSpec("m", "float32", 64, trust_remote_code=True), "127.0.0.1", 8000)
    assert "--trust-remote-code" in asked
    with pytest.raises(UserError, match="lora.r: 1024 is above the engine's largest LoRA rank"):
        serve_command(python, ServeSpec("m", "float32", 64, lora_rank=1024), "127.0.0.1", 8000)


def test_a_cpu_engine_prefills_each_prompt_whole_and_a_gpu_engine_keeps_vllms_default(monkeypatch):
    """vLLM 0.32 rewinds a seeded request's generator when it discards the token sampled after part of a
    prompt, which a CPU generator cannot do (server.py, WHOLE_PREFILLS): a CPU engine never splits one."""
    spec, python = ServeSpec("m", "float32", 64), Path("/venv/bin/python")
    monkeypatch.setattr(server, "has_gpu", lambda: False)
    assert "--no-enable-chunked-prefill" in serve_command(python, spec, "127.0.0.1", 8000)
    monkeypatch.setattr(server, "has_gpu", lambda: True)
    assert "--no-enable-chunked-prefill" not in serve_command(python, spec, "127.0.0.1", 8000)


def test_a_start_adapter_is_refused_with_an_engine_the_user_started(tmp_path):
    url = "grpo.vllm.url=http://127.0.0.1:1"
    with pytest.raises(UserError, match="grpo.vllm.url: model.adapter is folded into the trained base"):
        load_grpo_config(None, ["grpo.generation=vllm", url, f"model.adapter={tmp_path}"])
    ours = load_grpo_config(None, ["grpo.generation=vllm", f"model.adapter={tmp_path}"])
    assert ours.model.adapter == str(tmp_path)


def test_the_engine_serves_the_base_the_trainer_folds_its_start_adapter_into(tmp_path):
    """With model.adapter the engine's base is written once: the trainer's own base weights, exactly."""
    from peft import LoraConfig as PeftLora
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from toolkit.config import LoraConfig, ModelConfig
    from toolkit.model.load import load_model

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(Q64, dtype=torch.float32)
    start = get_peft_model(base, PeftLora(r=8, target_modules="all-linear", init_lora_weights=False))
    start.save_pretrained(str(tmp_path / "start"))
    cfg = load_grpo_config(None, [f"model.path={Q64}", f"model.adapter={tmp_path / 'start'}"])
    no_start = load_grpo_config(None, [f"model.path={Q64}", "model.adapter=null"])
    assert served_base(no_start, tmp_path) == str(Q64)
    served = served_base(cfg, tmp_path / "engine")
    assert served == str((tmp_path / "engine" / "base").resolve())
    folded = AutoModelForCausalLM.from_pretrained(served).state_dict()
    model_cfg = ModelConfig(path=str(Q64), method="full", adapter=str(tmp_path / "start"))
    trained = load_model(model_cfg, LoraConfig()).state_dict()
    assert folded.keys() == trained.keys()
    assert all(torch.equal(folded[k], trained[k]) for k in trained)
    assert not torch.equal(
        folded["model.layers.0.self_attn.q_proj.weight"],
        base.state_dict()["model.layers.0.self_attn.q_proj.base_layer.weight"],
    )  # the start adapter is in it
    assert (Path(served) / "tokenizer.json").is_file()
    not_adapter = load_grpo_config(None, [f"model.path={Q64}", f"model.adapter={tmp_path}"])
    with pytest.raises(UserError, match="model.adapter: .* is not an adapter directory"):
        served_base(not_adapter, tmp_path / "engine")


def test_the_logprob_gap_counts_sampled_tokens_only():
    engine = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, 0.0, 0.0]], dtype=torch.float64)
    trainer = torch.tensor([[-1.1, -2.0, 0.0, 0.0], [-0.25, -7.0, 0.0, 0.0]])
    mean, largest = logprob_gap(engine, trainer, torch.tensor([2, 1]))
    assert mean == pytest.approx((0.1 + 0.0 + 0.25) / 3, rel=1e-6) and largest == pytest.approx(0.25)


def test_whole_weights_need_an_engine_that_takes_them():
    """An engine without vLLM's development mode answers /collective_rpc with 404: one line saying what to
    turn on."""

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.send_response(404)
            self.end_headers()
            self.wfile.write(b'{"detail":"Not Found"}')

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(
            UserError, match=f"the engine at {url} takes no weights: .* VLLM_SERVER_DEV_MODE=1"
        ):
            client.reload_weights(url, "/tmp/weights")
    finally:
        server.shutdown()


def test_an_engine_that_dies_mid_run_says_so_with_its_logs_reason(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("(EngineCore pid=7) ERROR RuntimeError: CPU out of memory\n")
    process = subprocess.Popen(["false"])
    process.wait()
    cfg = load_grpo_config(None, ["model.adapter=null", "grpo.generation=vllm"])
    sampler = EngineSampler(None, cfg, Engine("http://127.0.0.1:1", process, log, "m"))
    sampler.ready = True
    said = sampler._mid_run(UserError("grpo.vllm: the engine at http://127.0.0.1:1 is not reachable"))
    assert (
        said
        == f"grpo.vllm: the engine exited mid-run (code 1): RuntimeError: CPU out of memory; its log: {log}"
    )


def test_a_head_size_the_cpu_engine_refuses_is_named_before_it_starts(tmp_path):
    assets = REPO / "toolkit" / "assets"
    with pytest.raises(UserError, match=r"cannot serve .*tiny-llama: .*head_dim=40; it takes 32, 64, 80"):
        check_cpu_head_size(str(assets / "tiny-llama"))  # head_dim 40 in its config
    check_cpu_head_size(str(assets / "tiny-llama-q64"))  # 32: served (tests/e2e/test_grpo_engine.py)
    check_cpu_head_size("org/model")  # a hub id: the engine's own check at its start
    vision = tmp_path / "vlm"
    vision.mkdir()
    (vision / "config.json").write_text('{"text_config": {"hidden_size": 96, "num_attention_heads": 2}}')
    with pytest.raises(UserError, match="head_dim=48"):
        check_cpu_head_size(str(vision))
    (vision / "config.json").write_text('{"head_dim": 64, "hidden_size": 96, "num_attention_heads": 2}')
    check_cpu_head_size(str(vision))  # an explicit head_dim wins over width / heads


def test_a_cpu_engine_takes_its_cpus_own_kernels_where_aten_is_asked_for_scalar_ones(monkeypatch):
    """vLLM's CPU sampler compiles a reduction at the first round, which torch's inductor cannot build under
    ATEN_CPU_CAPABILITY=default: the engine gets the variable only when it names a vector set."""
    from toolkit.engine import server

    monkeypatch.setattr(server, "has_gpu", lambda: False)
    spec = server.ServeSpec("m", "float32", 64)
    assert "ATEN_CPU_CAPABILITY" not in server.serve_environment(spec, {"ATEN_CPU_CAPABILITY": "default"})
    assert server.serve_environment(spec, {"ATEN_CPU_CAPABILITY": "avx2"})["ATEN_CPU_CAPABILITY"] == "avx2"
