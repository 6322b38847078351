"""A run's compiled code, kept with the run: the next start (a resume after preemption, a relaunch on
another machine, a second run given the same `model.compile_cache`) loads it and skips the compiler's
lowering and, on a GPU, its Triton kernel builds.

What is kept is torch's portable compile cache (`torch.compiler.save_cache_artifacts`): the compiled
graphs, their autograd split and, on CUDA, the Triton kernels built for them. It is written after the
first step of each start (when the training graphs exist) and again at a checkpoint if more were compiled
since, by the main process, one file per machine kind (torch, Triton, device) so a mixed cluster keeps
one for each.

Compiled code is code, and torch stores it pickled: a cache is loaded only when it carries a signature
made with this user's key (`$XDG_CACHE_HOME/ftkit/signing.key`, created on first use, readable by its
owner alone). A cache copied from someone else's run, or damaged, fails the check: the run says so in one
line and compiles afresh. A user whose machines do not share a home directory gets warm starts on the
machine that wrote the key only; the others compile cold, as without the cache.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import platform
import secrets
from dataclasses import dataclass
from pathlib import Path

import torch

from toolkit import console
from toolkit.checkpoint.rundir import COMPILE_CACHE
from toolkit.errors import UserError

KEY_BYTES = 32


@dataclass
class CompileCache:
    """The cache folder of one run (None: off) and what this start did with it."""

    folder: Path | None
    key: bytes | None = None
    note: str = ""
    """One line for the console: what was loaded, or why nothing was."""
    saved_graphs: int = 0
    first_step_done: bool = False

    @property
    def data_path(self) -> Path:
        return self.folder / f"{machine_kind()[0]}.bin"

    @property
    def manifest_path(self) -> Path:
        return self.data_path.with_suffix(".json")

    def after_step(self, is_main: bool) -> dict:
        """After each optimizer step: on this start's first, the cache saved (main process) and the
        compile-cache counters of that step returned for the metrics log; {} after later steps."""
        if self.folder is None or self.first_step_done:
            return {}
        self.first_step_done = True
        if is_main:
            self.save()
        return cache_counters()

    def save(self) -> None:
        """Write the compiled code made or loaded by this process, if it holds more graphs than the file
        last written; atomically, never over a file ftkit did not write."""
        if self.folder is None:
            return
        serialized = torch.compiler.save_cache_artifacts()
        if serialized is None:
            return
        data, info = serialized
        graphs = sum(len(keys) for keys in info.artifacts.values())
        if graphs <= self.saved_graphs:
            return
        if self.data_path.exists() and not _ours(self.manifest_path):
            self.note = f"compile cache: {self.data_path} was not written by ftkit; left as it is"
            return
        self.key = self.key or user_key(create=True)
        if self.key is None:
            return
        manifest = {"written_by": "ftkit", "machine": machine_kind()[1], "graphs": graphs}
        manifest["signature"] = hmac.new(self.key, data, hashlib.sha256).hexdigest()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            _write_atomically(self.data_path, data)
            _write_atomically(self.manifest_path, json.dumps(manifest, indent=1).encode())
        except OSError as error:  # a full or read-only disk costs the next start its warm cache, not this run
            console.say_once(f"compile cache: not kept in {self.folder} ({error.strerror or error})")
            return
        self.saved_graphs = graphs


def open_cache(setting: str, output_dir: Path, compiling: bool) -> CompileCache:
    """The run's cache (`model.compile_cache`: "" for the run's own folder, a path shared by runs, or
    "off"), its file for this machine kind loaded where one exists and is signed by this user's key."""
    if not compiling or setting == "off":
        return CompileCache(None)
    cache = CompileCache(Path(setting) if setting else output_dir / COMPILE_CACHE)
    if cache.folder.exists() and not cache.folder.is_dir():
        raise UserError(f"model.compile_cache: {cache.folder} is a file, not a folder")
    if not cache.data_path.is_file():
        cache.note = f"compile cache: none yet for this machine; kept in {cache.folder} after the first step"
        return cache
    cache.key = user_key(create=False)
    data = cache.data_path.read_bytes()
    manifest = _manifest(cache.manifest_path)
    signature = hmac.new(cache.key or b"", data, hashlib.sha256).hexdigest()
    if cache.key is None or not hmac.compare_digest(signature, str(manifest.get("signature", ""))):
        cache.note = (
            f"compile cache: {cache.data_path} is not signed with this user's key (copied from another "
            "user's run, or damaged): not loaded, compiling afresh"
        )
        return cache
    info = torch.compiler.load_cache_artifacts(data)
    graphs = sum(len(keys) for keys in info.artifacts.values()) if info else 0
    cache.saved_graphs = graphs
    cache.note = f"compile cache: {graphs} compiled artifacts loaded from {cache.data_path}"
    return cache


def machine_kind() -> tuple[str, dict]:
    """(a short digest naming this kind of machine, what it was made of): compiled code is kept per
    torch and Triton version and device."""
    kind = {"torch": torch.__version__, "python": platform.python_version(), "arch": platform.machine()}
    if torch.cuda.is_available():
        kind["device"] = torch.cuda.get_device_name()
        kind["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        try:
            import triton

            kind["triton"] = triton.__version__
        except ImportError:
            pass
    else:
        kind["device"] = f"cpu {torch.backends.cpu.get_cpu_capability()}"
    digest = hashlib.sha256(json.dumps(kind, sort_keys=True).encode()).hexdigest()[:16]
    return digest, kind


def user_key(create: bool) -> bytes | None:
    """This user's signing key (made, readable by its owner alone, when `create`); None where there is
    none, or where others could read or replace it."""
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ftkit"
    path = home / "signing.key"
    if create and not path.exists():
        home.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process made it first
            pass
        else:
            with os.fdopen(handle, "wb") as out:
                out.write(secrets.token_bytes(KEY_BYTES))
    try:
        status = path.stat()
    except OSError:
        return None
    if status.st_uid != os.getuid() or status.st_mode & 0o077:
        return None
    key = path.read_bytes()
    return key if len(key) == KEY_BYTES else None


def cache_counters() -> dict:
    """Compiled graphs this process found in the compile cache and made anew, so far (dynamo's counters)."""
    from torch._dynamo.utils import counters

    inductor, aot = counters["inductor"], counters["aot_autograd"]
    return {
        "compile_cache_hits": inductor["fxgraph_cache_hit"] + aot["autograd_cache_hit"],
        "compile_cache_misses": inductor["fxgraph_cache_miss"] + aot["autograd_cache_miss"],
    }


def _manifest(path: Path) -> dict:
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def _ours(manifest: Path) -> bool:
    return _manifest(manifest).get("written_by") == "ftkit"


def _write_atomically(path: Path, data: bytes) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    os.replace(partial, path)
