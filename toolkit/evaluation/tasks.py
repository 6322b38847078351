"""Which tasks `ftkit eval` runs: lm-eval's by name, a user's task YAMLs from `--include`, and ftkit's own
local tasks, which read the demo data shipped in toolkit/assets/eval and so run with no hub.

ftkit's tasks are given to lm-eval as config dicts, so their data paths are absolute wherever the command
runs. A user's YAML may name Python functions (`!function`): lm-eval imports them from the include folder,
which the user's own command line chose."""

from __future__ import annotations

import difflib
import functools
from pathlib import Path

from toolkit.errors import UserError

LOCAL_DATA = Path(__file__).resolve().parent.parent / "assets" / "eval"


def local_tasks() -> dict[str, dict]:
    """ftkit's own tasks: the demo's addition questions answered freely (exact match) and as a choice
    between the right sum and a wrong one (log-likelihood)."""
    return {
        "ftkit_sums": {
            "task": "ftkit_sums",
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(LOCAL_DATA / "sums.jsonl")}},
            "test_split": "test",
            "output_type": "generate_until",
            "doc_to_text": "{{question}}",
            "doc_to_target": "{{answer}}",
            "target_delimiter": "",
            "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8, "do_sample": False},
            "metric_list": [
                {
                    "metric": "exact_match",
                    "aggregation": "mean",
                    "higher_is_better": True,
                    "regexes_to_ignore": [r"^\s+", r"\s+$"],
                }
            ],
        },
        "ftkit_sums_choice": {
            "task": "ftkit_sums_choice",
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(LOCAL_DATA / "choices.jsonl")}},
            "test_split": "test",
            "output_type": "multiple_choice",
            "doc_to_text": "{{question}}",
            "doc_to_choice": "{{[right, wrong]}}",
            "doc_to_target": 0,
            "target_delimiter": "",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
        },
    }


@functools.cache
def task_manager(include: str | None, defaults: bool = True):
    """lm-eval's index of its task YAMLs (and `include`'s): thousands of files, read once a process (20 s
    and more on a small CPU). Without `defaults`, lm-eval's own YAMLs are left out of it."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include, include_defaults=defaults)


def resolve(names: list[str], include: str | None):
    """(task manager, task specs for lm-eval): ftkit's local tasks as dicts, the rest by name, each checked
    against what lm-eval (and `include`) knows; an unknown name is refused with the closest ones."""
    if include is not None and not Path(include).is_dir():
        raise UserError(f"--include: {include} is not a directory")
    local = local_tasks()
    # ftkit's tasks are whole configs: a call of only those needs no index of lm-eval's thousands of YAMLs.
    manager = task_manager(include, defaults=include is not None or not set(names) <= set(local))
    known = set(manager.all_tasks) | set(local)
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
            hint = f" (closest: {', '.join(close)})" if close else ""
            raise UserError(
                f"--tasks: no task {name!r}{hint}; a folder of task YAMLs is given with --include"
            )
    return manager, [local.get(name, name) for name in names]
