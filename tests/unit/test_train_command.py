"""`ftkit train` builds the right `accelerate launch` line for the machine it is on (faked here), checks
before it starts, and hands on the worker's exit: all in-process, nothing launched."""

import argparse
import dataclasses
import io

import pytest

from toolkit.commands import cli, relay, train
from toolkit.commands.doctor.records import Finding
from toolkit.config import load_config
from toolkit.errors import UserError
from toolkit.launch.machine import Machine
from toolkit.recipes import load_recipe_config

CPU_BOX = Machine(gpu_count=0, ram_gib=24.0)
TWO_4090 = Machine(gpu_count=2, gpu_mem_gib=24.0, ram_gib=64.0)
ONE_H100 = Machine(gpu_count=1, gpu_mem_gib=80.0, ram_gib=128.0)


def args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    cut = argv.index("--") if "--" in argv else len(argv)
    parsed = parser.parse_intermixed_args(argv[:cut])
    parsed.accelerate_args = list(argv[cut + 1 :])
    return parsed


def build(*argv: str, hardware=CPU_BOX, env=None) -> train.LaunchPlan:
    parsed = args(*argv)
    name, overrides = train.split_items(parsed.items, parsed.config)
    cfg = load_config(parsed.config, overrides)
    nodes = train.resolve_nodes(parsed, env or {}, hostnames=lambda nodelist: ["node-a", "node-b"])
    return train.plan_launch(parsed, overrides, cfg, hardware, nodes, train.recipe_path(name))


def option(plan: train.LaunchPlan, flag: str) -> str:
    return plan.argv[plan.argv.index(flag) + 1]


@pytest.mark.parametrize("backend", train.backend_names())
def test_every_backend_name_builds_its_launch_on_gloo_processes(backend):
    plan = build("--backend", backend, "train.max_steps=3")
    assert plan.argv[:2] == ["accelerate", "launch"]
    assert option(plan, "--config_file").endswith(f"accelerate_configs/{backend}.yaml")
    assert option(plan, "--num_processes") == ("1" if backend == "single" else "2")
    recipe = plan.argv.index(train.shown(train.REPO / "recipes/finetune_llm.py"))
    pipeline = ["pipeline.size=2"] if backend in ("pp", "pp_ddp") else []
    pipeline += ["moe.expert_parallel=2"] if backend == "ep" else []
    assert plan.argv[recipe + 1 :] == ["train.max_steps=3", *pipeline] == plan.overrides
    assert plan.reason == ""


def test_pipeline_backends_give_the_recipe_its_pipeline_size_unless_it_has_one():
    assert build("--backend", "pp", "--gpus", "4").overrides == ["pipeline.size=4"]
    assert build("--backend", "pp_ddp", "--gpus", "4").overrides == ["pipeline.size=2"]
    assert build("--backend", "pp", "pipeline.size=2", "--gpus", "4").overrides == ["pipeline.size=2"]
    assert build("--backend", "ep", "--gpus", "4").overrides == ["moe.expert_parallel=4"]
    assert build("--backend", "ep", "moe.expert_parallel=2").overrides == ["moe.expert_parallel=2"]


def test_gpus_config_and_accelerate_args_land_where_accelerate_expects_them():
    plan = build(
        "--backend", "zero2", "--gpus", "4", "--config", "recipes/configs/demo.yaml", "seed=3",
        "--", "--main_process_port", "1234",
    )  # fmt: skip
    recipe = plan.argv.index(train.shown(train.REPO / "recipes/finetune_llm.py"))
    assert option(plan, "--num_processes") == "4" and plan.per_node == 4
    assert plan.argv[recipe - 2 : recipe] == ["--main_process_port", "1234"]
    assert plan.argv[recipe + 1 :] == ["--config", "recipes/configs/demo.yaml", "seed=3"]
    assert plan.display().startswith("accelerate launch --config_file ")


def test_auto_on_a_machine_without_gpus_plans_the_dry_run_in_a_share_of_ram():
    plan = build("train.max_steps=3")
    assert plan.backend == "ddp" and option(plan, "--num_processes") == "2"
    assert plan.reason.startswith("auto: ddp: ") and "of 12 GiB per process (no GPU" in plan.reason
    assert "model.gradient_checkpointing=false" in plan.argv


def test_auto_on_two_24gb_gpus_picks_ddp_with_checkpointing_for_an_8b_lora():
    plan = build("--config", "recipes/configs/llama3-8b-lora.yaml", hardware=TWO_4090)
    assert plan.backend == "ddp" and option(plan, "--num_processes") == "2"
    used = float(plan.reason.split(": ")[2].split(" of ")[0])
    assert 15 < used <= 24 and "of 24 GiB per GPU, gradient checkpointing on" in plan.reason
    # Micro-batch 2 fits beside the chunked loss head (1 with the full logits).
    assert "model.gradient_checkpointing=true" in plan.argv and "train.micro_batch_size=2" in plan.argv


def test_auto_on_one_80gb_gpu_runs_a_full_fine_tune_as_one_process():
    plan = build("--config", "recipes/configs/qwen2.5-1.5b-full.yaml", hardware=ONE_H100)
    assert plan.backend == "single" and option(plan, "--num_processes") == "1"
    assert "of 80 GiB per GPU" in plan.reason


def test_auto_keeps_what_the_user_fixed_on_the_command_line():
    plan = build("--config", "recipes/configs/llama3-8b-lora.yaml", "train.micro_batch_size=1",
                 "model.gradient_checkpointing=true", hardware=TWO_4090)  # fmt: skip
    assert plan.argv.count("train.micro_batch_size=1") == 1
    assert plan.argv.count("model.gradient_checkpointing=true") == 1


def test_auto_says_what_would_fit_when_nothing_does():
    small = Machine(gpu_count=1, gpu_mem_gib=4.0, ram_gib=16.0)
    with pytest.raises(UserError, match=r"^auto: nothing fits 1 x 4 GiB per GPU and 16 GiB RAM; .* needs \d"):
        build("--config", "recipes/configs/qwen2.5-1.5b-full.yaml", hardware=small)


def test_unknown_backend_and_recipe_are_one_line_errors(tmp_path):
    with pytest.raises(UserError, match="--backend nope: not one of auto, ddp"):
        build("--backend", "nope")
    with pytest.raises(UserError, match="recipe ppo: not one of sft, dpo"):
        train.recipe_path("ppo")
    (tmp_path / "recipes").mkdir()
    with pytest.raises(UserError, match=r"recipe dpo: recipes/dpo_llm.py does not exist"):
        train.recipe_path("dpo", repo=tmp_path)
    (tmp_path / "recipes" / "dpo_llm.py").write_text("")
    assert train.recipe_path("dpo", repo=tmp_path) == tmp_path / "recipes" / "dpo_llm.py"


def test_slurm_environment_gives_machines_rank_and_main_address():
    env = {"SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "node-[a-b]"}
    plan = build("--backend", "zero3", "--master-port", "29123", hardware=TWO_4090, env=env)
    assert option(plan, "--num_processes") == "4" and plan.per_node == 2
    assert option(plan, "--num_machines") == "2" and option(plan, "--machine_rank") == "1"
    assert option(plan, "--main_process_ip") == "node-a" and option(plan, "--main_process_port") == "29123"
    assert option(plan, "--deepspeed_multinode_launcher") == "standard"
    flags = build("--nnodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.1", "--backend", "ddp")
    assert (
        option(flags, "--main_process_ip") == "10.0.0.1" and option(flags, "--main_process_port") == "29500"
    )
    with pytest.raises(UserError, match="--nnodes 2: pass --master-addr"):
        build("--nnodes", "2", "--backend", "ddp")


def test_preflight_stops_on_a_doctor_failure_or_a_config_conflict():
    plan = build("--backend", "ddp")
    cfg = load_config(None)
    failing = [Finding("disk", "fail", "0.1 GiB free at runs", "free some space")]
    with pytest.raises(UserError, match=r"^ftkit doctor: disk: 0.1 GiB free at runs \(free some space\)$"):
        train.preflight(plan, cfg, "demo", failing, Machine(), {})
    with pytest.raises(UserError, match="fp16 in demo needs a GPU"):
        train.preflight(plan, load_config(None, ["train.mixed_precision=fp16"]), "demo", [], Machine(), {})
    train.preflight(plan, cfg, "demo", [Finding("ram", "warn", "low")], Machine(), {})


def stderr_stream(verbose=False) -> relay.Stream:
    return relay.Stream(io.StringIO(), verbose, hold_on_failure=True)


def test_worker_exit_is_shown_once_and_becomes_the_exit_code():
    stream = stderr_stream()
    stream.feed(
        "E1123 12:00:00.000 1 torch/distributed/elastic/multiprocessing/api.py:1] failed\nTraceback\n"
    )
    same = {"code": 2, "message": "data.train: x.jsonl not found"}
    assert relay.settle(1, [same, same], stream, "finetune_llm") == 2
    assert stream.out.getvalue() == "finetune_llm: error: data.train: x.jsonl not found\n"
    assert relay.settle(1, [{"code": 75, "message": ""}] * 2, stderr_stream(), "r") == 75
    assert relay.settle(1, [{"code": 75}, {"code": 2, "message": "m"}], stderr_stream(), "r") == 2


def test_without_a_worker_report_the_launcher_text_and_code_stand():
    stream = stderr_stream()
    stream.feed("Traceback (most recent call last):\n  File x\nRuntimeError: boom\n")
    assert stream.out.getvalue() == ""
    assert relay.settle(1, [], stream, "finetune_llm") == 1
    assert stream.out.getvalue().endswith("RuntimeError: boom\n")


def test_known_noise_is_dropped_and_real_warnings_and_bars_pass():
    noise = (
        "[2026-11-23 14:31:59,584] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator "
        "to CPU. If you have GPU or other accelerator, we were unable to detect it.\n"
        "/x/c10d_logger.py:83: FutureWarning: `torch.distributed.all_gather_into_tensor` is deprecated.\n"
        "  return func(*args, **kwargs)\n"
    )
    real = "/x/y.py:3: UserWarning: something real\ntrain:  50%|#   | 1/2\rtrain: 100%|##| 2/2\n"
    for verbose, expected in ((False, real), (True, noise + real)):
        stream = relay.Stream(io.StringIO(), verbose, hold_on_failure=False)
        stream.feed(noise + real[:20])
        stream.feed(real[20:])
        assert stream.out.getvalue() == expected


def test_cli_passes_options_overrides_and_accelerate_args_apart(monkeypatch):
    seen = {}
    monkeypatch.setattr(train, "train_cli", lambda a: seen.setdefault("args", a) and 0)
    cli.main(["train", "dpo", "x.y=1", "--backend", "ddp", "z=2", "--", "--main_process_port", "9"])
    got = seen["args"]
    assert (got.items, got.backend, got.accelerate_args) == (
        ["dpo", "x.y=1", "z=2"], "ddp", ["--main_process_port", "9"]
    )  # fmt: skip
    assert train.split_items(["a=1"], None) == ("sft", ["a=1"])
    # Without a recipe name, the config's own sections choose, as `ftkit check-config` does.
    assert train.split_items(["a=1"], "recipes/configs/demo-dpo.yaml") == ("dpo", ["a=1"])
    assert train.split_items([], "recipes/configs/demo-grpo.yaml") == ("grpo", [])


def test_exit_files_are_read_by_rank(tmp_path):
    from toolkit import console

    for rank in (10, 2):
        (tmp_path / f"rank-{rank}.json").write_text(f'{{"code": {rank}, "message": ""}}')
    assert [e["code"] for e in console.read_exits(tmp_path)] == [2, 10]


def test_each_recipe_is_checked_with_its_own_config_schema_and_default():
    from toolkit.preference.config import PreferenceConfig
    from toolkit.recipes import load_recipe_config as recipe_config

    dpo = recipe_config("dpo", None, ["dpo.beta=0.2"])
    assert isinstance(dpo, PreferenceConfig) and dpo.dpo.beta == 0.2 and dpo.output_dir == "runs/demo-dpo"
    sft = recipe_config("sft", None, [])
    assert not isinstance(sft, PreferenceConfig) and sft.output_dir == "runs/demo"
    with pytest.raises(UserError, match="unknown key dpo"):
        recipe_config("sft", None, ["dpo.beta=0.2"])


def test_auto_plans_preference_tuning_with_two_sequences_and_the_reference():
    from toolkit.commands.auto_backend import plan_request
    from toolkit.plan.estimate import make_plan
    from toolkit.recipes import load_recipe_config as recipe_config

    config = "recipes/configs/llama3-8b-dpo-lora.yaml"
    dpo = plan_request(recipe_config("dpo", config, []), [], 2, 24.0)
    assert (dpo.objective, dpo.reference_model) == ("dpo", False)
    separate = plan_request(recipe_config("dpo", config, ["dpo.reference_model=ref"]), [], 2, 24.0)
    assert separate.reference_model
    sft = plan_request(recipe_config("sft", config.replace("-dpo", ""), []), [], 2, 24.0)
    assert sft.objective == "sft"

    def ddp_total(request):  # per-GPU bytes of DDP at micro-batch 1, checkpointing on
        row = next(r for r in make_plan(request).rows if r.backend == "ddp" and r.checkpointing)
        return row.per_gpu()["total"]

    pinned = dict(micro_batch=1, grad_ckpt="on", seq_len=dpo.seq_len)
    totals = [ddp_total(dataclasses.replace(r, **pinned)) for r in (sft, dpo, separate)]
    assert totals[0] < totals[1] < totals[2]


def test_grpo_launches_its_recipe_with_its_config_and_auto_plans_its_generation_round():
    from toolkit.commands.auto_backend import plan_request
    from toolkit.grpo.config import GrpoRecipeConfig

    parsed = args("grpo", "--backend", "auto", "grpo.max_new_tokens=16")
    name, overrides = train.split_items(parsed.items, parsed.config)
    cfg = load_recipe_config(name, parsed.config, overrides)
    assert isinstance(cfg, GrpoRecipeConfig) and cfg.output_dir == "runs/demo-grpo"
    nodes = train.resolve_nodes(parsed, {})
    plan = train.plan_launch(parsed, overrides, cfg, CPU_BOX, nodes, train.recipe_path(name))
    recipe = plan.argv.index(train.shown(train.REPO / "recipes/grpo_llm.py"))
    assert plan.argv[recipe + 1] == "grpo.max_new_tokens=16" and plan.reason.startswith("auto: ")
    request = plan_request(cfg, overrides, 2, 12.0)
    assert (request.objective, request.generations, request.max_new_tokens) == ("grpo", 8, 16)
    assert (request.seq_len, request.global_batch) == (cfg.data.max_length, cfg.train.global_batch_size)
    # grpo.beta 0 loads no reference, so a named one costs nothing.
    unused = load_recipe_config(name, None, ["grpo.reference_model=toolkit/assets/tiny-llama"])
    assert not plan_request(unused, [], 2, 12.0).reference_model
    used = load_recipe_config(name, None, ["grpo.reference_model=toolkit/assets/tiny-llama", "grpo.beta=0.1"])
    assert plan_request(used, [], 2, 12.0).reference_model
    # The engine ftkit starts shares the main process's GPU; one at grpo.vllm.url has a GPU of its own.
    vllm = ["model.adapter=null", "grpo.generation=vllm", "grpo.vllm.gpu_memory_utilization=0.5"]
    shared = plan_request(load_recipe_config(name, None, vllm), [], 2, 12.0)
    assert (shared.generation, shared.gpu_memory_utilization, shared.engine) == ("vllm", 0.5, "shared")
    yours = load_recipe_config(name, None, [*vllm, "grpo.vllm.url=http://127.0.0.1:8000"])
    assert plan_request(yours, [], 2, 12.0).engine == "own"
