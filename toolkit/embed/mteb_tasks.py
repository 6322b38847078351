"""`embed.mteb_tasks`: MTEB tasks run on the exported embedding model after training, through the `mteb`
package (the `embed` extra), only where each task's data set already sits in the local Hugging Face cache:
nothing is downloaded at run time. A task name mteb does not know, or one whose data is not in the cache,
stops the run before anything is written, in one line naming the task."""

from __future__ import annotations

from pathlib import Path

from toolkit.errors import UserError

KEY = "embed.mteb_tasks"


def check_tasks(names: list[str], cache: Path | None = None) -> None:
    """Before the run folder is written: mteb is installed, each name is one of its tasks, and each task's
    data set is in the local Hugging Face cache (`cache`: the hub cache, HF_HUB_CACHE by default)."""
    if not names:
        return
    mteb = _mteb()
    for name in names:
        task = _task(mteb, name)
        missing = missing_data(name, task.metadata.dataset, cache or _hub_cache())
        if missing:
            raise UserError(missing)


def missing_data(name: str, dataset: dict, cache: Path) -> str | None:
    """The one line for task `name` whose `dataset` ({"path": repo, "revision": commit}, as mteb's task
    metadata names it) has no snapshot in the hub `cache`; None when it has."""
    repo, revision = dataset["path"], dataset.get("revision")
    folder = cache / f"datasets--{repo.replace('/', '--')}"
    snapshots = folder / "snapshots"
    if revision and ((snapshots / revision).is_dir() or (folder / "refs" / revision).is_file()):
        return None
    if not revision and snapshots.is_dir() and any(snapshots.iterdir()):
        return None
    at = f" at {revision}" if revision else ""
    return (
        f"{KEY}: {name} needs its data set {repo}{at} downloaded into the Hugging Face cache ({cache}); "
        "ftkit downloads no data set at run time"
    )


def run_tasks(names: list[str], final_dir: Path) -> dict[str, float]:
    """Each task on the exported folder as sentence-transformers loads it, offline; its main score under
    `mteb/<task>`."""
    import datasets
    import huggingface_hub
    from sentence_transformers import SentenceTransformer

    mteb = _mteb()
    # The data sets were found in the cache before training: nothing asks the hub for them.
    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    model = SentenceTransformer(str(final_dir), local_files_only=True)
    tasks = [_task(mteb, name) for name in names]
    result = mteb.evaluate(model, tasks, cache=None, show_progress_bar=False)
    return {f"mteb/{r.task_name}": float(r.get_score()) for r in result.task_results}


def _mteb():
    try:
        import mteb
    except ImportError:
        raise UserError(f"{KEY}: needs the mteb package: pip install 'ftkit[embed]'") from None
    return mteb


def _task(mteb, name: str):
    try:
        return mteb.get_task(name)
    except KeyError as exc:  # mteb names the closest task in its message
        said = str(exc).strip("\"'").removeprefix("KeyError: ")
        raise UserError(f"{KEY}: {said}") from None


def _hub_cache() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)
