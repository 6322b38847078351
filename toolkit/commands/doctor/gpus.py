"""`ftkit doctor`'s GPU checks: the CUDA stack, whether the GPUs match, P2P between them (and the RTX 40xx
NCCL rule), the NCCL variables, and the pairwise all-reduce's results."""

from __future__ import annotations

import re

from toolkit.commands.allreduce_check import PairResult
from toolkit.commands.doctor.records import Finding, Probes
from toolkit.launch.machine import GEFORCE_40, GIB

DRY_RUN = "accelerate launch --config_file accelerate_configs/<x>.yaml recipes/finetune_llm.py"


def cuda_stack(p: Probes) -> Finding | None:
    if p.gpus:
        return Finding(
            "cuda",
            "ok",
            f"CUDA {p.torch_cuda} (torch build), NCCL {p.nccl or 'unknown'}, "
            f"driver {p.driver or 'unknown (no nvidia-smi)'}",
        )
    if p.driver is None:
        return None
    if p.torch_cuda is None:
        return Finding(
            "cuda",
            "fail",
            f"NVIDIA driver {p.driver} found but torch is a CPU build",
            "install a CUDA build of torch for this driver (see pytorch.org/get-started)",
        )
    return Finding(
        "cuda",
        "fail",
        f"NVIDIA driver {p.driver} and CUDA {p.torch_cuda} torch, but torch sees no GPU",
        "check CUDA_VISIBLE_DEVICES and that the driver supports this CUDA version (nvidia-smi)",
    )


def gpu_kinds(p: Probes) -> Finding:
    if not p.gpus:
        return Finding(
            "gpus",
            "warn",
            f"no GPU: CPU only, so every accelerate config runs as a CPU dry run on "
            f"gloo processes ({DRY_RUN})",
            "fine for a dry run; train for real on NVIDIA GPUs (ftkit plan says which fit)",
        )
    kinds = {(g.name, g.memory_bytes) for g in p.gpus}
    listing = ", ".join(f"{i}: {g.name} ({g.memory_bytes / GIB:.1f} GiB)" for i, g in enumerate(p.gpus))
    if len(kinds) == 1:
        return Finding(
            "gpus",
            "ok",
            f"{len(p.gpus)} x {p.gpus[0].name} ({p.gpus[0].memory_bytes / GIB:.1f} GiB), identical",
        )
    return Finding(
        "gpus",
        "warn",
        f"mismatched GPUs: {listing}",
        "the smallest GPU bounds every rank's memory and the slowest paces every step: "
        "CUDA_VISIBLE_DEVICES=<identical ones>",
    )


def p2p(p: Probes) -> Finding | None:
    if len(p.gpus) < 2:
        return None
    claimed = [(i, j) for i, j, ok in p.p2p if ok]
    missing = sorted({tuple(sorted((i, j))) for i, j, ok in p.p2p if not ok})
    if any(GEFORCE_40.search(g.name) for g in p.gpus):
        return _geforce_40_p2p(p, bool(claimed))
    if not missing:
        nvlink = bool(p.topology and re.search(r"\bNV\d+\b", p.topology))
        return Finding("p2p", "ok", "P2P between every GPU pair" + (", NVLink" if nvlink else " (PCIe)"))
    pairs = ", ".join(f"{i}-{j}" for i, j in missing)
    return Finding(
        "p2p",
        "warn",
        f"no P2P between GPUs {pairs}: NCCL copies through host memory, slowing every "
        "all-reduce (ZeRO-3 and FSDP most)",
        "expected on consumer cards: prefer ddp or zero2 (ftkit plan), or rent NVLink machines",
    )


def _geforce_40_p2p(p: Probes, driver_claims_p2p: bool) -> Finding:
    fix = "export NCCL_P2P_DISABLE=1 NCCL_IB_DISABLE=1"
    if p.nccl_env.get("NCCL_P2P_DISABLE") != "1":
        if driver_claims_p2p:
            return Finding(
                "p2p",
                "fail",
                "GeForce RTX 40xx has no P2P, but the driver reports P2P access and "
                "NCCL_P2P_DISABLE is not set: NCCL would use it and hang",
                fix,
            )
        return Finding("p2p", "warn", "GeForce RTX 40xx has no P2P and NCCL_P2P_DISABLE is not set", fix)
    if p.nccl_env.get("NCCL_IB_DISABLE") != "1":
        return Finding(
            "p2p", "warn", "GeForce RTX 40xx: NCCL_P2P_DISABLE=1 is set but NCCL_IB_DISABLE is not", fix
        )
    return Finding(
        "p2p",
        "ok",
        "GeForce RTX 40xx without P2P: NCCL_P2P_DISABLE=1 and NCCL_IB_DISABLE=1 are set "
        "(NCCL goes through host memory)",
    )


def nccl_env(p: Probes) -> Finding:
    shown = " ".join(f"{k}={v}" for k, v in p.nccl_env.items()) or "none set"
    geforce_40 = any(GEFORCE_40.search(g.name) for g in p.gpus)
    full_p2p = len(p.gpus) > 1 and all(ok for _, _, ok in p.p2p)
    if p.nccl_env.get("NCCL_P2P_DISABLE") == "1" and full_p2p and not geforce_40:
        return Finding(
            "nccl env",
            "warn",
            f"{shown}: P2P disabled although every GPU pair supports it",
            "unset NCCL_P2P_DISABLE for faster all-reduce",
        )
    return Finding("nccl env", "ok", f"NCCL variables: {shown}")


def allreduce(p: Probes) -> Finding | None:
    if not p.allreduce or len(p.gpus) < 2:
        return None
    broken = [r for r in p.allreduce if r.status != "ok" and r.without_p2p != "ok"]
    fixed = [r for r in p.allreduce if r.status != "ok" and r.without_p2p == "ok"]
    if broken:
        first = broken[0].devices
        return Finding(
            "allreduce",
            "fail",
            f"NCCL all-reduce on GPUs {_outcomes(broken)}",
            "see where NCCL stops: NCCL_DEBUG=INFO python -m toolkit.commands.allreduce_check "
            f"--devices {first[0]},{first[1]}",
        )
    if fixed:
        return _allreduce_needs_p2p_off(p, fixed)
    slowest = max(p.allreduce, key=lambda r: r.seconds)
    return Finding(
        "allreduce",
        "ok",
        f"NCCL all-reduce passed on every GPU pair ({len(p.allreduce)}), sums checked; slowest "
        f"{_pair(slowest)} in {slowest.seconds:.1f} s with start-up",
    )


def _allreduce_needs_p2p_off(p: Probes, fixed: list[PairResult]) -> Finding:
    message = f"NCCL all-reduce on GPUs {_outcomes(fixed)}: their P2P path is broken"
    # The rule of launch.checks._disable_nccl_p2p, which every ftkit recipe process runs before NCCL starts.
    geforce_40 = any(GEFORCE_40.search(g.name) for g in p.gpus)
    if geforce_40 and not any(ok for i, j, ok in p.p2p if (i, j) == (0, 1)):
        return Finding(
            "allreduce",
            "warn",
            message,
            "ftkit's recipes set NCCL_P2P_DISABLE=1 themselves on these RTX 40xx GPUs; "
            "for other programs: export NCCL_P2P_DISABLE=1",
        )
    return Finding("allreduce", "fail", message, "export NCCL_P2P_DISABLE=1")


def _outcomes(results: list[PairResult]) -> str:
    """E.g. `0-1 hung (no result within 30 s), ok with NCCL_P2P_DISABLE=1`."""
    return "; ".join(
        f"{_pair(r)} {r.status} ({r.reason})"
        + (f", {r.without_p2p} with NCCL_P2P_DISABLE=1" if r.without_p2p else "")
        for r in results
    )


def _pair(result: PairResult) -> str:
    return f"{result.devices[0]}-{result.devices[1]}"
