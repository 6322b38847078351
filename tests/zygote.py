"""The warm process the launched tests start their runs from: `python tests/zygote.py` imports what a rank
imports (torch, transformers, peft, accelerate, DeepSpeed, datasets, the toolkit and the recipes' own
imports) once, then, for each request read from stdin (one JSON line: argv, cwd, env, the files for stdout
and stderr), forks a process that does what `python <argv>` would do from there on:

- `-m accelerate.commands.launch ...`: accelerate's own launcher runs in the forked process, unchanged
  (arguments, config file, the environment it computes, torchrun's elastic agent with its rendezvous
  store, its failure reports and exit codes); only the agent's `Popen(python -u script ...)` of each rank
  becomes a fork of the launcher (`warm_execute_child`), given the environment the agent computed;
- `script.py ...`: the script runs in the forked process itself;
- `-m toolkit.commands.cli ...` (`ftkit train`, `ftkit eval --gpus`, ...): the command line runs in the
  forked process, and the `python -m accelerate.commands.launch ...` it starts is a fork of it, as above.

A forked rank does what a fresh interpreter would: its own session, default signal handlers, stdio on the
descriptors it was given (`-u` honoured), every other descriptor closed, `os.environ` exactly the one
given, `sys.argv` and `sys.path[0]` as for `python script`, the script run as `__main__` by runpy, then
interpreter shutdown (threads joined, atexit handlers, stdio flushed) and the exit status Python gives.
Nothing here starts a thread or runs a torch op before forking: the intra-op and OpenMP pools start in
each rank, as they do after exec. Replies (one JSON line each, on stdout): `{"ready": pid}` once the
imports are done, then per request `{"pid": launcher pid}` and `{"status": exit code, or -signal}`.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import importlib
import inspect
import io
import json
import os
import runpy
import signal
import subprocess
import sys
import threading
import traceback

# Signals this process was started with ignored: an exec'd child keeps them ignored, so a forked one does.
IGNORED_AT_START = {
    sig
    for sig in signal.valid_signals()
    if sig not in (signal.SIGKILL, signal.SIGSTOP) and signal.getsignal(sig) == signal.SIG_IGN
}
REAL_EXECUTE = subprocess.Popen._execute_child
PIDS_LOG = ""  # the launcher writes its children's pids here, for the test's timeout to kill
# What a rank imports on the way to its first step (the recipes' imports are read from the recipes).
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.run",
    "torch.distributed.fsdp",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "peft",
    "accelerate",
    "accelerate.commands.launch",
    "datasets",
    "deepspeed",
    "toolkit.run",
    "toolkit.config",
    "toolkit.data",
    "toolkit.train.evaluate",
    "toolkit.train.loss",
]
MAX_FD = os.sysconf("SC_OPEN_MAX")
# The streams the libraries' loggers took at import: still flushed at exit (on a forked program's own fds).
IMPORTED_STDIO = (sys.stdout, sys.stderr)
IMPORT_ENV: dict[str, str] = {}
"""What the imports set in os.environ (DeepSpeed's PYTORCH_NVML_BASED_CUDA_CHECK, inductor's cache folder):
a forked program starts with it, as a fresh one has it once it has imported the same libraries."""


def preload() -> None:
    before = dict(os.environ)
    for name in PRELOAD:
        # One that fails to import is left to each program, which then fails as a fresh one would.
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    IMPORT_ENV.update({k: v for k, v in os.environ.items() if before.get(k) != v})
    # transformers' table of checkpoint renamings, every family's, built at a process's first model load
    # (about a second of regular expressions here) and only ever copied out of its cache after.
    with contextlib.suppress(Exception):
        importlib.import_module("transformers.conversion_mapping").get_checkpoint_conversion_mapping("llama")
    # `python -m` runs it as __main__: its imports stay loaded, the module itself is not.
    sys.modules.pop("accelerate.commands.launch", None)


def reset_signals() -> None:
    """The dispositions a fresh interpreter starts with: what the parent ignored stays ignored, Python's
    own (SIGINT raises KeyboardInterrupt, SIGPIPE and SIGXFSZ ignored), every other one the default."""
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, signal.SIG_IGN if sig in IGNORED_AT_START else signal.SIG_DFL)
    if signal.SIGINT not in IGNORED_AT_START:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


def fresh_stdio(unbuffered: bool) -> None:
    """sys.stdin/stdout/stderr over descriptors 0-2 as the interpreter makes them (`-u`: unbuffered)."""
    encoding = sys.stdout.encoding

    def stream(fd: int, errors: str, line_buffering: bool):
        raw = io.FileIO(fd, "w", closefd=False)
        buffer = raw if unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(
            buffer, encoding=encoding, errors=errors, line_buffering=line_buffering, write_through=unbuffered
        )

    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    sys.stdout = sys.__stdout__ = stream(1, "strict", False)
    sys.stderr = sys.__stderr__ = stream(2, "backslashreplace", True)


def exit_code(exc: SystemExit) -> int:
    """The status Python gives `raise SystemExit(code)`: None is 0, an int itself, anything else printed."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def own_frames(tb):
    """The traceback from the program's first frame on, as the interpreter prints it (no runpy, no zygote)."""
    while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>"):
        tb = tb.tb_next
    return tb


def run_as_main(run) -> None:
    """Call `run` as the interpreter runs a program, then end the process as the interpreter would."""
    code, interrupted = 0, False
    try:
        run()
    except SystemExit as exc:
        code = exit_code(exc)
    except KeyboardInterrupt as exc:
        traceback.print_exception(exc.with_traceback(own_frames(exc.__traceback__)))
        code, interrupted = 1, True
    except BaseException as exc:
        sys.excepthook(type(exc), exc, exc.with_traceback(own_frames(exc.__traceback__)).__traceback__)
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (*IMPORTED_STDIO, sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            code = code or 120
    if interrupted:  # Python ends an uncaught KeyboardInterrupt by dying of SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def become(argv: list[str], env: dict[str, str]) -> None:
    """From here on, this process is `python <argv>` with `env`; never returns."""
    unbuffered = argv[0] == "-u"
    argv = argv[1:] if unbuffered else argv
    reset_signals()
    os.environ.clear()
    os.environ.update(env)
    subprocess.Popen._execute_child = REAL_EXECUTE
    fresh_stdio(unbuffered)
    faulthandler.disable()  # the zygote's, if on (reset_signals replaced its handlers)
    if env.get("PYTHONFAULTHANDLER"):  # as a fresh interpreter does: its handlers, on the program's stderr
        faulthandler.enable(all_threads=True)
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        # Run as __main__ only, as `python -m` has it (the command line that started it may have imported it).
        sys.modules.pop(argv[1], None)
        # What the launcher starts as `python -u script` is a fork of it (whatever module named Popen).
        subprocess.Popen._execute_child = warm_execute_child
        run_as_main(lambda: runpy.run_module(argv[1], run_name="__main__", alter_sys=True))
    for key, value in IMPORT_ENV.items():
        os.environ.setdefault(key, value)
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    run_as_main(lambda: runpy.run_path(argv[0], run_name="__main__"))


def script_argv(args: list[str]) -> list[str] | None:
    """`[python, (-u), script.py, ...]` or `[python, (-u), -m, accelerate.commands.launch, ...]` (what `ftkit
    train` runs) as the argv `become` takes; None for any other command."""
    if not args or args[0] != sys.executable:
        return None
    rest = list(args[1:])
    head = ["-u"] if rest[:1] == ["-u"] else []
    rest = rest[len(head) :]
    if rest[:2] == ["-m", "accelerate.commands.launch"]:
        return [*head, *rest]
    if not rest or not rest[0].endswith(".py") or not os.path.isfile(rest[0]):
        return None
    return [*head, *rest]


def warm_execute_child(self, *args):
    """Popen's `python (-u) script.py ...` (or accelerate's launcher) as a fork of this (warm) process instead
    of an exec; any other
    command, and any with a preexec_fn, a shell, a umask or a user or group change, is exec'd as usual."""
    call = inspect.signature(REAL_EXECUTE).bind(self, *args).arguments
    argv = None if isinstance(call["args"], (str, bytes, os.PathLike)) else script_argv(call["args"])
    plain = not call["shell"] and call["preexec_fn"] is None and call["executable"] is None
    plain = plain and call["uid"] is None and call["gid"] is None and call["gids"] is None
    if argv is None or not plain or call["umask"] >= 0 or call["process_group"] not in (None, -1):
        return REAL_EXECUTE(self, *args)
    pid = os.fork()
    if pid == 0:
        try:
            child(call, argv)
        except BaseException:
            traceback.print_exc()
        os._exit(255)
    self.pid = pid
    self._child_created = True
    self._close_pipe_fds(
        *(call[k] for k in ("p2cread", "p2cwrite", "c2pread", "c2pwrite", "errread", "errwrite"))
    )
    if PIDS_LOG:
        with open(PIDS_LOG, "a") as f:
            f.write(f"{pid}\n")


def child(call: dict, argv: list[str]) -> None:
    """What an exec'd child gets from Popen: its session, its stdio, no other descriptor, its cwd and env."""
    if call["start_new_session"]:
        os.setsid()
    for fd, target in ((call["p2cread"], 0), (call["c2pwrite"], 1), (call["errwrite"], 2)):
        if fd != -1 and fd != target:
            os.dup2(fd, target)
    if call["close_fds"]:
        low = 3
        for fd in [*sorted(int(fd) for fd in call["pass_fds"]), MAX_FD]:
            os.closerange(low, fd)
            low = fd + 1
    if call["cwd"] is not None:
        os.chdir(call["cwd"])
    env = call["env"] if call["env"] is not None else dict(os.environ)
    become(argv, {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()})


def launch(request: dict) -> None:
    """The forked process of one request: its own session and stdio, then `python <argv>`."""
    global PIDS_LOG
    PIDS_LOG = request["pids"]
    os.setsid()
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 1)
    os.dup2(os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
    os.closerange(3, MAX_FD)
    os.chdir(request["cwd"])
    become(request["argv"], request["env"])


def serve() -> None:
    requests = os.fdopen(os.dup(0), "r")
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)  # what the imports print never reaches the replies
    preload()
    replies.write(json.dumps({"ready": os.getpid()}) + "\n")
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            try:
                launch(request)
            except BaseException:
                traceback.print_exc()
            os._exit(255)
        replies.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n")


if __name__ == "__main__":
    serve()
