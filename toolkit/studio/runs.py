"""What the page shows of a run, read from its folder each time: the config it saved, its metrics.jsonl, its
checkpoints, whether a process holds its lock; and, for the runs the studio started, the launch record in
RUNS/.studio/NAME (the command, its output, its exit code). Nothing else is kept: a run started from a
terminal reads the same, less what only its terminal saw."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from toolkit.checkpoint.rundir import CONFIG, LOCK, MARKER
from toolkit.launch.preemption import PREEMPTED_EXIT_CODE

STUDIO_DIR = ".studio"
"""Under the runs folder: one folder per run the studio launched (launch.json, output.log, exit)."""
EVAL_KEYS = ("exact_match", "eval_reward_accuracy", "eval_loss")
TAIL_BYTES = 64 * 1024
MAX_POINTS = 1000
ERROR_LINE = re.compile(r"^\S[^:\n]*: error: .*$", re.M)
STOP_LINE = re.compile(r"stopped by \S+ (?:after|before) .*$", re.M)
BACKEND_IN_LOG = re.compile(r"--config_file \S*?([\w.-]+)\.yaml")


@dataclass
class RunView:
    """One row of the runs list."""

    name: str
    recipe: str = ""
    model: str = ""
    method: str = ""
    backend: str = ""
    status: str = ""
    """running, starting, finished, failed, stopped."""
    reason: str = ""
    """A failed run's one-line reason; a stopped run's line."""
    step: int = 0
    max_steps: int = 0
    eta_s: float | None = None
    result: str = ""
    resumable: bool = False
    created: bool = False
    """Launched (as a new run) by the studio: the only runs it offers to delete."""
    started: float = 0.0
    checkpoints: list[str] = field(default_factory=list)


def run_dirs(root: Path) -> list[Path]:
    """The run folders directly under `root` (marked by a run, or holding a saved config), and the ones the
    studio launched that have not made their folder yet (or failed before), newest first."""
    if not root.is_dir():
        return []
    found = {
        p
        for p in root.iterdir()
        if not p.name.startswith(".") and p.is_dir() and ((p / MARKER).is_file() or (p / CONFIG).is_file())
    }
    records = root / STUDIO_DIR
    if records.is_dir():
        found |= {root / p.name for p in records.iterdir() if (p / "launch.json").is_file()}
    return sorted(found, key=lambda p: _mtime(p / CONFIG) or _started(root, p.name), reverse=True)


def _started(root: Path, name: str) -> float:
    return _mtime(record_dir(root, name) / "launch.json")


def record_dir(root: Path, name: str) -> Path:
    return root / STUDIO_DIR / name


def read_record(root: Path, name: str) -> dict:
    """The launch record of a run the studio started ({} for any other)."""
    try:
        record = json.loads((record_dir(root, name) / "launch.json").read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def lock_holder(run_dir: Path) -> int | None:
    """The pid holding the run's lock (a training process), from the kernel's lock table; None when free."""
    try:
        stat = (run_dir / LOCK).stat()
        table = Path("/proc/locks").read_text()
    except OSError:
        return None
    device = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
    for line in table.splitlines():
        parts = line.split()
        if len(parts) > 5 and parts[1] == "FLOCK" and parts[5] == device:
            return int(parts[4])
    return None


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


_CONFIG_CACHE: dict[Path, tuple[float, dict]] = {}


def saved_config(run_dir: Path) -> dict:
    """The run's config.yaml as a mapping ({} when missing or unreadable); re-read when it changes."""
    path = run_dir / CONFIG
    mtime = _mtime(path)
    cached = _CONFIG_CACHE.get(path)
    if cached and cached[0] == mtime:
        return cached[1]
    try:
        loaded = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or {}
    except (OSError, yaml.YAMLError):
        loaded = {}
    config = loaded if isinstance(loaded, dict) else {}
    _CONFIG_CACHE[path] = (mtime, config)
    return config


def recipe_label(config: dict) -> str:
    """The recipe a saved config is for, by its sections (as toolkit.recipes.recipe_of), KTO told apart."""
    if "dpo" in config:
        return "kto" if (config.get("dpo") or {}).get("loss") == "kto" else "dpo"
    if "reward" in config:
        return "rm"
    return "grpo" if "grpo" in config else "sft"


def method_label(config: dict) -> str:
    model, lora = config.get("model") or {}, config.get("lora") or {}
    method = model.get("method", "")
    return "dora" if method == "lora" and lora.get("use_dora") else method


def summarize(root: Path, run_dir: Path) -> RunView:
    """The runs-list row of `run_dir`: what it is, how far it got, how it ended."""
    config = saved_config(run_dir)
    record = read_record(root, run_dir.name)
    log = log_tail(root, run_dir.name)
    view = RunView(
        name=run_dir.name,
        recipe=recipe_label(config),
        model=str((config.get("model") or {}).get("path", "")),
        method=method_label(config),
        max_steps=int((config.get("train") or {}).get("max_steps") or 0),
        created=bool(record.get("created")),
        started=record.get("started") or _mtime(run_dir / CONFIG),
        checkpoints=checkpoint_names(run_dir),
    )
    found = BACKEND_IN_LOG.search(log)
    view.backend = found.group(1) if found else record.get("backend", "")
    head, tail = _first_and_last_records(run_dir / "metrics.jsonl")
    trained = [r for r in tail if "loss" in r]
    view.step = trained[-1]["step"] if trained else 0
    _set_status(view, root, run_dir, record, log)
    if view.status == "running" and trained:
        times = [r["step_time_s"] for r in trained[-20:] if isinstance(r.get("step_time_s"), (int, float))]
        if times:
            view.eta_s = max(view.max_steps - view.step, 0) * sum(times) / len(times)
    if view.status == "finished":
        view.result = result_line(run_dir, head, tail, view.max_steps)
    return view


def _set_status(view: RunView, root: Path, run_dir: Path, record: dict, log: str) -> None:
    exit_code = read_exit(root, run_dir.name)
    if lock_holder(run_dir) is not None:
        view.status = "running"
    elif record and exit_code is None and alive(record.get("pid")):
        view.status = "starting"
    elif exit_code == 0 or (exit_code is None and (run_dir / "final").is_dir()):
        view.status = "finished"
    elif exit_code == PREEMPTED_EXIT_CODE or (exit_code is None and view.checkpoints):
        view.status = "stopped"
        view.resumable = bool(view.checkpoints)
        lines = STOP_LINE.findall(log)
        view.reason = lines[-1] if lines else ""
    else:
        view.status = "failed"
        lines = ERROR_LINE.findall(log)
        if lines:
            view.reason = lines[-1]
        elif record:
            view.reason = f"exit {exit_code}" if exit_code is not None else "ended without reporting why"
        else:
            view.reason = "started outside the studio: its one-line reason went to the terminal that ran it"


def read_exit(root: Path, name: str) -> int | None:
    try:
        return int((record_dir(root, name) / "exit").read_text().strip())
    except (OSError, ValueError):
        return None


def log_tail(root: Path, name: str, size: int = TAIL_BYTES) -> str:
    """The end of the output of a run the studio launched ("" for others), progress-bar redraws folded."""
    path = record_dir(root, name) / "output.log"
    try:
        with path.open("rb") as handle:
            handle.seek(max(path.stat().st_size - size, 0))
            text = handle.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(line.rsplit("\r", 1)[-1] if "\r" in line else line for line in text.split("\n"))


def checkpoint_names(run_dir: Path) -> list[str]:
    checkpoints = run_dir / "checkpoints"
    if not checkpoints.is_dir():
        return []
    names = [p.name for p in checkpoints.iterdir() if p.is_dir() and p.name.startswith("step-")]
    return sorted(names, key=lambda n: int(n.split("-")[1]) if n.split("-")[1].isdigit() else -1)


def result_line(run_dir: Path, head: list[dict], tail: list[dict], max_steps: int) -> str:
    """The run's closing result line, by the function the recipes print it with."""
    from toolkit.train.steps import closing_lines

    def evals(records):
        return [r for r in records if any(k in r for k in EVAL_KEYS) and "loss" not in r]

    before = next((r for r in evals(head) if r["step"] == 0), {})
    after = next((r for r in reversed(evals(tail)) if r["step"] >= max_steps), {})
    shown = {"before": before, "after": after} if after else {}
    return closing_lines(shown, run_dir / "final", None)[0].removeprefix("result: ")


def _first_and_last_records(path: Path) -> tuple[list[dict], list[dict]]:
    """The records of the file's first and last TAIL_BYTES (whole lines only)."""
    try:
        with path.open("rb") as handle:
            size = path.stat().st_size
            head = handle.read(min(size, TAIL_BYTES))
            handle.seek(max(size - TAIL_BYTES, 0))
            tail = handle.read()
    except OSError:
        return [], []
    first = _parse_lines(head.rsplit(b"\n", 1)[0] if size > TAIL_BYTES else head)
    last = _parse_lines(tail.split(b"\n", 1)[1] if size > TAIL_BYTES else tail)
    return first, last


def _parse_lines(data: bytes) -> list[dict]:
    records = []
    for line in data.split(b"\n"):
        try:
            record = json.loads(line)
        except ValueError:
            continue  # blank, or a line being written
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


class MetricsReader:
    """metrics.jsonl read once and then only what was appended since (a resumed run rewrites the file: it
    is read anew). Holds parsed records of files the page looks at; the file stays the record."""

    def __init__(self):
        self._files: dict[Path, tuple[int, int, list[dict]]] = {}

    def records(self, path: Path) -> list[dict]:
        try:
            stat = path.stat()
        except OSError:
            return []
        inode, offset, records = self._files.get(path, (stat.st_ino, 0, []))
        if inode != stat.st_ino or stat.st_size < offset:
            inode, offset, records = stat.st_ino, 0, []
        if stat.st_size > offset:
            with path.open("rb") as handle:
                handle.seek(offset)
                data = handle.read(stat.st_size - offset)
            whole = data.rfind(b"\n") + 1  # a line still being written waits for the next read
            records = records + _parse_lines(data[:whole])
            offset += whole
        self._files[path] = (inode, offset, records)
        return records


def series(records: list[dict], max_points: int = MAX_POINTS) -> dict[str, list[list[float]]]:
    """Every numeric metric as [[step, value], ...], at most `max_points` each (bucket means, the last point
    exact); eval values apart from training ones under the same name (loss vs eval_loss stays as logged)."""
    columns: dict[str, list[list[float]]] = {}
    for record in records:
        step = record["step"]
        for key, value in record.items():
            if key in ("step", "time") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                columns.setdefault(key, []).append([step, value])
    return {key: downsample(points, max_points) for key, points in columns.items()}


def downsample(points: list[list[float]], max_points: int) -> list[list[float]]:
    if len(points) <= max_points:
        return points
    width = (len(points) - 1) / (max_points - 1)
    out = []
    for i in range(max_points - 1):
        bucket = points[int(i * width) : max(int((i + 1) * width), int(i * width) + 1)]
        out.append([bucket[-1][0], sum(p[1] for p in bucket) / len(bucket)])
    return [*out, points[-1]]


def stop_run(root: Path, run_dir: Path, sig: int = signal.SIGINT) -> str:
    """Ask a running run to stop as Ctrl-C would: `sig` to its whole process group. Returns what was done."""
    from toolkit.errors import UserError

    record = read_record(root, run_dir.name)
    group = record.get("pgid") if record and read_exit(root, run_dir.name) is None else None
    if not group:
        holder = lock_holder(run_dir)
        if holder is None:
            raise UserError(f"stop: {run_dir.name} is not running")
        group = os.getpgid(holder)
    if group == os.getpgrp():
        raise UserError(
            f"stop: {run_dir.name} runs in the studio's own process group; stop it from its terminal"
        )
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        raise UserError(f"stop: {run_dir.name} is not running") from None
    return f"sent {signal.Signals(sig).name} to process group {group}"


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def eta_text(seconds: float | None) -> str:
    if seconds is None:
        return ""
    seconds = int(seconds)
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
        if seconds >= 3600
        else f"{seconds // 60}m{seconds % 60:02d}s"
    )


def age_text(started: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(started)) if started else ""
