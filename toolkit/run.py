"""A training run as every recipe starts, steps, saves and ends it. The recipe holds the Run and keeps
what is its own: data, model, loss, `accelerator.prepare` and the loop; the Run owns set-up (stop handler,
launch checks, Accelerator, seed, run lock, resume, output dir, trackers, metrics log, watchdog) and the
loop's exits (checkpoint cadence, stop requests, failures, the finish)."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import torch
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from toolkit import checkpoint, data, distributed
from toolkit.checkpoint import compile_cache, rundir
from toolkit.checkpoint.resume import Resume
from toolkit.config import check_start_folders
from toolkit.entry import lost_line
from toolkit.errors import UserError
from toolkit.launch import backend, checks, machine
from toolkit.launch.deepspeed import fill_width_settings
from toolkit.launch.preemption import PREEMPTED_EXIT_CODE, StopRequest
from toolkit.model import expert_parallel, flops, moe, per_example, quant, speed, tensor_parallel, vision
from toolkit.model import load as models
from toolkit.model.facts import read_model_facts
from toolkit.model.families import family_of
from toolkit.pipeline import runtime as pipeline_runtime
from toolkit.train import batches, metrics, optim, sequence_parallel
from toolkit.train.nonfinite import NonFiniteGuard
from toolkit.train.offload import activation_offload
from toolkit.train.router import RouterBalance, experts_line, router_coef
from toolkit.train.steps import apply_update, closing_lines, every, export_final, first_image
from toolkit.train.watchdog import Watchdog
from toolkit.typed_yaml import Sources, flat_dict


class Run:
    """One launched run, on every rank: `with Run.start(...) as run:` (leaving it ends the watchdog)."""

    def __init__(self, cfg, stop: StopRequest, launch, accelerator, grad_accum: int, features, prog: str):
        self.cfg, self.stop, self.launch, self.prog = cfg, stop, launch, prog
        self.accelerator, self.grad_accum, self.features = accelerator, grad_accum, features
        self.output_dir = Path(cfg.output_dir)
        self.tokens_seen = 0
        self.guard = NonFiniteGuard(
            cfg.train.nonfinite, cfg.train.nonfinite_patience, can_skip=launch.backend != "deepspeed"
        )
        self._stopping = False
        self.pipe = None
        self.recipe_state = None
        """A callable the recipe sets: tensors of its own a checkpoint keeps (None when there are none)."""
        self.processor = None
        """A vision-language model's processor (images to pixels), once the data is read; else None."""
        self.images = None
        """A vision-language model's image handling (data.ImageInputs), once the data is read; else None."""
        self.compiled = compile_cache.CompileCache(None)
        """The compiled code kept with the run (checkpoint/compile_cache.py), once the model is loaded."""

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc) -> None:
        """However the run ends (returned, stopped, raised), nothing is watched any more."""
        self.watchdog.close()

    @classmethod
    def start(cls, cfg, config_source: Sources, prog: str) -> Run:
        """Collective: the stop handler first (a stop while loading exits cleanly), then the checked launch,
        the Accelerator, the seed, output_dir claimed and prepared, resume found, trackers and metrics log."""
        stop = StopRequest()
        # What the run starts from is checked before output_dir is claimed, not when the model loads after it.
        check_start_folders(cfg)
        launch = backend.with_pipeline(backend.detect_launch(), cfg.pipeline.size, config_source)
        facts = read_model_facts(cfg.model)
        notes = checks.check_launch(launch, cfg, facts, config_source, machine.probe_machine(), os.environ)
        grad_accum = batches.grad_accum_steps(cfg.train, launch.mesh.data_parallel)
        accelerator = backend.setup(
            launch,
            cfg.train,
            grad_accum,
            log_with=cfg.log.trackers or None,
            project_dir=cfg.output_dir,
            step_scheduler_with_optimizer=False,  # one scheduler step per optimizer step, any world size
        )
        features = speed.resolve_for_run(cfg, launch, accelerator.device, facts.attention_kernels)
        summary = backend.setup_summary(accelerator, launch, cfg.train, grad_accum)
        for line in [summary, *notes, *features.notes]:
            accelerator.print(line)
        set_seed(cfg.seed)
        run = cls(cfg, stop, launch, accelerator, grad_accum, features, prog)
        run._lock = rundir.claim(accelerator, run.output_dir)  # held until the process ends
        run.resume = Resume.find(run.output_dir, cfg, say=accelerator.print)
        rundir.prepare_output_dir(accelerator, run.output_dir, cfg, fresh=run.resume.new_run)
        if cfg.log.trackers:
            accelerator.init_trackers(cfg.log.project, config=flat_dict(cfg))
        run.log = metrics.MetricsLog(
            run.output_dir / "metrics.jsonl",
            accelerator.is_main_process,
            accelerator.log if cfg.log.trackers else None,
        )
        timeout_s = cfg.train.stall_timeout_minutes * 60
        run.watchdog = Watchdog(
            run.output_dir, accelerator.process_index, accelerator.num_processes, timeout_s, prog
        ).start()
        return run

    def interruptible(self):
        """Around loading: a stop request ends the run at once (nothing to save yet), exit 75."""
        return self.stop.interruptible(f"step {self.resume.next_step}")

    def chat_data(self):
        """(tokenizer, train rows, eval rows or None) from the config's data section in the SFT layouts,
        encoded by the main process first (the others read its cache); the data summary printed."""
        accelerator = self.accelerator
        tokenizer = self.chat_tokenizer()
        data.ensure_chat_template(tokenizer)
        train_set, eval_set, stats = data.build_datasets(
            self.cfg.data, tokenizer, self.cfg.seed, accelerator.main_process_first, self.images
        )
        accelerator.print(stats.summary())
        return tokenizer, train_set, eval_set

    def chat_tokenizer(self):
        """The tokenizer data is encoded with: a vision-language model's processor's (then `images` and
        `processor` are set: the model's loading and the collators read them), else the model's own."""
        self.images = vision.image_inputs(self.cfg.model, self.cfg.vision.max_pixels)
        if self.images is None:
            return models.load_tokenizer(self.cfg.model)
        self.processor = self.images.processor
        return self.processor.tokenizer

    def eval_loader(self, eval_set, pad_id: int):
        """This process's share of the held-out rows for the eval loss (None without any); not for
        `prepare`, which would split them again."""
        if eval_set is None:
            return None
        rank, world = distributed.data_shard(self.accelerator)
        return data.eval_loader(
            eval_set, rank, world, self.cfg.train.micro_batch_size, pad_id, self.collate(pad_id)
        )

    def collate(self, pad_id: int):
        """The batch maker of a vision-language model's rows (pixels beside tokens); None for text, whose
        loaders choose their own."""
        return data.VisionCollator(pad_id, self.images) if self.images is not None else None

    def load_model(self, **head):
        """The model to train, on this rank's device, announced; every forward pass counts as progress.
        `head`: models.load_model's scalar_head (a reward model's), num_labels (a classifier's), bare (an
        embedding model's). Under a pipeline each process keeps only its stages, and the processes of a
        machine load in turn: its memory holds one whole model at a time, not one per process."""
        if self.launch.mesh.pp == 1:
            return self._loaded(**head)
        model = None
        for turn in range(self.launch.procs_per_node):
            if turn == self.accelerator.local_process_index:
                model = self._loaded()
                self._cut = pipeline_runtime.cut(model, self.cfg.pipeline, self.accelerator)
            self.accelerator.wait_for_everyone()
        return model

    def _loaded(self, **head):
        cfg = self.cfg
        cast = quant.cast_dtype(self.launch.backend, self.launch.fsdp_version, cfg.train.mixed_precision)
        model = models.load_model(
            cfg.model,
            cfg.lora,
            self.accelerator.local_process_index,
            self.features,
            quant_cast=cast,
            loss=cfg.loss,
            experts=cfg.moe,
            parts=cfg.vision,
            **head,
        )
        self.compiled = compile_cache.open_cache(
            cfg.model.compile_cache, self.output_dir, self.features.compile
        )
        if self.compiled.note:
            self.accelerator.print(self.compiled.note)
        if cfg.data.packing or cfg.data.streaming:
            for line in per_example.install(model, family_of(model.config), not self.launch.on_cpu):
                self.accelerator.print(line)
        if cfg.moe.expert_parallel > 1:
            expert_parallel.keep_out_of_ddp(model, cfg.moe.expert_parallel)
        if self.launch.mesh.tp > 1:
            tensor_parallel.parallelize(model, self.accelerator.torch_device_mesh["tp"], model.config)
        trainable, total = models.trainable_and_total(model)
        self.accelerator.print(
            f"model: {cfg.model.path} ({cfg.model.method}), {trainable:,} of {total:,} parameters trained"
        )
        if cfg.model.method != "full":
            self.accelerator.print(models.adapted_summary(model))
        if self.processor is not None:
            self.accelerator.print(vision.parts_line(model))
            if self.launch.backend == "deepspeed":
                text_width = model.config.get_text_config().hidden_size
                fill_width_settings(self.accelerator.state.deepspeed_plugin, text_width)
        self.router = self._router_balance(model)
        self.meter = metrics.StepSpeed(
            flops.ModelShape.of(model), self.accelerator.device, self.accelerator.num_processes
        )
        model.register_forward_pre_hook(self.watchdog.forward_hook)
        return model

    def _router_balance(self, model) -> RouterBalance:
        """A mixture of experts' router balance (inert for a dense model), announced with what is trained."""
        routing, coef = moe.routing(model.config), router_coef(self.cfg.moe, model.config)
        if routing.experts:
            self.accelerator.print(experts_line(model, routing, coef, self.cfg.moe, self.data_parallel))
        return RouterBalance(model, routing, coef, self.global_sum, self.data_parallel)

    def pipeline(self, model, pad_id: int, loss_fn, rows_per_example: int = 1, uniform: bool = True):
        """The Pipeline `model` runs under when the recipe asks for one (pipeline.size), `model` trimmed to
        this process's stages; else None. `loss_fn(logps, labels)`: a micro-batch's summed loss from the
        last stage's per-token log-probs; `rows_per_example`: rows a batch holds per example (2 for
        pairs); `uniform`: the loss weighs every token alike."""
        if self.launch.mesh.pp == 1:
            return None
        cfg = self.cfg
        self.pipe = pipeline_runtime.Pipeline(
            model,
            self._cut,
            cfg.pipeline,
            self.accelerator,
            self.grad_accum,
            cfg.train.micro_batch_size * rows_per_example,
            cfg.data.max_length,
            pad_id,
            loss_fn,
            uniform,
        )
        for module in self.pipe.modules:
            module.register_forward_pre_hook(self.watchdog.forward_hook)
        self.accelerator.print(self.pipe.describe())
        return self.pipe

    def optimizer(self, model):
        """(optimizer, scheduler) for `model`, with what a checkpoint restores before `prepare` held."""
        optimizer = optim.build_optimizer(
            model,
            self.cfg.train,
            self.data_parallel,
            self.features.fused_adamw,
            vision.tower_rate(model, self.cfg.vision),
        )
        scheduler = optim.build_scheduler(optimizer, self.cfg.train)
        self.resume.before_prepare(model, optimizer, scheduler, self.accelerator)
        return optimizer, scheduler

    def begin(self, model, evaluator) -> int:
        """Collective, after `prepare`: the checkpoint's state restored (returns its step), or a fresh
        run's starting point measured (returns 0). A stop asked for by then ends the run here."""
        start_step, self.tokens_seen = self.resume.after_prepare(self.accelerator, self.log, model)
        if self.resume.checkpoint is None and not self.stop.agreed(self.accelerator):
            self.watchdog.beat("the evaluation before step 1")
            evaluator.report(0, "before")
        if self.stop.agreed(self.accelerator):
            raise self.stop.stopped_before(f"step {start_step + 1}")
        return start_step

    def steps(self, loader, sampler, start_step: int, desc: str = "train"):
        """(step, micro-batches) for each optimizer step left, `grad_accum` micro-batches each.

        Under sequence parallelism each rank reads `grad_accum / sp` batches a step; its group shares them
        and each rank runs its slice of every one (toolkit/train/sequence_parallel.py)."""
        sp = self.launch.mesh.sp
        split = sequence_parallel.SequenceSplit(sp) if sp > 1 else None
        if split is not None:
            loader = sequence_parallel.unwrapped(loader)
        stream = batches.StepStream(
            loader, sampler, self.grad_accum // sp, start_step, self.accelerator.skip_first_batches
        )
        for step in self.step_numbers(start_step, desc):
            micro_batches = stream.next_step()
            if split is not None:
                micro_batches = split.step(micro_batches)
            self._data_wait = time.perf_counter() - self._started
            yield step, micro_batches

    def step_numbers(self, start_step: int, desc: str = "train"):
        """Each optimizer step left, for a recipe that makes its own batches (its time is step time)."""
        self._data_wait = 0.0
        self.schedule = checkpoint.SaveSchedule(
            self.cfg.train.save_every_steps, self.cfg.train.save_every_minutes, start_step
        )
        self.progress = tqdm(
            initial=start_step,
            total=self.cfg.train.max_steps,
            disable=not self.accelerator.is_main_process,
            desc=desc,
        )
        self.step_done = start_step  # the last optimizer step taken
        for step in range(start_step + 1, self.cfg.train.max_steps + 1):
            self.watchdog.beat(f"step {step}")
            self._started = time.perf_counter()
            yield step
            self.progress.update(1)
        self.progress.close()

    @property
    def data_parallel(self) -> int:
        """Processes that train on different batches (tensor-parallel ranks share theirs), over which the
        backend averages gradients and the global batch is split."""
        return self.launch.mesh.data_parallel

    @property
    def gradient_ranks(self) -> int:
        """Processes the backend divides the summed gradients by (`loss.backward_scale`): the data-parallel
        ones, but ZeRO-3's reduce-scatter divides by every process, a group's sequence-parallel ranks too."""
        if self.launch.mesh.sp > 1 and self.launch.zero_stage == 3:
            return self.launch.world_size
        return self.data_parallel

    @contextlib.contextmanager
    def micro_batch(self):
        """Around one micro-batch's forward and backward pass; yields the router: `router.loss(token_mask)`
        is the routers' balancing term to add to what `backward` is given (0 for a dense model). With
        `train.activation_offload` the tensors saved for backward wait in CPU memory."""
        offload = activation_offload(self.cfg.train.activation_offload, self.accelerator.device)
        with self.router.micro_batch() as router, offload:
            yield router

    def global_counts(self, counts: list[int]) -> list[int]:
        """Collective: this rank's per-step counts summed over every batch of the step."""
        return self.global_sum(torch.tensor(counts, device=self.accelerator.device)).tolist()

    def global_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Collective: `values` summed over every batch of the step (each counted once)."""
        return distributed.sum_over_data(self.accelerator, values)

    def update(self, model, optimizer, scheduler, step: int, loss: float) -> float:
        """The optimizer update (clipping, the non-finite guard); returns the gradient norm."""
        return apply_update(
            self.accelerator,
            model,
            optimizer,
            scheduler,
            self.guard,
            step,
            loss,
            self.cfg.train.max_grad_norm,
            self.pipe.clip_grad_norm if self.pipe else None,
        )

    def log_step(self, step: int, scheduler, tokens: int, rows: int, per_second=None, **values) -> None:
        """Count the step's tokens; on logging steps write `values` with the learning rate, speed and
        throughput (`per_second`: {"pairs": n} logs pairs_per_s) to metrics.jsonl and the progress bar."""
        self.tokens_seen += tokens
        if cached := self.compiled.after_step(self.accelerator.is_main_process):
            self.log.write(step, **cached)
        values = {**values, **self.router.step_metrics()}
        train = self.cfg.train
        if not every(step, train.log_every_steps, train.max_steps):
            return
        elapsed = time.perf_counter() - self._started
        measured = self.meter.measure(tokens, rows, elapsed, self._data_wait)
        rates = {f"{name}_per_s": count / elapsed for name, count in (per_second or {}).items()}
        lr = scheduler.get_last_lr()[0]
        if self.pipe is not None:
            values = {**values, "pipeline_idle_frac": self.pipe.idle_fraction}
        self.log.write(
            step,
            **values,
            lr=lr,
            **rates,
            tokens_seen=self.tokens_seen,
            skipped_steps=self.guard.skipped,
            **measured,
        )
        self.progress.set_postfix(metrics.progress_fields(values["loss"], lr, measured))

    def evaluating(self, step: int) -> bool:
        """True when an evaluation is due after `step` (and it becomes what the watchdog reports)."""
        if due := every(step, self.cfg.train.eval_every_steps):
            self.watchdog.beat(f"the evaluation at step {step}")
        return due

    def maybe_checkpoint(self, step: int, eval_result: dict) -> None:
        """Collective: checkpoint when due or when the run must stop (never weights a non-finite update
        reached), pruning old checkpoints as configured; ranks agree whether the run stops now."""
        self.step_done = step
        stopping, save_due = distributed.any_rank(
            self.accelerator, self.stop.requested or bool(self.guard.failure), self.schedule.due(step)
        )
        self._stopping = stopping
        if (save_due or stopping) and self.guard.weights_intact:
            self._save(step, {"tokens_seen": self.tokens_seen, "eval_loss": eval_result.get("eval_loss")})
            train = self.cfg.train
            if self.accelerator.is_main_process and (train.keep_last or train.keep_best):
                checkpoint.prune_checkpoints(self.output_dir, train.keep_last, train.keep_best)

    @contextlib.contextmanager
    def saved_when(self, lost: type[Exception]):
        """Around the training: `lost` (raised on every process between steps): steps saved, one line."""
        try:
            yield
        except lost as exc:
            if self.step_done > self.schedule.last_step and self.guard.weights_intact:
                self._save(self.step_done, {"tokens_seen": self.tokens_seen})
            self.progress.close()
            raise UserError(lost_line(str(exc), self.output_dir, self.schedule.last_step)) from exc

    def should_stop(self) -> bool:
        """Whether the ranks agreed at the last checkpoint decision that the run ends now."""
        return self._stopping

    def stopped(self, step: int) -> int:
        """The exit after `should_stop`: a failure raises UserError, a stop request returns exit code 75."""
        self.progress.close()
        if self.guard.failure:
            raise UserError(self.guard.failure)
        self.accelerator.print(
            f"stopped by {self.stop.signal_name or 'another rank'} after step {step}; checkpoint saved, "
            "launch again with train.resume=auto to continue"
        )
        return PREEMPTED_EXIT_CODE

    def finish(self, model, tokenizer, evaluator, export=export_final, closing=None) -> int:
        """Collective: the last checkpoint (unless just written), the measured result, the model exported by
        `export` (which returns its folder); `closing(shown, final_dir)`: a recipe's own closing lines."""
        max_steps = self.cfg.train.max_steps
        if self.schedule.last_step < max_steps:
            self._save(max_steps, {"tokens_seen": self.tokens_seen})
        self.watchdog.beat("the evaluation after training")
        evaluator.report(max_steps, "after")
        self.watchdog.beat("the export")
        final_dir = export(self.accelerator, model, tokenizer, self.cfg, self.output_dir)
        image = first_image(evaluator.dataset) if self.images is not None else None
        shown, prompt = evaluator.shown, self.cfg.eval.sample_prompt
        lines = closing(shown, final_dir) if closing else closing_lines(shown, final_dir, prompt, image)
        for line in lines:
            self.accelerator.print(line)
        distributed.end_training(self.accelerator)
        self._lock.release()
        return 0

    def _save(self, step: int, state: dict) -> None:
        self.watchdog.beat(f"the checkpoint of step {step}")
        extra = self.recipe_state() if self.recipe_state is not None else None
        checkpoint.save_checkpoint(self.accelerator, self.output_dir, step, state, self.cfg, extra)
        if self.accelerator.is_main_process:
            self.compiled.save()  # graphs compiled since the first step
        self.schedule.saved(step)
