"""GRPO's completions from a vLLM engine (toolkit/engine): the same round as HF generate's in layout, so
the rest of the rollout (rewards, advantages, the loss) does not know which sampled it.

The main process sends the whole round, in one fixed order with one seed per completion, and shares what
comes back with the others: the completions do not depend on the number of training processes. Before each
round the LoRA adapter (gathered to the main process on sharded backends) is written to the run folder and
hot-loaded under a new name; the base weights never move. A run that starts from a trained adapter
(model.adapter) has it folded into its base: that folded base is written once to the run folder and is the
model the engine serves, so the adapter trained on top of it is hot-loaded the same way. A full
fine-tune's weights are written as a checkpoint the engine reloads in place each round. With
grpo.vllm.sleep the engine sleeps once a round's completions are back and wakes for the next round's sync.
"""

from __future__ import annotations

import contextlib
import functools
import secrets
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

from toolkit.checkpoint.export import saver
from toolkit.checkpoint.gather import adapter_state, write_weights
from toolkit.checkpoint.rundir import ENGINE_DIR
from toolkit.distributed import from_main
from toolkit.engine import client
from toolkit.engine.replicas import Replicas
from toolkit.engine.server import BASE_NAME, Engine, has_gpu
from toolkit.errors import UserError
from toolkit.grpo.config import engine_restarts, n_per_prompt, sleep_level, steps_per_round
from toolkit.grpo.engine_start import start_or_connect
from toolkit.grpo.sampled import AHEAD, Sampled, ahead_round


class EngineLost(UserError):
    """The engine died or stopped answering mid-run and was not brought back (grpo.vllm.restarts): raised on
    every process at once, between optimizer steps, so the trainer's state is whole and can be saved."""


class EngineSampler:
    """The engine a run samples with (or its copies, grpo.vllm.replicas): held by the main process (None
    elsewhere), its adapter per round."""

    def __init__(self, accelerator, cfg, engine, folder: Path | None = None, sleep_level=0):
        self.accelerator, self.cfg = accelerator, cfg
        self.engines = engine if engine is None or isinstance(engine, Replicas) else Replicas([engine])
        """The engines (a Replicas), or None on every process but the main one."""
        self.n = cfg.grpo.num_generations if n_per_prompt(cfg) else 1
        """Completions one request asks for (vLLM's n): a group's, or one."""
        self.sleep_level = sleep_level
        """vLLM's sleep level between rounds (grpo.vllm.sleep; 0: the engine never sleeps)."""
        self.sleeping: set[str] = set()
        """What of the engine's GPU memory sleeps now ("weights", "kv_cache")."""
        self.wake_seconds = self.sleep_seconds = 0.0
        """The last round's wake-up (before its sync) and sleep (once its completions were back)."""
        self.folder = folder
        """Where the weights sent to the engine are written (the run folder's engine/)."""
        self.adapter = None
        """(name, folder) of the adapter the engine serves now."""
        self.weights = None
        """The folder of the full weights the engine serves now (full fine-tuning)."""
        self.gathered_mb = 0.0
        """Megabytes the last sync gathered onto the main process (the adapter, or the whole weights)."""
        self.ready = False
        self.version = 0
        """Rounds trained into the weights synced last."""
        self.ahead: tuple[int, int | None] | None = None
        """(round, completions) sent ahead and not yet taken (every process); completions None for a round
        an `ask` samples, shared whole."""
        self.future = None
        """The main process's thread's answer to the round sent ahead."""
        self.landed: Sampled | None = None
        """The round sent ahead, back and shared, or kept by the checkpoint resumed."""
        self.pool = None
        self.ahead_call = None
        """The main process's request of the round sent ahead, to send again to a restarted engine."""
        self.restarts = engine_restarts(cfg)
        """Restarts of a lost engine the run may make (grpo.vllm.restarts, all copies together)."""
        self.restarted = 0
        self.lost_replica = 0
        """The copy whose call failed last."""

    @classmethod
    @contextlib.contextmanager
    def started(cls, run, cfg):
        """Collective: the engine for the run (None with grpo.generation=hf). ftkit's own starts here, while
        the model loads, and is stopped however the run ends."""
        if cfg.grpo.generation != "vllm":
            yield None
            return
        accelerator, engine, problem = run.accelerator, None, None
        if accelerator.is_main_process:
            try:
                engine = start_or_connect(cfg, run.output_dir / ENGINE_DIR)
            except UserError as exc:
                problem = exc
        from_main(accelerator, problem=problem)  # its refusal raised on every process
        level = sleep_level(cfg, has_gpu())
        sampler = cls(accelerator, cfg, engine, run.output_dir / ENGINE_DIR, level)
        try:
            yield sampler
        finally:
            sampler.close()

    def sample(
        self, model, round_index: int, requests, stop_ids: list[int], ask=None
    ) -> tuple[Sampled, float]:
        """Collective: round `round_index`'s completions, the same on every process, and the seconds the
        weight sync took. `requests(r)`: round r's (prompt ids, seeds) in their fixed order. With
        grpo.async_rounds the round was sent ahead while the one before trained, and the next one is sent
        now with the weights synced here: the sync waits for the round in flight, so it never changes the
        weights mid-round, and every round but the first is sampled one round stale, on every layout.
        `ask(sampler, r, prompts, seeds, version)`, when given, is what the main process runs for round r in
        place of single-turn completions (multi-turn's conversations): its result is shared whole."""
        sampled = self._landed(round_index)
        sync_seconds = self.sync(model, round_index)
        if sampled is None:  # the first round, or the first after a resume that kept none ahead
            prompts, seeds = requests(round_index)
            asked = functools.partial(self.then_rest, self._asked(round_index, prompts, seeds, stop_ids, ask))
            sampled = self._shared_round(round_index, None if ask else len(prompts), asked)
        if (
            self.cfg.grpo.async_rounds
            and (round_index + 1) * steps_per_round(self.cfg) < self.cfg.train.max_steps
        ):
            self._send_ahead(
                round_index + 1, *requests(round_index + 1), stop_ids, ask
            )  # a round that will train
        return sampled, sync_seconds

    def _asked(self, round_index: int, prompts, seeds, stop_ids, ask):
        """Main process: the call that samples the round from the weights synced last."""
        if ask is not None:
            return functools.partial(ask, self, round_index, prompts, seeds, self.version)
        return functools.partial(self._requested, round_index, prompts, seeds, stop_ids, *self._served())

    def then_rest(self, call):
        """Main process: `call()`'s result, the engine put to sleep once it is back (grpo.vllm.sleep)."""
        result = call()
        if self.sleep_level:
            started = time.perf_counter()
            self.engines.each(lambda engine: client.sleep(engine.url, self.sleep_level))
            self.sleeping = {"weights", "kv_cache"}
            self.sleep_seconds = time.perf_counter() - started
        return result

    def _wake(self, *tags: str) -> None:
        """Main process: the engine's sleeping memory back, all of it or only `tags`."""
        wanted = set(tags) or {"weights", "kv_cache"}
        if not wanted & self.sleeping:
            return
        started = time.perf_counter()
        self.engines.each(lambda engine: client.wake_up(engine.url, tags))
        self.sleeping -= wanted
        self.wake_seconds += time.perf_counter() - started

    def rest_seconds(self) -> tuple[float, float] | None:
        """(wake_s, sleep_s) of the last round (0 on every process but the main one); None when the engine
        does not sleep."""
        return (self.wake_seconds, self.sleep_seconds) if self.sleep_level else None

    def _served(self) -> tuple[str, int]:
        """(the name the engine serves the synced weights under, rounds trained into them)."""
        return (self.adapter[0] if self.adapter else BASE_NAME), self.version

    def _requested(self, round_index, prompts, seeds, stop_ids, name: str, version: int) -> Sampled:
        """Main process (the calling thread or the one sending ahead: HTTP calls only, no collective): the
        round's completions from the engine."""
        started = time.time()
        self.engines.check_alive()
        n = self.n  # a group's completions are seeded seed, seed + 1, ... (rollout.engine_request)
        done = self.engines.complete(name, prompts[::n], seeds[::n], self.cfg.grpo, stop_ids, n=n)
        sampled = Sampled.empty(round_index, len(prompts), self.cfg.grpo.max_new_tokens, version)
        for i, completion in enumerate(done):
            sampled.lengths[i] = len(completion.tokens)
            sampled.tokens[i, : sampled.lengths[i]] = torch.tensor(completion.tokens)
            sampled.logps[i, : sampled.lengths[i]] = torch.tensor(completion.logps, dtype=torch.float64)
        sampled.times = torch.tensor([started, time.time()], dtype=torch.float64)
        return sampled

    def _shared_round(self, round_index: int, count: int | None, call, again=None) -> Sampled:
        """Collective: what `call()` returns on the main process (`again()` once the engine was restarted),
        on every process (whole when `count` is None); its UserError raised on every process."""
        sampled, problem = self._on_main(call, again)
        if count is None:  # pickled between the run's own processes
            return from_main(self.accelerator, sampled, problem)
        from_main(self.accelerator, problem=problem)
        if sampled is None:
            sampled = Sampled.empty(round_index, count, self.cfg.grpo.max_new_tokens, 0)
        about = self._shared(torch.tensor([sampled.version, *sampled.times.tolist()], dtype=torch.float64))
        sampled.tokens, sampled.lengths, sampled.logps = (
            self._shared(t) for t in (sampled.tokens, sampled.lengths, sampled.logps)
        )
        sampled.version, sampled.times = int(about[0]), about[1:]
        return sampled

    def _send_ahead(self, round_index: int, prompts, seeds, stop_ids, ask=None) -> None:
        """Round `round_index` sent to the engine from a thread of the main process while this one trains."""
        self.ahead = (round_index, None if ask else len(prompts))
        if self.engines is None:
            return
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-round")
        self.ahead_call = self._asked(round_index, prompts, seeds, stop_ids, ask)
        self.future = self.pool.submit(self.ahead_call)

    def _wait_ahead(self) -> None:
        """Collective: the round sent ahead, once back, shared as `landed`."""
        if self.ahead is None:
            return
        (round_index, count), future = self.ahead, self.future
        self.ahead = self.future = None
        waited = future.result if future is not None else None
        self.landed = self._shared_round(round_index, count, waited, self.ahead_call)

    def _landed(self, round_index: int) -> Sampled | None:
        """Collective: round `round_index` when it was sent ahead (or kept by the checkpoint resumed)."""
        self._wait_ahead()
        landed, self.landed = self.landed, None
        return landed if landed is not None and landed.round_index == round_index else None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the round sent ahead, waited for, for a checkpoint: resumed, the run trains on the
        very completions it would have (its weights of a round ago are not kept)."""
        self._wait_ahead()
        return self.landed.state_dict() if self.landed is not None else {}

    def restore(self, state: dict[str, torch.Tensor]) -> None:
        """The round a checkpoint kept ahead, if it kept one."""
        if AHEAD + "about" in state:
            self.landed = ahead_round(state)

    def close(self) -> None:
        """The thread sending ahead finished: an engine ftkit started is stopped first, failing its calls."""
        if self.engines is not None:
            self.engines.stop()
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def complete(self, prompts, seeds, max_tokens: list[int], stop_ids: list[int], stop: list[str]):
        """Main process: one `client.Completion` per prompt from the weights served now, each row with its
        own seed and token budget, ended by `stop_ids` or the first of the `stop` strings (kept)."""
        name = self.adapter[0] if self.adapter else BASE_NAME
        return self.engines.complete(
            name, prompts, seeds, self.cfg.grpo, stop_ids, max_tokens=max_tokens, stop=stop
        )

    def sync(self, model, round_index: int) -> float:
        """Collective: the trained weights as they are now, gathered on the main process and sent: a LoRA
        adapter loaded under a new name, or (full fine-tuning) the whole weights reloaded. Returns the
        seconds it took (the first round's wait for the engine to start and its wake-up not counted)."""
        _, problem = self._on_main(self._wait_ready)
        started, self.wake_seconds = time.perf_counter(), 0.0
        state = folder = None
        if self.cfg.model.method == "full":  # written a block at a time as it is gathered
            folder = self.folder / f"weights-round-{round_index}"
            writes = self.engines is not None and problem is None
            gathered = write_weights(self.accelerator, model, folder if writes else None)
        else:
            state, gathered = adapter_state(self.accelerator, model)
        self.gathered_mb = gathered / 2**20
        if problem is None and self.cfg.model.method == "full":
            _, problem = self._on_main(functools.partial(self._reload, folder))
        elif problem is None:
            _, problem = self._on_main(
                functools.partial(self._load, saver(self.accelerator, model), state, round_index)
            )
        from_main(self.accelerator, problem=problem)  # EngineLost on every process when it is one
        self.version = round_index
        return time.perf_counter() - started - self.wake_seconds

    def _on_main(self, call, again=None):
        """Main process: (`call()`'s result, None), or (None, the error every process will raise). An engine
        lost mid-run is restarted while grpo.vllm.restarts allows, and `again()` (else `call()`) sent to the
        new one; past that, the error is EngineLost."""
        if self.engines is None:
            return None, None
        while True:
            try:
                return call(), None
            except UserError as exc:
                self.lost_replica = getattr(exc, "replica", self.lost_replica)  # _wait_ready names its own
                cause = getattr(exc, "cause", exc)
                why = self._lost_engine().lost(cause) if self.ready else ""
                if not why:
                    return None, UserError(self._mid_run(cause))
            try:
                self._restart(why)
            except EngineLost as exc:
                return None, exc
            call = again or call

    def _restart(self, why: str) -> None:
        """Main process: the engine ftkit started, lost (`why`), started again with the weights it served, or
        EngineLost when grpo.vllm.restarts are spent or the new engine fails too."""
        replica, engines = self.lost_replica, self.engines.engines
        lost = f"grpo.vllm: the engine{self.engines.label(replica)} {why}"
        if engines[replica].relaunch is None or self.restarted >= self.restarts:
            spent = f" (grpo.vllm.restarts {self.restarts} spent)" if self.restarts else ""
            raise EngineLost(lost + spent)
        self.restarted += 1
        try:
            engine = engines[replica] = engines[replica].restarted()
            seconds = engine.wait_ready(self.cfg.grpo.vllm.start_timeout_s, say=tqdm.write)
            self.sleeping = set()
            if self.adapter is not None:
                client.load_adapter(engine.url, self.adapter[0], str(self.adapter[1].resolve()))
            if self.weights is not None:
                client.reload_weights(engine.url, str(self.weights.resolve()))
        except UserError as exc:
            raise EngineLost(f"{lost}; restarting it failed: {exc}") from exc
        tqdm.write(
            f"{lost}; ftkit restarted it ({self.restarted} of grpo.vllm.restarts {self.restarts}) in "
            f"{seconds:.1f} s with the weights it served, and the round goes on"
        )

    def _load(self, policy, state: dict, round_index: int) -> None:
        name = f"round-{round_index}-{secrets.token_hex(3)}"  # a reused name would keep the old weights
        folder = self.folder / f"adapter-{name}"
        policy.save_pretrained(str(folder), state_dict=state)
        self._wake()
        try:
            self.engines.each(lambda engine: client.load_adapter(engine.url, name, str(folder.resolve())))
        except UserError:
            shutil.rmtree(folder, ignore_errors=True)  # sent again under another name, if at all
            raise
        if self.adapter is not None:
            old = self.adapter[0]
            self.engines.each(lambda engine: client.unload_adapter(engine.url, old))
            shutil.rmtree(self.adapter[1], ignore_errors=True)
        self.adapter = (name, folder)

    def _reload(self, folder: Path) -> None:
        """The whole weights, written to `folder`, read by the engine in place of its own (the folder before
        deleted)."""
        self._wake("weights")  # after a level-2 sleep the KV cache comes back once the weights are in
        self.engines.each(lambda engine: client.reload_weights(engine.url, str(folder.resolve())))
        self._wake("kv_cache")
        if self.weights is not None:
            shutil.rmtree(self.weights, ignore_errors=True)
        self.weights = folder

    def _wait_ready(self) -> None:
        if self.ready:
            return
        for replica, engine in enumerate(self.engines.engines):  # they started together
            self.lost_replica = replica
            seconds = engine.wait_ready(self.cfg.grpo.vllm.start_timeout_s, say=tqdm.write)
            # Only the main process holds the engine; tqdm.write keeps the line off the progress bar's.
            if engine.process is None:
                tqdm.write(f"engine: vLLM at {engine.url} (yours)")
            else:
                at = f"{engine.url}{self.engines.label(replica)}"
                tqdm.write(f"engine: vLLM started by ftkit at {at} in {seconds:.1f} s; log: {engine.log}")
        self.ready = True

    def _mid_run(self, exc: UserError) -> str:
        """The error to raise: an engine ftkit started that has died says so (and why, from its log)."""
        engine = self._lost_engine()
        process, copy = engine.process, self.engines.label(self.lost_replica)
        if process is not None and process.poll() is not None and self.ready:
            return (
                f"grpo.vllm: the engine{copy} exited mid-run (code {process.returncode}): {engine.reason()}"
            )
        return engine.failure(str(exc))

    def _lost_engine(self) -> Engine:
        return self.engines.engines[self.lost_replica]

    def _shared(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.accelerator.num_processes == 1:
            return tensor
        values = tensor.to(self.accelerator.device)
        torch.distributed.broadcast(values, src=0)
        return values.cpu()


def logprob_gap(
    engine: torch.Tensor, trainer: torch.Tensor, lengths: torch.Tensor, sampled: torch.Tensor | None = None
) -> tuple[float, float]:
    """(mean, max) over every sampled token of |engine log-prob - trainer log-prob|; `sampled`: 1 on the
    tokens the engine sampled (a conversation's environment tokens have no engine log-prob)."""
    mask = torch.arange(engine.size(1))[None, :] < lengths[:, None]
    if sampled is not None:
        mask = mask & sampled[:, : engine.size(1)].bool()
    gaps = (engine - trainer[:, : engine.size(1)].to(engine.dtype)).abs()[mask]
    if gaps.numel() == 0:
        return 0.0, 0.0
    return float(gaps.mean()), float(gaps.max())
