"""grpo.vllm.replicas and grpo.vllm.n_per_prompt without an engine: their config refusals, the GPUs and
cores each copy gets, a round split between copies and put back in order, a group asked for in one request,
and a copy that dies started again alone (the others keep serving)."""

import threading
from types import SimpleNamespace

import pytest
import torch

from toolkit.engine import client, server
from toolkit.engine.replicas import ReplicaError, Replicas
from toolkit.errors import UserError
from toolkit.grpo import engine_start, rollout, sampling
from toolkit.grpo.config import load_grpo_config, n_per_prompt, replica_gpus
from toolkit.grpo.engine import EngineSampler
from toolkit.grpo.engine_start import check_engine_machine

ENGINE = ["model.adapter=null", "grpo.generation=vllm", "grpo.max_new_tokens=4", "train.max_steps=3"]


def refused(overrides, match):
    with pytest.raises(UserError, match=match):
        load_grpo_config(None, overrides)


def test_what_replicas_and_n_per_prompt_refuse(tmp_path):
    refused(["grpo.vllm.n_per_prompt=true"], r"^grpo.vllm.n_per_prompt: HF generate cannot keep a seed per")
    tool = tmp_path / "tools.py"
    tool.write_text(
        'def add(a: int, b: int) -> int:\n    """Adds.\n\n    Args:\n        a: one.\n        b: two.\n'
        '    """\n    return a + b\n'
    )
    talk = [*ENGINE, f"grpo.environment.tools=[{tool}:add]"]
    refused([*talk, "grpo.vllm.n_per_prompt=true"], r"^grpo.vllm.n_per_prompt: a conversation's turns after")
    assert not n_per_prompt(load_grpo_config(None, talk))  # unset: one by one for conversations
    assert n_per_prompt(load_grpo_config(None, ENGINE))  # and a group at once for single-turn rounds
    refused(
        [*ENGINE, "grpo.vllm.replicas=2", "grpo.vllm.url=http://h:1"], r"^grpo.vllm.replicas: ftkit starts"
    )
    refused(
        [*ENGINE, "grpo.vllm.replicas=2", "grpo.vllm.sleep=true"], r"^grpo.vllm.sleep: copies of the engine"
    )
    refused([*ENGINE, "grpo.vllm.replicas=0"], "grpo.vllm.replicas")
    refused(
        [*ENGINE, "grpo.vllm.replicas=2", "grpo.vllm.gpus=2,3,4", "grpo.vllm.tensor_parallel_size=2"],
        r"^grpo.vllm.replicas: 2 engines of 2 GPU each need 4 GPUs; grpo.vllm.gpus names 3 \(2,3,4\)$",
    )
    refused([*ENGINE, "grpo.vllm.replicas=3", "grpo.vllm.gpus=[1,2]"], "need 3 GPUs; grpo.vllm.gpus names 2")


def test_each_copy_gets_its_own_gpus_and_a_gpu_machine_needs_them_named():
    four = load_grpo_config(None, [*ENGINE, "grpo.vllm.replicas=2", "grpo.vllm.gpus=4,5,6,7"])
    assert replica_gpus(four) == [["4", "5"], ["6", "7"]]
    narrow = load_grpo_config(
        None, [*ENGINE, "grpo.vllm.replicas=2", "grpo.vllm.gpus=4,5,6", "grpo.vllm.tensor_parallel_size=1"]
    )
    assert replica_gpus(narrow) == [["4"], ["5"]]
    here = load_grpo_config(None, [*ENGINE, "grpo.vllm.replicas=2"])
    assert replica_gpus(here) == [[], []]
    check_engine_machine(here, False, {})  # CPU engines: N of them on this machine's cores
    with pytest.raises(
        UserError, match=r"^grpo.vllm.replicas: 2 engines need GPUs of their own, apart from "
    ):
        check_engine_machine(here, True, {"LOCAL_WORLD_SIZE": "2"})
    check_engine_machine(four, True, {"LOCAL_WORLD_SIZE": "4"})  # training on 0-3, the engines on 4-7
    with pytest.raises(UserError, match="GPU 4,5 also trains"):
        check_engine_machine(four, True, {"LOCAL_WORLD_SIZE": "6"})


def test_cpu_copies_split_this_process_cores(monkeypatch):
    monkeypatch.setattr(engine_start.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    assert engine_start.core_shares(1) == [""]
    assert engine_start.core_shares(2) == ["0,1", "2,3,4"]
    monkeypatch.setattr(engine_start.os, "sched_getaffinity", lambda pid: {3})
    assert engine_start.core_shares(2) == ["", ""]  # fewer cores than copies: vLLM's own choice


def test_a_cpu_engine_on_two_cores_or_fewer_serves_in_its_own_process_held_to_its_share(monkeypatch):
    """vLLM's worker process would get one thread there anyway; on more cores it keeps its worker, bound."""
    monkeypatch.setattr(server, "has_gpu", lambda: False)
    monkeypatch.setattr(server, "_end_with_parent", lambda: None)
    monkeypatch.setattr(server.os, "sched_getaffinity", lambda pid: {0, 1})
    python = server.ENGINE_VENV / "bin" / "python"

    def started(spec):
        command, env = server.serve_command(python, spec, "h", 1), server.serve_environment(spec, {})
        pinned = []
        monkeypatch.setattr(server.os, "sched_setaffinity", lambda pid, cores: pinned.append(cores))
        server._starting(spec)()
        uni = command[command.index("--distributed-executor-backend") + 1] if "uni" in command else None
        return uni, env.get("VLLM_ENABLE_V1_MULTIPROCESSING"), env.get("VLLM_CPU_OMP_THREADS_BIND"), pinned

    assert started(server.ServeSpec("m", "float32", 64)) == ("uni", "0", None, [])  # the machine's two
    assert started(server.ServeSpec("m", "float32", 64, cpus="1")) == ("uni", "0", None, [[1]])
    assert started(server.ServeSpec("m", "float32", 64, cpus="0,1,2")) == (None, None, "0,1,2", [])
    assert started(server.ServeSpec("m", "float32", 64, cpus="2-3")) == ("uni", "0", None, [[2, 3]])
    assert started(server.ServeSpec("m", "float32", 64, cpus="0-1,4")) == (None, None, "0-1,4", [])
    monkeypatch.setattr(server.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert started(server.ServeSpec("m", "float32", 64)) == (None, None, None, [])


class Prompts(list):
    """The prompt set as round_request reads it: its length and token ids."""

    @property
    def ids(self):
        return list(self)


def test_a_groups_engine_seeds_are_consecutive_so_n_at_once_is_the_same_request():
    cfg = load_grpo_config(
        None, [*ENGINE, "grpo.num_generations=4", "train.global_batch_size=8", "train.micro_batch_size=4"]
    )
    prompts = Prompts([[5, 6], [7], [8, 9, 10]])
    ids, seeds = rollout.engine_request(prompts, cfg, 3)
    assert len(ids) == len(seeds) == 8
    for group in range(2):
        first = seeds[4 * group]
        assert seeds[4 * group : 4 * group + 4] == [first + g for g in range(4)]
        assert ids[4 * group : 4 * group + 4] == [ids[4 * group]] * 4
        assert first >= 0 and first + 3 < 2**63
    assert seeds[0] != seeds[4] and rollout.engine_request(prompts, cfg, 4)[1][0] != seeds[0]
    assert sampling.group_seed(1, 2, 3, 4) == sampling.completion_seed(1, 2, 3, 4, 0) >> 8


class Copy:
    """One fake engine copy: its completions (seed, copy) so the test sees who answered."""

    process = None
    relaunch = ("started by ftkit",)

    def __init__(self, index, log):
        self.index, self.url, self.log, self.dead = index, f"http://copy-{index}", log, False

    def check_alive(self):
        pass

    def lost(self, error):
        return "exited (code -9): no reason found in its log; its log: " + self.log

    def restarted(self):
        self.log_event(("restarted", self.index))
        return Copy(self.index, self.log)

    def wait_ready(self, timeout_s, say=None):
        if self.index == getattr(self, "never_ready", None):
            raise UserError(f"grpo.vllm: the engine at {self.url} did not answer within 600 s")
        return 1.0

    def failure(self, error):
        return f"{error}; its log: {self.log}"

    def stop(self):
        pass


def fake_complete(events, lock):
    def complete(url, name, prompts, seeds, sampling, stop_ids, max_tokens=None, stop=None, n=1):
        with lock:
            events.append(("sent", url, len(prompts), n))
            if any(e == ("kill", url) for e in events):
                events.remove(("kill", url))
                raise client.Unreachable(f"grpo.vllm: the engine at {url} is not reachable (reset)")
        copy = int(url.rsplit("-", 1)[1])
        return [client.Completion([(s + i) % 50 + 3, copy], [-0.5, -0.25]) for s in seeds for i in range(n)]

    return complete


@pytest.mark.parametrize("copies", [1, 2, 3])
def test_a_round_split_between_copies_comes_back_in_order_and_a_dead_copy_alone_is_started_again(
    copies, monkeypatch, tmp_path, capsys
):
    events, lock = [], threading.Lock()
    monkeypatch.setattr(client, "complete", fake_complete(events, lock))
    engines = [Copy(i, f"vllm-{i}.log") for i in range(copies)]
    for engine in engines:
        engine.log_event = events.append
    cfg = load_grpo_config(
        None,
        [
            *ENGINE,
            "grpo.num_generations=4",
            "train.global_batch_size=8",
            "train.micro_batch_size=4",
            f"grpo.vllm.replicas={copies}",
        ],
    )
    accelerator = SimpleNamespace(num_processes=1, is_main_process=True)
    sampler = EngineSampler(accelerator, cfg, Replicas(engines), tmp_path)
    sampler.ready = True
    prompts = [[1, 2]] * 4 + [[3]] * 4 + [[4, 5, 6]] * 4
    seeds = [100 + g for g in range(4)] + [200 + g for g in range(4)] + [300 + g for g in range(4)]
    got = sampler._requested(0, prompts, seeds, [2], "base", 0)
    assert got.tokens[:, 0].tolist() == [(s % 50) + 3 for s in seeds]  # seed order, whoever answered
    answered = got.tokens[:, 1].tolist()
    assert answered == sorted(answered) and len(set(answered)) == copies  # contiguous shares, all used
    shares = {url: size for _, url, size, _ in events}
    assert shares == {f"http://copy-{i}": 3 * (i + 1) // copies - 3 * i // copies for i in range(copies)}
    assert all(n == 4 for *_, n in events)  # a request per prompt for its group of 4
    # The last copy dies mid-round: it alone is started again and the round is asked again.
    events.clear()
    events.append(("kill", f"http://copy-{copies - 1}"))
    again = sampler._on_main(lambda: sampler._requested(1, prompts, seeds, [2], "base", 0))[0]
    assert torch.equal(again.tokens, got.tokens)
    assert [e for e in events if e[0] == "restarted"] == [("restarted", copies - 1)]
    label = f" (replica {copies} of {copies})" if copies > 1 else ""
    said = capsys.readouterr().out
    lost = f"grpo.vllm: the engine{label} exited (code -9): no reason found in its log; its log: "
    assert f"{lost}vllm-{copies - 1}.log; ftkit restarted it (1 of" in said


def test_a_failure_names_the_copy_that_failed():
    def fails_on_second(index, engine):
        if index == 1:
            raise UserError("refused")
        return index

    group = Replicas([Copy(0, "a"), Copy(1, "b"), Copy(2, "c")])
    with pytest.raises(ReplicaError) as caught:
        group.each_indexed(fails_on_second)
    assert caught.value.replica == 1 and str(caught.value) == "refused"
    assert group.label(1) == " (replica 2 of 3)" and Replicas([Copy(0, "a")]).label(0) == ""


def test_a_copy_that_never_starts_is_the_one_named(tmp_path):
    engines = [Copy(i, f"vllm-{i}.log") for i in range(3)]
    for engine in engines:
        engine.never_ready = 2
    cfg = load_grpo_config(None, [*ENGINE, "grpo.vllm.replicas=3"])
    sampler = EngineSampler(SimpleNamespace(num_processes=1), cfg, Replicas(engines), tmp_path)
    _, problem = sampler._on_main(sampler._wait_ready)
    assert (
        str(problem)
        == "grpo.vllm: the engine at http://copy-2 did not answer within 600 s; its log: vllm-2.log"
    )
