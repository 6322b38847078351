"""`embed.mteb_tasks`: a task whose data set is not in the local Hugging Face cache stops the run before
anything is written, in one line naming the task and the data set to download (nothing is fetched here)."""

import pytest

from toolkit.embed.config import load_embed_config
from toolkit.embed.mteb_tasks import missing_data
from toolkit.errors import UserError

DEMO = "recipes/configs/demo-embed.yaml"
STS = {"path": "mteb/stsbenchmark-sts", "revision": "b0fddb56ed78048fa8b90373c8a3cfc37b684831"}


def test_a_task_without_its_data_in_the_cache_is_one_line_and_with_it_none(tmp_path):
    line = missing_data("STSBenchmark", STS, tmp_path)
    assert line == (
        f"embed.mteb_tasks: STSBenchmark needs its data set mteb/stsbenchmark-sts at {STS['revision']} "
        f"downloaded into the Hugging Face cache ({tmp_path}); ftkit downloads no data set at run time"
    )
    other = tmp_path / "datasets--mteb--stsbenchmark-sts" / "snapshots" / "0123abc"
    other.mkdir(parents=True)
    assert missing_data("STSBenchmark", STS, tmp_path) is not None  # another revision is not the task's
    (other.parent / STS["revision"]).mkdir()
    assert missing_data("STSBenchmark", STS, tmp_path) is None


def test_the_recipe_refuses_before_the_run_and_names_unknown_tasks(tmp_path, monkeypatch):
    """Through the config check the recipe runs first (mteb itself names the task's data set)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    out = tmp_path / "run"
    with pytest.raises(
        UserError, match=r"^embed.mteb_tasks: STSBenchmark needs its data set mteb/stsbenchmark"
    ):
        load_embed_config(DEMO, ["embed.mteb_tasks=[STSBenchmark]", f"output_dir={out}"])
    with pytest.raises(
        UserError, match="embed.mteb_tasks: 'STSBenchmarkk' not found. Did you mean: 'STSBenchmark'"
    ):
        load_embed_config(DEMO, ["embed.mteb_tasks=[STSBenchmarkk]"])
    assert not out.exists()


def test_a_reranker_has_no_mteb_tasks():
    with pytest.raises(UserError, match="MTEB tasks evaluate an embedding model, not a reranker"):
        load_embed_config(DEMO, ["embed.task=reranker", "embed.mteb_tasks=[STSBenchmark]"])
