"""`ftkit doctor`'s verdict: every check in order, the exit code, and the text and JSON reports."""

from __future__ import annotations

import dataclasses

from toolkit.commands.doctor import gpus, host, software
from toolkit.commands.doctor.records import Finding, Probes


def diagnose(p: Probes) -> list[Finding]:
    """Every check, in the order a person would fix them."""
    findings = [
        software.versions(p),
        *software.requirements_met(p),
        *software.optional_packages(p),
        gpus.cuda_stack(p),
        gpus.gpu_kinds(p),
        gpus.p2p(p),
        gpus.nccl_env(p),
        gpus.allreduce(p),
        host.cpu(p),
        host.ram(p),
        host.disk(p),
        software.accelerate_default(p),
        software.deepspeed_ops(p),
        software.build_locks(p),
        software.bitsandbytes_backend(p),
        software.recurrent_kernels(p),
    ]
    return [f for f in findings if f is not None]


def exit_code(findings: list[Finding]) -> int:
    return 1 if any(f.status == "fail" for f in findings) else 0


def render_text(findings: list[Finding], probes: Probes) -> str:
    """One line per finding (and its fix), the topology matrix when there is one, and a tally."""
    lines = []
    for f in findings:
        lines.append(f"{f.status:5} {f.check:11} {f.message}")
        if f.fix and f.status != "ok":
            lines.append(f"{'':17} fix: {f.fix}")
    if probes.topology:
        lines += ["", "nvidia-smi topo -m:", *(f"  {line}" for line in probes.topology.splitlines())]
    tally = {s: sum(f.status == s for f in findings) for s in ("fail", "warn", "ok")}
    lines += ["", ", ".join(f"{n} {s}" for s, n in tally.items())]
    return "\n".join(lines)


def to_json(findings: list[Finding], probes: Probes) -> dict:
    return {
        "ok": exit_code(findings) == 0,
        "findings": [dataclasses.asdict(f) for f in findings],
        "probes": dataclasses.asdict(probes),
    }
