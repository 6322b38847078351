"""grpo.vllm.sleep and grpo.vllm.gpus without a GPU: the engine ftkit starts is a fake HTTP server that
notes every call, so each round's order (wake, sync, generate, sleep) is read from what it was asked; the
server's command line and environment; and the settings refused in one line. vLLM's sleep mode itself needs
a GPU and is not run here."""

import http.server
import json
import threading
from types import SimpleNamespace

import pytest

from toolkit.engine import server
from toolkit.engine.server import Engine, ServeSpec, serve_command, serve_environment
from toolkit.errors import UserError
from toolkit.grpo import engine as engine_module
from toolkit.grpo import engine_start, multiturn
from toolkit.grpo.config import load_grpo_config, sleep_level
from toolkit.grpo.engine import EngineSampler
from toolkit.grpo.engine_start import check_engine_machine, training_gpus

ENGINE = ["model.adapter=null", "grpo.generation=vllm", "grpo.max_new_tokens=4", "train.max_steps=3"]
ENGINE += ["grpo.vllm.n_per_prompt=false"]  # a request per completion: the two calls below
# A LoRA round after the first, asleep since the last: wake, swap the adapter, generate, sleep.
LORA_ROUND = [
    "/wake_up",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/v1/completions",
    "/v1/completions",
    "/sleep?level=1",
]


class Noted(http.server.BaseHTTPRequestHandler):
    """vLLM's endpoints as ftkit calls them: every POST noted (path and query), completions answered."""

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.calls.append(self.path)
        answer = {}
        if self.path == "/v1/completions":
            seed = json.loads(body)["seed"]
            answer = {
                "choices": [{"token_ids": [seed % 7 + 3, 2], "logprobs": {"token_logprobs": [-1.0, -0.5]}}]
            }
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_engine():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Noted)
    httpd.calls = []
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield Engine(f"http://127.0.0.1:{httpd.server_address[1]}"), httpd.calls
    httpd.shutdown()


class Policy:
    def save_pretrained(self, folder, state_dict):
        """The fake engine reads no adapter files."""


def sampler_for(fake_engine, monkeypatch, tmp_path, overrides, level):
    engine, calls = fake_engine
    monkeypatch.setattr(engine_module, "adapter_state", lambda accelerator, model: ({}, 0))
    monkeypatch.setattr(engine_module, "saver", lambda accelerator, model: Policy())
    monkeypatch.setattr(engine_module, "write_weights", lambda accelerator, model, folder: 0)
    accelerator = SimpleNamespace(num_processes=1, is_main_process=True)
    cfg = load_grpo_config(None, [*ENGINE, *overrides])
    sampler = EngineSampler(accelerator, cfg, engine, tmp_path, level)
    sampler.ready = True
    return sampler, calls


def requests(round_index):
    return [[1, 2, 3]] * 2, [100 * round_index + i for i in range(2)]


def rounds(sampler, calls, count):
    """What the engine was asked in each of `count` rounds, the adapter's generated names dropped."""
    asked = []
    for round_index in range(count):
        calls.clear()
        sampler.sample(None, round_index, requests, [2])
        asked.append([call.split("?")[0] if "lora" in call else call for call in calls])
    return asked


def test_a_lora_round_wakes_the_engine_syncs_generates_then_sleeps_at_level_1(
    fake_engine, monkeypatch, tmp_path
):
    sampler, calls = sampler_for(fake_engine, monkeypatch, tmp_path, [], level=1)
    first, second, third = rounds(sampler, calls, 3)
    # The engine starts awake: the first round has nothing to wake.
    assert first == ["/v1/load_lora_adapter", "/v1/completions", "/v1/completions", "/sleep?level=1"]
    assert second == LORA_ROUND and third == LORA_ROUND
    wake_s, sleep_s = sampler.rest_seconds()
    assert wake_s > 0 and sleep_s > 0


def test_a_full_fine_tune_sleeps_at_level_2_and_wakes_its_weights_before_its_kv_cache(
    fake_engine, monkeypatch, tmp_path
):
    sampler, calls = sampler_for(fake_engine, monkeypatch, tmp_path, ["model.method=full"], level=2)
    first, second = rounds(sampler, calls, 2)
    assert first == [
        "/collective_rpc",
        "/reset_prefix_cache",
        "/v1/completions",
        "/v1/completions",
        "/sleep?level=2",
    ]
    assert second == [
        "/wake_up?tags=weights",  # the KV cache stays asleep while the new weights load
        "/collective_rpc",
        "/reset_prefix_cache",
        "/wake_up?tags=kv_cache",
        "/v1/completions",
        "/v1/completions",
        "/sleep?level=2",
    ]


def test_nothing_sleeps_or_wakes_when_sleep_is_off(fake_engine, monkeypatch, tmp_path):
    sampler, calls = sampler_for(fake_engine, monkeypatch, tmp_path, [], level=0)
    for asked in rounds(sampler, calls, 3):
        assert not [call for call in asked if "sleep" in call or "wake" in call]
        assert asked.count("/v1/completions") == 2
    assert sampler.rest_seconds() is None


def test_multi_turn_rounds_sleep_after_their_last_turn(fake_engine, monkeypatch, tmp_path):
    sampler, calls = sampler_for(fake_engine, monkeypatch, tmp_path, [], level=1)
    turns = lambda sampler, prompts, seeds, *rest: sampler.complete(prompts, seeds, [4, 4], [2], [])  # noqa: E731
    monkeypatch.setattr(multiturn, "_engine_turns", turns)
    for _ in range(2):
        calls.clear()
        requests = lambda round_index: ([[1], [2]], [0, 1])  # noqa: E731
        sampled, _ = multiturn.engine_conversations(sampler, None, requests, sampler.cfg, None, None, 0)
        assert len(sampled.talks) == 2
    assert [call.split("?")[0] if "lora" in call else call for call in calls] == LORA_ROUND


def test_the_server_gets_sleep_mode_its_development_endpoints_and_its_own_gpus():
    python = server.ENGINE_VENV / "bin" / "python"
    spec = ServeSpec("m", "bfloat16", 64, sleep=True, gpus="2,3", tensor_parallel_size=2)
    command = serve_command(python, spec, "127.0.0.1", 8000)
    assert "--enable-sleep-mode" in command
    assert command[command.index("--tensor-parallel-size") + 1] == "2"
    env = serve_environment(spec, {"CUDA_VISIBLE_DEVICES": "0,1", "PATH": "/bin"})
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["PATH"] == "/bin"
    plain = ServeSpec("m", "bfloat16", 64)
    assert "--enable-sleep-mode" not in serve_command(python, plain, "127.0.0.1", 8000)
    assert "--tensor-parallel-size" not in serve_command(python, plain, "127.0.0.1", 8000)
    env = serve_environment(plain, {"CUDA_VISIBLE_DEVICES": "0"})
    assert "VLLM_SERVER_DEV_MODE" not in env and env["CUDA_VISIBLE_DEVICES"] == "0"


def test_the_engine_ftkit_starts_carries_the_resolved_settings(monkeypatch, tmp_path):
    started = {}
    monkeypatch.setattr(
        Engine, "start", classmethod(lambda cls, spec, *args: started.setdefault("spec", spec))
    )
    monkeypatch.setattr(engine_start, "has_gpu", lambda: True)
    cfg = load_grpo_config(None, [*ENGINE, "grpo.vllm.gpus=[4, 5]"])
    engine_start.start_or_connect(cfg, tmp_path)
    spec = started.pop("spec")
    assert (spec.sleep, spec.gpus, spec.tensor_parallel_size) == (False, "4,5", 2)
    engine_start.start_or_connect(load_grpo_config(None, ENGINE), tmp_path)
    spec = started.pop("spec")
    assert (spec.sleep, spec.gpus, spec.tensor_parallel_size) == (True, "", 0)


def test_sleep_is_on_by_default_only_on_a_gpu_the_engine_shares_with_training():
    def level(overrides, gpu=True):
        return sleep_level(load_grpo_config(None, [*ENGINE, *overrides]), gpu)

    assert level([]) == 1
    assert level(["model.method=full"]) == 2
    assert level([], gpu=False) == 0  # vLLM's CPU engine has no sleep mode
    assert level(["grpo.vllm.gpus=2,3"]) == 0  # GPUs of its own
    assert level(["grpo.vllm.url=http://127.0.0.1:1"]) == 0
    assert level(["grpo.async_rounds=1"]) == 0
    assert level(["grpo.vllm.host=0.0.0.0"]) == 0
    assert level(["grpo.vllm.sleep=false"]) == 0
    assert level(["grpo.vllm.gpus=2,3", "grpo.vllm.sleep=true"]) == 1
    assert sleep_level(load_grpo_config(None, []), True) == 0  # HF generate: no engine to sleep
    with pytest.raises(UserError, match="grpo.vllm.sleep: only applies with grpo.generation: vllm"):
        load_grpo_config(None, ["grpo.vllm.sleep=true"])


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (["grpo.vllm.sleep=true", "grpo.vllm.url=http://127.0.0.1:1"], "grpo.vllm.sleep: ftkit puts only"),
        (["grpo.vllm.sleep=true", "grpo.async_rounds=1"], "grpo.vllm.sleep: with grpo.async_rounds"),
        (["grpo.vllm.sleep=true", "grpo.vllm.host=0.0.0.0"], "grpo.vllm.host: 0.0.0.0 would expose"),
        (["grpo.vllm.gpus=2", "grpo.vllm.url=http://127.0.0.1:1"], "grpo.vllm.gpus: places the engine"),
        (["grpo.vllm.gpus=2,2"], "grpo.vllm.gpus: 2,2 names a GPU twice"),
        (["grpo.vllm.gpus=a,b"], r"grpo.vllm.gpus: 'a,b' is not GPU indices"),
        (["grpo.vllm.gpus=[2]", "grpo.vllm.tensor_parallel_size=2"], "tensor_parallel_size: 2 is more than"),
    ],
)
def test_settings_the_engine_cannot_honour_are_one_line(overrides, said):
    with pytest.raises(UserError, match=said):
        load_grpo_config(None, [*ENGINE, *overrides])


def test_the_machine_refuses_sleep_without_a_gpu_and_engine_gpus_that_train():
    sleeps = load_grpo_config(None, [*ENGINE, "grpo.vllm.sleep=true"])
    with pytest.raises(UserError, match="grpo.vllm.sleep: no GPU here, and vLLM's CPU backend has no sleep"):
        check_engine_machine(sleeps, False, {})
    check_engine_machine(sleeps, True, {})
    own = load_grpo_config(None, [*ENGINE, "grpo.vllm.gpus=1,2"])
    with pytest.raises(UserError, match="grpo.vllm.gpus: 1,2 named, but no GPU here"):
        check_engine_machine(own, False, {})
    with pytest.raises(
        UserError, match=r"grpo.vllm.gpus: GPU 1 also trains \(this launch's processes use 0,1\)"
    ):
        check_engine_machine(own, True, {"LOCAL_WORLD_SIZE": "2"})
    with pytest.raises(UserError, match="GPU 2 also trains"):
        check_engine_machine(own, True, {"LOCAL_WORLD_SIZE": "1", "CUDA_VISIBLE_DEVICES": "2,3"})
    check_engine_machine(own, True, {"LOCAL_WORLD_SIZE": "1"})  # training on GPU 0
    check_engine_machine(own, True, {"LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "4,5,1"})
    assert training_gpus({"LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "4, 5,1"}) == ["4", "5"]
    check_engine_machine(load_grpo_config(None, ENGINE), False, {})  # the defaults pass on a CPU
