"""`ftkit train`: the `accelerate launch` line for this machine, printed, checked, then run.

    ftkit train [RECIPE] [--backend NAME|auto] [--gpus N] [--config FILE] [key=value ...] [-- accelerate args]

`plan_launch` only builds the command (tests fake the machine); `preflight` runs the fail-level checks of
`ftkit doctor` and `ftkit check-config`; `toolkit.commands.relay` runs it and passes the worker's exit on.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from toolkit.config import RecipeConfig
from toolkit.errors import UserError
from toolkit.launch.machine import Machine, probe_machine
from toolkit.recipes import SCRIPTS, check_recipe_name, load_recipe_config, recipe_of
from toolkit.typed_yaml import Sources

REPO = Path(__file__).resolve().parent.parent.parent
CPU_PROCESSES = 2  # without GPUs: a dry run of the same command on gloo CPU processes
DEFAULT_PORT = 29500
# Launch files whose recipe needs pipeline.size (accelerate takes no such key): the size they imply, None
# for every launched process.
PIPELINE_SIZE = {"pp": None, "pp_ddp": 2}


@dataclass(frozen=True)
class Nodes:
    """Where this machine sits in a multi-machine launch."""

    count: int = 1
    """Machines in the launch."""
    rank: int = 0
    """This machine's rank (0 on the main one)."""
    addr: str = ""
    """Address of machine rank 0."""
    port: int | None = None
    """Rendezvous port on machine rank 0 (None: accelerate's default, single machine)."""


@dataclass(frozen=True)
class LaunchPlan:
    argv: list[str]
    """`accelerate launch ...` as a user would type it."""
    backend: str
    """Name of the accelerate config in accelerate_configs/."""
    processes: int
    """Processes on all machines together."""
    per_node: int
    """Processes on this machine."""
    reason: str = ""
    """Why `auto` chose this backend (empty for a named one)."""
    overrides: list[str] = dataclasses.field(default_factory=list)
    """The recipe's key=value overrides, with what the backend adds (pipeline.size for pp,
    moe.expert_parallel for ep)."""

    def display(self) -> str:
        return shlex.join(self.argv)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "items",
        nargs="*",
        metavar="[RECIPE] [key=value ...]",
        help="sft, dpo, grpo, rm or embed (default: the one --config is for, else sft)",
    )
    parser.add_argument("--backend", default="auto", help="an accelerate_configs/ name, or auto (default)")
    parser.add_argument("--gpus", type=int, help="processes per machine (default: its GPUs, or 2 on CPU)")
    parser.add_argument("--config", help="recipe config YAML (default: the recipe's demo config)")
    parser.add_argument("--nnodes", type=int, help="machines (default: SLURM_NNODES, else 1)")
    parser.add_argument("--node-rank", type=int, help="this machine's rank (default: SLURM_NODEID)")
    parser.add_argument("--master-addr", help="address of node rank 0 (default: first SLURM host)")
    parser.add_argument("--master-port", type=int, help=f"rendezvous port (default {DEFAULT_PORT})")
    parser.add_argument("--verbose", action="store_true", help="show third-party output unfiltered")


def split_items(items: list[str], config: str | None) -> tuple[str, list[str]]:
    """The recipe name (first item without '='; else the one `config` is for) and the dotted.key=value
    overrides."""
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return recipe_of(config), items


def recipe_path(name: str, repo: Path = REPO) -> Path:
    path = repo / SCRIPTS[check_recipe_name(name)]
    if not path.is_file():
        raise UserError(f"recipe {name}: {SCRIPTS[name]} does not exist in this version of ftkit")
    return path


def backend_names(repo: Path = REPO) -> list[str]:
    """Single-machine accelerate configs; several machines take --nnodes, not a multinode_ YAML."""
    return sorted(p.stem for p in (repo / "accelerate_configs").glob("*.yaml") if "multinode" not in p.stem)


def slurm_hostnames(nodelist: str) -> list[str]:
    done = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise UserError(f"scontrol show hostnames {nodelist} failed: {done.stderr.strip()}")
    return done.stdout.split()


def resolve_nodes(
    args, env: Mapping[str, str], hostnames: Callable[[str], list[str]] = slurm_hostnames
) -> Nodes:
    """Machines from the flags, else from SLURM's environment (one task per node), else this one alone."""
    in_slurm = "SLURM_NNODES" in env and "SLURM_NODEID" in env
    count = args.nnodes or (int(env["SLURM_NNODES"]) if in_slurm else 1)
    rank = args.node_rank if args.node_rank is not None else int(env["SLURM_NODEID"]) if in_slurm else 0
    addr = args.master_addr or ""
    if not addr and count > 1 and in_slurm:
        addr = hostnames(env["SLURM_JOB_NODELIST"])[0]
    port = args.master_port or (int(env["MASTER_PORT"]) if "MASTER_PORT" in env else None)
    if count > 1 and not addr:
        raise UserError(f"--nnodes {count}: pass --master-addr (the address of node rank 0)")
    if not 0 <= rank < count:
        raise UserError(f"--node-rank {rank} is not in 0..{count - 1} (--nnodes {count})")
    return Nodes(count, rank, addr, port or (DEFAULT_PORT if count > 1 else None))


def shown(path: Path) -> str:
    """A path as short as it can be from where the user runs."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def plan_launch(
    args, overrides: list[str], cfg: RecipeConfig, hardware: Machine, nodes: Nodes, recipe: Path
) -> LaunchPlan:
    """The `accelerate launch` command for this machine: backend, process count, machines, recipe."""
    from toolkit.commands.auto_backend import choose

    per_node = args.gpus or hardware.gpu_count or CPU_PROCESSES
    reason, extra = "", []
    backend = args.backend
    if backend == "auto":
        backend, extra, reason = choose(cfg, overrides, hardware, per_node * nodes.count)
    if backend not in backend_names():
        raise UserError(f"--backend {backend}: not one of auto, {', '.join(backend_names())}")
    per_node = 1 if backend == "single" else per_node
    if backend in PIPELINE_SIZE and not any(item.startswith("pipeline.size=") for item in overrides):
        extra.append(f"pipeline.size={PIPELINE_SIZE[backend] or per_node * nodes.count}")
    if backend == "ep" and not any(item.startswith("moe.expert_parallel=") for item in overrides):
        extra.append(f"moe.expert_parallel={per_node * nodes.count}")  # the experts over every process
    config_file = REPO / "accelerate_configs" / f"{backend}.yaml"
    argv = ["accelerate", "launch", "--config_file", shown(config_file)]
    argv += ["--num_processes", str(per_node * nodes.count)]
    argv += _machine_args(nodes, backend) + _deepspeed_json_args(config_file) + list(args.accelerate_args)
    argv += [shown(recipe), *(["--config", args.config] if args.config else []), *overrides, *extra]
    return LaunchPlan(argv, backend, per_node * nodes.count, per_node, reason, [*overrides, *extra])


def _machine_args(nodes: Nodes, backend: str) -> list[str]:
    if nodes.count == 1:
        return ["--main_process_port", str(nodes.port)] if nodes.port else []
    launcher = ["--deepspeed_multinode_launcher", "standard"] if backend.startswith("zero") else []
    return [
        "--num_machines",
        str(nodes.count),
        "--machine_rank",
        str(nodes.rank),
        "--main_process_ip",
        nodes.addr,
        "--main_process_port",
        str(nodes.port),
        *launcher,
    ]


def _deepspeed_json_args(config_file: Path) -> list[str]:
    """The shipped YAMLs name their JSON relative to the repo root: point at it when run from elsewhere."""
    import yaml

    section = (yaml.safe_load(config_file.read_text()) or {}).get("deepspeed_config") or {}
    json_file = section.get("deepspeed_config_file")
    if not json_file or Path(json_file).is_file():
        return []
    return ["--deepspeed_config_file", str(REPO / json_file)]


def preflight(plan: LaunchPlan, cfg: RecipeConfig, config_source: Sources, findings, machine, env) -> None:
    """The fail-level checks of `ftkit doctor` (`findings`) and `ftkit check-config`, as one UserError."""
    from toolkit.launch.checks import check_launch, launch_from_yaml
    from toolkit.model.facts import read_model_facts

    failed = [f for f in findings if f.status == "fail"]
    if failed:
        fix = f" ({failed[0].fix})" if failed[0].fix else ""
        raise UserError(f"ftkit doctor: {failed[0].check}: {failed[0].message}{fix}")
    from toolkit.launch.backend import with_pipeline

    config_file = REPO / "accelerate_configs" / f"{plan.backend}.yaml"
    launch = launch_from_yaml(config_file, machine.gpu_count, plan.processes)
    launch = dataclasses.replace(launch, procs_per_node=plan.per_node, source=shown(config_file))
    launch = with_pipeline(launch, cfg.pipeline.size, config_source)
    # A copy: what the check sets for NCCL belongs to the launched processes, which set it themselves.
    check_launch(launch, cfg, read_model_facts(cfg.model), config_source, machine, dict(env))


def train_cli(args) -> int:
    """Build, print, check and run the launch; the exit code is the worker's own."""
    from toolkit.commands import relay
    from toolkit.commands.doctor import probe, report

    name, overrides = split_items(args.items, args.config)
    recipe = recipe_path(name)
    cfg = load_recipe_config(name, args.config, overrides)
    nodes = resolve_nodes(args, os.environ)
    machine = probe_machine()
    plan = plan_launch(args, overrides, cfg, machine, nodes, recipe)
    cfg = load_recipe_config(name, args.config, plan.overrides)
    if plan.reason:
        print(plan.reason)
    print(plan.display(), flush=True)
    findings = report.diagnose(probe.gather_probes(Path(cfg.output_dir), include_warnings=False))
    preflight(
        plan,
        cfg,
        Sources.given(args.config or "the demo config", plan.overrides),
        findings,
        machine,
        os.environ,
    )
    return relay.run(plan.argv, os.environ, recipe.stem, verbose=args.verbose)
