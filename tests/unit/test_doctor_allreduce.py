"""`ftkit doctor`'s pairwise all-reduce: the real subprocess check on gloo here, its timeout, its findings.

Only the GPUs are described; the processes, the timeout and the kill are real.
"""

import json
import os
import signal
import time
from pathlib import Path

from test_doctor import A100, RTX_4090, finding, machine

from toolkit.commands.allreduce_check import PairResult, check_pairs
from toolkit.commands.doctor.report import diagnose, exit_code, render_text, to_json

# Stands in for a NCCL hang: the pair's process forks a grandchild; both write their pid and sleep. The
# grandchild lets go of stderr, so a check that killed only its child returns (and fails) instead of blocking.
HANG = """
import os, time
if os.environ.get("HANG_PIDS") and os.getppid() == int(os.environ["HANG_UNDER"]):
    role = "grandchild" if os.fork() == 0 else "child"
    if role == "grandchild":
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    open(os.path.join(os.environ["HANG_PIDS"], role), "w").write(str(os.getpid()))
    time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def processes_with(marker: str) -> list[int]:
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return [pid for pid in found if alive(pid)]


def test_a_real_pair_all_reduces_on_gloo():
    [result] = check_pairs(2, timeout_s=120, backend="gloo")
    assert result == PairResult((0, 1), "ok", result.seconds)


def test_a_failing_nccl_pair_is_retried_without_p2p():
    # No CUDA here, so NCCL fails both times: the retry runs, and the reason is the last stderr line.
    [result] = check_pairs(2, timeout_s=120, backend="nccl", env=os.environ)
    assert (result.status, result.without_p2p) == ("failed", "failed")
    assert result.reason == "cuda:1 is not visible: torch sees 0 GPUs"


def test_nccl_p2p_disable_already_set_means_no_retry():
    env = {**os.environ, "NCCL_P2P_DISABLE": "1"}
    [result] = check_pairs(2, timeout_s=120, backend="nccl", env=env)
    assert (result.status, result.without_p2p) == ("failed", None)


def test_a_tiny_timeout_reports_hung_and_leaves_no_process():
    marker = f"FTKIT_ALLREDUCE_TEST={os.getpid()}-{time.monotonic_ns()}"
    env = {**os.environ, marker.split("=")[0]: marker.split("=")[1]}
    results = check_pairs(3, timeout_s=0.05, backend="gloo", env=env)
    assert [(r.devices, r.status) for r in results] == [((0, 1), "hung"), ((0, 2), "hung"), ((1, 2), "hung")]
    assert results[0].reason == "no result within 0.05 s"
    assert processes_with(marker) == []


def test_a_hang_kills_the_whole_process_group(tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(HANG)
    env = {
        **os.environ,
        "PYTHONPATH": str(tmp_path / "site"),
        "HANG_PIDS": str(tmp_path),
        "HANG_UNDER": str(os.getpid()),
    }
    [result] = check_pairs(2, timeout_s=5, backend="gloo", env=env)
    assert result.status == "hung" and 5 <= result.seconds < 30
    pids = [int((tmp_path / role).read_text()) for role in ("child", "grandchild")]
    deadline = time.monotonic() + 5
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = [pid for pid in pids if alive(pid)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert survivors == []


def pair(status: str, without_p2p: str | None = None, reason: str = "") -> PairResult:
    return PairResult((0, 1), status, 31.0 if status == "hung" else 4.2, reason, without_p2p)


FOUR_090S = {"gpus": [RTX_4090, RTX_4090], "p2p": [(0, 1, False), (1, 0, False)], "topology": None}


def test_all_pairs_ok():
    box = machine(allreduce=[pair("ok")])
    allreduce = finding(box, "allreduce")
    assert allreduce.status == "ok" and "slowest 0-1 in 4.2 s" in allreduce.message
    assert {f.status for f in diagnose(box)} == {"ok"}


def test_hung_on_4090s_then_fixed_without_p2p_says_ftkit_sets_it():
    hung = pair("hung", "ok", "no result within 30 s")
    allreduce = finding(machine(**FOUR_090S, allreduce=[hung]), "allreduce")
    assert allreduce.status == "warn"
    assert "0-1 hung (no result within 30 s), ok with NCCL_P2P_DISABLE=1" in allreduce.message
    assert "NCCL_P2P_DISABLE=1" in allreduce.fix and "ftkit's recipes set" in allreduce.fix


def test_fixed_without_p2p_elsewhere_fails_and_says_export():
    box = machine(gpus=[A100, A100], allreduce=[pair("failed", "ok", "RuntimeError: NCCL error")])
    allreduce = finding(box, "allreduce")
    assert allreduce.status == "fail" and allreduce.fix == "export NCCL_P2P_DISABLE=1"
    assert exit_code(diagnose(box)) == 1


def test_failing_both_ways_points_at_nccl_debug():
    box = machine(**FOUR_090S, allreduce=[pair("ok"), pair("failed", "hung", "RuntimeError: NCCL error")])
    allreduce = finding(box, "allreduce")
    assert allreduce.status == "fail" and "RuntimeError: NCCL error" in allreduce.message
    assert "hung with NCCL_P2P_DISABLE=1" in allreduce.message
    assert allreduce.fix.startswith("see where NCCL stops: NCCL_DEBUG=INFO ")


def test_no_finding_without_the_check_or_a_second_gpu():
    assert not [f for f in diagnose(machine()) if f.check == "allreduce"]
    one = machine(gpus=[A100], p2p=[], allreduce=[pair("hung")])
    assert not [f for f in diagnose(one) if f.check == "allreduce"]


def test_results_are_in_the_json_and_text_reports():
    box = machine(**FOUR_090S, allreduce=[pair("hung", "ok", "no result within 30 s")])
    report = json.loads(json.dumps(to_json(diagnose(box), box)))
    assert report["probes"]["allreduce"] == [
        {
            "devices": [0, 1],
            "status": "hung",
            "seconds": 31.0,
            "reason": "no result within 30 s",
            "without_p2p": "ok",
        }
    ]
    assert "warn  allreduce" in render_text(diagnose(box), box)
