"""`ftkit check-config`: an accelerate YAML checked against a recipe config before anything starts. The
recipe is the one the config is for (`toolkit.recipes`, the choice `ftkit train` makes), so its data is read
by that recipe's own reader: SFT and GRPO rows through the chat template, DPO and reward-model records as
pairs (KTO's as its rows), an embedding run's as triplets."""

from __future__ import annotations

from collections.abc import MutableMapping
from pathlib import Path

from toolkit.data.agreement import SAMPLE, first_disagreement
from toolkit.data.build import data_format
from toolkit.data.sources import read_source, train_sources
from toolkit.embed import data as embed_data
from toolkit.launch.backend import with_pipeline
from toolkit.launch.checks import check_launch, launch_from_yaml
from toolkit.launch.machine import probe_machine
from toolkit.launch.request import backend_name, batch_split
from toolkit.model import vision
from toolkit.model.facts import read_model_facts
from toolkit.model.load import load_tokenizer
from toolkit.preference.data import render_answer, render_pair
from toolkit.preference.records import detect_layout, to_pair
from toolkit.preference.unpaired import to_rows
from toolkit.recipes import load_recipe_config, recipe_name, recipe_of
from toolkit.train.batches import grad_accum_steps

PIPELINE_LAUNCHES = ("pp", "pp_ddp")


def check_config_cli(
    accel_yaml: str, recipe_path: str | None, num_processes: int | None, env: MutableMapping[str, str]
) -> str:
    """The report: the launch's summary line, its notes, and the line on the recipe's data."""
    cfg = load_recipe_config(recipe_of(recipe_path), recipe_path, [])  # with the recipe's own checks
    recipe = recipe_name(cfg)
    source = recipe_path or "the demo config"
    machine = probe_machine()
    launch = launch_from_yaml(Path(accel_yaml), machine.gpu_count, num_processes)
    launch = with_pipeline(launch, cfg.pipeline.size, source)
    notes = check_launch(launch, cfg, read_model_facts(cfg.model), source, machine, env)
    ga = grad_accum_steps(cfg.train, launch.mesh.data_parallel)
    if Path(accel_yaml).stem in PIPELINE_LAUNCHES and cfg.pipeline.size == 1:
        # accelerate's YAML cannot carry the pipeline; the shipped pipeline launches say so here.
        notes.append(
            f"note: {accel_yaml} is a plain multi-process launch and the recipe config leaves pipeline.size "
            "at 1, so this runs as ddp: add pipeline.size=2 for the pipeline (ftkit train --backend pp does)"
        )
    if Path(accel_yaml).stem == "ep" and cfg.moe.expert_parallel == 1:
        notes.append(
            f"note: {accel_yaml} is a plain multi-process launch and the recipe config leaves "
            "moe.expert_parallel at 1, so this runs as ddp: add moe.expert_parallel=2 to split the experts "
            "(ftkit train --backend ep does)"
        )
    where = " as gloo CPU processes (no GPU here)" if launch.on_cpu and launch.world_size > 1 else ""
    summary = (
        f"{accel_yaml}: ok: {backend_name(launch)} on {launch.world_size} process(es){where} for the "
        f"{recipe} recipe, global batch {cfg.train.global_batch_size} = micro {cfg.train.micro_batch_size} "
        f"x GA {ga} x {batch_split(launch)}"
    )
    rows_of_one = recipe == "dpo" and cfg.dpo.loss == "kto"
    if recipe == "embed":
        data_line = embed_data.check_sources(cfg.data, SAMPLE)
    else:
        data_line = check_pairs(cfg, rows_of_one) if recipe in ("dpo", "rm") else check_chat_rows(cfg)
    return "\n".join([summary, *notes, data_line])


def check_chat_rows(cfg) -> str:
    """SFT and GRPO data (GRPO's prompts are SFT rows): the chat template's generation prompt must open
    the text each answer is trained after."""
    tokenizer = load_tokenizer(cfg.model)
    seeing = vision.is_vision(vision.model_type(cfg.model.path))  # rows with images are its to read
    for name in train_sources(cfg.data):
        source = read_source(name, cfg.data.split)
        fmt = data_format(source, cfg.data, tokenizer, seeing)
        found = first_disagreement(tokenizer, source, fmt, seeing)
        if found:
            return f"warning: {found}"
    return f"chat template: generation prompts agree with the training text ({SAMPLE} records per source)"


def check_pairs(cfg, rows_of_one: bool = False) -> str:
    """Preference data: the opening records of each source read as pairs (`rows_of_one`: as KTO's rows) and
    rendered by the chat template, as the recipe will read them (a mistake is one line naming the file and
    record)."""
    tokenizer = load_tokenizer(cfg.model)
    layouts = []
    for name in train_sources(cfg.data):
        source = read_source(name, cfg.data.split)
        for chunk in source.read(SAMPLE):
            records = list(chunk.records())
            layout = detect_layout(records[0], chunk.where(0))
            for i, record in enumerate(records):
                where = chunk.where(i)
                if rows_of_one:
                    for prompt, completion, _ in to_rows(record, layout, where):
                        render_answer(tokenizer, prompt, completion, where)
                else:
                    render_pair(tokenizer, to_pair(record, layout, where), where)
            layouts.append(layout)
            break
    return (
        f"preference pairs: the opening {SAMPLE} records of each source read as "
        f"{', '.join(sorted(set(layouts)))} {'rows' if rows_of_one else 'pairs'} and render through the chat "
        "template"
    )
