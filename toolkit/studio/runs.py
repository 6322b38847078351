"""What the page shows of a run, read from its folder each time: the config it saved, its metrics.jsonl, its
checkpoints, whether a process holds its lock; and, for the runs the studio started, the launch record in
RUNS/.studio/NAME (the command, its output, its exit code). Nothing else is kept: a run started from a
terminal reads the same, less what only its terminal saw."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from toolkit.checkpoint.rundir import CONFIG, LOCK, MARKER
from toolkit.errors import UserError
from toolkit.launch.preemption import PREEMPTED_EXIT_CODE
from toolkit.train.steps import closing_lines

STUDIO_DIR = ".studio"
"""Under the runs folder: one folder per run the studio launched (launch.json, output.log, exit)."""
EVAL_KEYS = ("exact_match", "eval_reward_accuracy", "eval_loss")
TAIL_BYTES = 64 * 1024
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


def lock_table() -> str:
    """The kernel's table of file locks (read once for a whole list of runs)."""
    try:
        return Path("/proc/locks").read_text()
    except OSError:
        return ""


def lock_holder(run_dir: Path, table: str | None = None) -> int | None:
    """The pid holding the run's lock (a training process), from the kernel's lock table; None when free."""
    table = lock_table() if table is None else table
    try:
        stat = (run_dir / LOCK).stat()
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
FACTS = {"model.path", "model.method", "lora.use_dora", "train.max_steps", "dpo.loss"}
"""The saved config's keys a runs list shows."""
SECTIONS = ("model", "lora", "train", "dpo", "reward", "grpo")
"""The sections it looks for (the recipe is told by which of dpo, reward and grpo are there)."""
SECTION_START = re.compile(r"\n\S")


def saved_config(run_dir: Path) -> dict:
    """The listed facts of the run's config.yaml as {section: {key: value}} ({} when missing), re-read when
    the file changes. The file is the one `save_config` wrote (yaml.safe_dump, two-space indents): its
    top-level sections and their one-line scalars are read without parsing the whole file, which a list of
    hundreds of runs would wait on."""
    path = run_dir / CONFIG
    mtime = _mtime(path)
    cached = _CONFIG_CACHE.get(path)
    if cached and cached[0] == mtime:
        return cached[1]
    try:
        text = path.read_text()
    except OSError:
        text = ""
    text = "\n" + text
    config: dict[str, dict] = {name: {} for name in SECTIONS if f"\n{name}:\n" in text}
    for fact in FACTS:
        section, key = fact.split(".")
        start = text.find(f"\n{section}:\n")
        if start < 0:
            continue
        end = SECTION_START.search(text, start + len(section) + 3)
        body = text[start : end.start() if end else len(text)]
        at = body.find(f"\n  {key}: ")
        if at >= 0:
            config[section][key] = _scalar(body[at + len(key) + 5 :].split("\n", 1)[0])
    _CONFIG_CACHE[path] = (mtime, config)
    return config


def _scalar(raw: str):
    if raw.isdigit():
        return int(raw)
    if raw.replace("/", "").replace("-", "").replace("_", "").replace(".", "").isalnum() and raw not in (
        "true",
        "false",
        "null",
        "yes",
        "no",
        "on",
        "off",
    ):
        return raw  # a plain word or path: what YAML would read too
    try:
        value = yaml.load(raw, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError:
        return raw
    return value if isinstance(value, (str, int, float, bool)) else raw


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


def summarize(root: Path, run_dir: Path, locks: str | None = None) -> RunView:
    """The runs-list row of `run_dir`: what it is, how far it got, how it ended (`locks`: the lock table,
    when the caller read it for several runs)."""
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
    _set_status(view, root, run_dir, record, log, lock_table() if locks is None else locks)
    ends = MetricsEnds(run_dir / "metrics.jsonl")
    trained = ends.last(lambda r: "loss" in r, 20 if view.status == "running" else 1)
    view.step = trained[-1]["step"] if trained else 0
    times = [r["step_time_s"] for r in trained if isinstance(r.get("step_time_s"), (int, float))]
    if view.status == "running" and times:
        view.eta_s = max(view.max_steps - view.step, 0) * sum(times) / len(times)
    if view.status == "finished":
        view.result = result_line(run_dir, ends, view.max_steps)
    return view


def _set_status(view: RunView, root: Path, run_dir: Path, record: dict, log: str, locks: str) -> None:
    exit_code = read_exit(root, run_dir.name)
    if lock_holder(run_dir, locks) is not None:
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


def result_line(run_dir: Path, ends: MetricsEnds, max_steps: int) -> str:
    """The run's closing result line, by the function the recipes print it with."""

    def evaluation(record: dict) -> bool:
        return "loss" not in record and any(k in record for k in EVAL_KEYS)

    before = next((r for r in ends.first(evaluation, 1) if r["step"] == 0), {})
    after = next((r for r in ends.last(evaluation, 1) if r["step"] >= max_steps), {})
    shown = {"before": before, "after": after} if after else {}
    return closing_lines(shown, run_dir / "final", None)[0].removeprefix("result: ")


class MetricsEnds:
    """The opening and closing lines of a metrics.jsonl (at most TAIL_BYTES of each), parsed only as far as
    a question needs: a list of runs asks a few lines of each."""

    def __init__(self, path: Path):
        try:
            with path.open("rb") as handle:
                size = path.stat().st_size
                head = handle.read(min(size, TAIL_BYTES))
                handle.seek(max(size - TAIL_BYTES, 0))
                tail = handle.read()
        except OSError:
            head = tail = b""
            size = 0
        self._head = (head.rsplit(b"\n", 1)[0] if size > TAIL_BYTES else head).split(b"\n")
        self._tail = (tail.split(b"\n", 1)[-1] if size > TAIL_BYTES else tail).split(b"\n")

    def first(self, wanted, count: int) -> list[dict]:
        return _matching(self._head, wanted, count)

    def last(self, wanted, count: int) -> list[dict]:
        return _matching(reversed(self._tail), wanted, count)[::-1]


def _matching(lines, wanted, count: int) -> list[dict]:
    found = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # blank, or a line being written
        if isinstance(record, dict) and isinstance(record.get("step"), int) and wanted(record):
            found.append(record)
            if len(found) == count:
                break
    return found


def stop_run(root: Path, run_dir: Path, sig: int = signal.SIGINT) -> str:
    """Ask a running run to stop as Ctrl-C would: `sig` to its whole process group. Returns what was done."""
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
