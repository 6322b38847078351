"""GRPO's completions from a vLLM engine (toolkit/engine): the same round as HF generate's in layout, so
the rest of the rollout (rewards, advantages, the loss) does not know which sampled it.

The main process sends the whole round, in one fixed order with one seed per completion, and shares what
comes back with the others: the completions do not depend on the number of training processes. Before each
round the LoRA adapter (gathered to the main process on sharded backends) is written to the run folder and
hot-loaded under a new name; the base weights never move. A run that starts from a trained adapter
(model.adapter) has it folded into its base: that folded base is written once to the run folder and is the
model the engine serves, so the adapter trained on top of it is hot-loaded the same way. A full
fine-tune's weights are written as a checkpoint the engine reloads in place each round.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import time
from pathlib import Path

import torch
from tqdm import tqdm

from toolkit.checkpoint.export import full_state_dict, saver, write_folded_base
from toolkit.checkpoint.rundir import ENGINE_DIR
from toolkit.distributed import agreed_error, unwrap
from toolkit.engine import client
from toolkit.engine.server import Engine, ServeSpec
from toolkit.errors import UserError

FOLDED_BASE = "base"
"""Under the run's engine/: model.path with model.adapter folded in, the base ftkit's engine serves."""


class EngineSampler:
    """The engine a run samples with: held by the main process (None elsewhere), its adapter per round."""

    def __init__(self, accelerator, cfg, engine: Engine | None, folder: Path | None = None):
        self.accelerator, self.cfg, self.engine = accelerator, cfg, engine
        self.folder = folder
        """Where the weights sent to the engine are written (the run folder's engine/)."""
        self.adapter = None
        """(name, folder) of the adapter the engine serves now."""
        self.weights = None
        """The folder of the full weights the engine serves now (full fine-tuning)."""
        self.ready = False

    @classmethod
    @contextlib.contextmanager
    def started(cls, run, cfg):
        """Collective: the engine for the run (None with grpo.generation=hf). ftkit's own starts here, while
        the model loads, and is stopped however the run ends."""
        if cfg.grpo.generation != "vllm":
            yield None
            return
        accelerator, engine, error = run.accelerator, None, ""
        if accelerator.is_main_process:
            try:
                engine = _start_or_connect(cfg, run.output_dir / ENGINE_DIR)
            except UserError as exc:
                error = str(exc)
        error = agreed_error(accelerator, error)
        if error:
            raise UserError(error)
        sampler = cls(accelerator, cfg, engine, run.output_dir / ENGINE_DIR)
        try:
            yield sampler
        finally:
            if engine is not None:
                engine.stop()

    def sample(
        self, model, prompts: list[list[int]], seeds: list[int], stop_ids: list[int], round_index: int
    ):
        """Collective: (completions [N, max_new_tokens] padded with 0, lengths [N], the engine's log-probs
        [N, max_new_tokens] float64, seconds the weight sync took), the same on every process."""
        sync_seconds = self.sync(model, round_index)
        width = self.cfg.grpo.max_new_tokens
        tokens = torch.zeros(len(prompts), width, dtype=torch.long)
        logps = torch.zeros(len(prompts), width, dtype=torch.float64)
        lengths = torch.zeros(len(prompts), dtype=torch.long)
        error = ""
        if self.engine is not None:
            try:
                self.engine.check_alive()
                name = self.adapter[0] if self.adapter else "base"
                done = client.complete(self.engine.url, name, prompts, seeds, self.cfg.grpo, stop_ids)
            except UserError as exc:
                error = self._mid_run(exc)
            else:
                for i, completion in enumerate(done):
                    lengths[i] = len(completion.tokens)
                    tokens[i, : lengths[i]] = torch.tensor(completion.tokens)
                    logps[i, : lengths[i]] = torch.tensor(completion.logps, dtype=torch.float64)
        error = agreed_error(self.accelerator, error)
        if error:
            raise UserError(error)
        return (*(self._shared(t) for t in (tokens, lengths, logps)), sync_seconds)

    def sync(self, model, round_index: int) -> float:
        """Collective: the trained weights as they are now, gathered on the main process and sent: a LoRA
        adapter loaded under a new name, or (full fine-tuning) the whole weights reloaded. Returns the
        seconds it took (the first round's wait for the engine to start not counted)."""
        error = self._guarded(self._wait_ready)
        started = time.perf_counter()
        state = full_state_dict(self.accelerator, model)
        if not error and self.cfg.model.method == "full":
            error = self._guarded(self._reload, unwrap(self.accelerator, model), state, round_index)
        elif not error:
            error = self._guarded(self._load, saver(self.accelerator, model), state, round_index)
        error = agreed_error(self.accelerator, error)
        if error:
            raise UserError(error)
        return time.perf_counter() - started

    def _guarded(self, call, *args) -> str:
        """`call(*args)` on the main process; its UserError as the text every process will raise."""
        if self.engine is None:
            return ""
        try:
            call(*args)
        except UserError as exc:
            return self._mid_run(exc)
        return ""

    def _load(self, policy, state: dict, round_index: int) -> None:
        name = f"round-{round_index}-{secrets.token_hex(3)}"  # a reused name would keep the old weights
        folder = self.folder / f"adapter-{name}"
        policy.save_pretrained(str(folder), state_dict=state)
        client.load_adapter(self.engine.url, name, str(folder.resolve()))
        if self.adapter is not None:
            client.unload_adapter(self.engine.url, self.adapter[0])
            shutil.rmtree(self.adapter[1], ignore_errors=True)
        self.adapter = (name, folder)

    def _reload(self, policy, state: dict, round_index: int) -> None:
        """The whole weights as a checkpoint folder the engine reads in place of its own (the folder before
        deleted)."""
        folder = self.folder / f"weights-round-{round_index}"
        write_weights(policy.config, state, folder)
        client.reload_weights(self.engine.url, str(folder.resolve()))
        if self.weights is not None:
            shutil.rmtree(self.weights, ignore_errors=True)
        self.weights = folder

    def _wait_ready(self) -> None:
        if self.ready:
            return
        seconds = self.engine.wait_ready(self.cfg.grpo.vllm.start_timeout_s)
        self.ready = True
        url, log = self.engine.url, self.engine.log
        # Only the main process holds the engine; tqdm.write keeps the line off the progress bar's.
        if self.engine.process is None:
            tqdm.write(f"engine: vLLM at {url} (yours)")
        else:
            tqdm.write(f"engine: vLLM started by ftkit at {url} in {seconds:.1f} s; log: {log}")

    def _mid_run(self, exc: UserError) -> str:
        """The error to raise: an engine ftkit started that has died says so (and why, from its log)."""
        process = self.engine.process
        if process is not None and process.poll() is not None and self.ready:
            return f"grpo.vllm: the engine exited mid-run (code {process.returncode}): {self.engine.reason()}"
        return self.engine.failure(str(exc))

    def _shared(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.accelerator.num_processes == 1:
            return tensor
        values = tensor.to(self.accelerator.device)
        torch.distributed.broadcast(values, src=0)
        return values.cpu()


def _start_or_connect(cfg, folder) -> Engine:
    settings = cfg.grpo.vllm
    if settings.url:
        return Engine.connect(settings.url)
    spec = ServeSpec(
        model=_served_base(cfg, folder),
        reloads_weights=cfg.model.method == "full",
        dtype=_engine_dtype(cfg),
        max_model_len=cfg.data.max_length + cfg.grpo.max_new_tokens,
        lora_rank=cfg.lora.r if cfg.model.method != "full" else 0,
        trust_remote_code=cfg.model.trust_remote_code,
        kv_cache_gb=settings.kv_cache_gb,
        gpu_memory_utilization=settings.gpu_memory_utilization,
    )
    return Engine.start(spec, folder / "vllm.log", settings.host, settings.port)


def _served_base(cfg, folder: Path) -> str:
    """The base the engine serves: model.path, or with a start adapter the folded base written under the
    run's engine/ folder (the trainer folds the same adapter into the same base)."""
    if not cfg.model.adapter:
        return cfg.model.path
    target = folder / FOLDED_BASE
    write_folded_base(cfg.model.path, cfg.model.adapter, target, cfg.model.dtype, cfg.model.trust_remote_code)
    return str(target.resolve())


def write_weights(config, state: dict, folder: Path) -> None:
    """`state` as a Hugging Face checkpoint: config.json and one safetensors file. A tied output head is
    written too (vLLM's in-place reload leaves a head it finds no weight for as it was)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(folder))
    tensors = {name: value.detach().cpu().clone().contiguous() for name, value in state.items()}
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _engine_dtype(cfg) -> str:
    """The dtype the trainer computes in, so the engine's log-probs are comparable with its own."""
    precision = {"bf16": "bfloat16", "fp16": "float16"}.get(cfg.train.mixed_precision)
    if precision:
        return precision
    return cfg.model.dtype if cfg.model.dtype in ("float32", "bfloat16", "float16") else "auto"


def logprob_gap(engine: torch.Tensor, trainer: torch.Tensor, lengths: torch.Tensor) -> tuple[float, float]:
    """(mean, max) over every sampled token of |engine log-prob - trainer log-prob|."""
    mask = torch.arange(engine.size(1))[None, :] < lengths[:, None]
    gaps = (engine - trainer[:, : engine.size(1)].to(engine.dtype)).abs()[mask]
    if gaps.numel() == 0:
        return 0.0, 0.0
    return float(gaps.mean()), float(gaps.max())
