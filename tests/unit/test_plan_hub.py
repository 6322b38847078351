"""`ftkit plan --model <hub id>` beyond the built-in table: the config.json from the local cache, or fetched
alone from the hub when online (the hub's download function is replaced here: this machine has no hub), and
HF_HUB_OFFLINE keeping it to the table and the cache."""

import json
import os
import subprocess
import sys

import httpx2
import huggingface_hub
import pytest
from helpers import tiny_llama_config
from huggingface_hub import errors

from toolkit.commands import cli
from toolkit.plan import hub
from toolkit.plan.counts import load_model_config

MODEL = "someone/new-model-9b"
pytestmark = pytest.mark.usefixtures("at_the_checkout_root")


class FakeHub:
    """`hf_hub_download` of a hub that holds `files` ({repo: config dict}) and a cache that holds `cached`
    (same form); `failure` is raised by every download from the hub. Records each call."""

    def __init__(self, folder, files=None, cached=None, failure=None):
        self.folder, self.files, self.cached, self.failure = folder, files or {}, cached or {}, failure
        self.calls = []

    def __call__(self, repo_id, filename, *, local_files_only=False, **_):
        self.calls.append((repo_id, filename, local_files_only))
        source = self.cached if local_files_only else self.files
        if repo_id not in source:
            if local_files_only:
                raise errors.LocalEntryNotFoundError("not in the disk cache")
            raise self.failure or errors.LocalEntryNotFoundError("check your connection")
        path = self.folder / ("cached" if local_files_only else "fetched") / repo_id / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(source[repo_id]))
        return str(path)


def _config(**changes) -> dict:
    return {**tiny_llama_config().to_dict(), **changes}


@pytest.fixture
def online(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


def test_an_id_outside_the_table_is_fetched_from_the_hub_config_json_alone(tmp_path, monkeypatch, online):
    fake = FakeHub(tmp_path, files={MODEL: _config(num_hidden_layers=3)})
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake)
    config, source = load_model_config(MODEL)
    assert (config.model_type, config.num_hidden_layers, source) == ("llama", 3, hub.HUB)
    assert fake.calls == [(MODEL, "config.json", True), (MODEL, "config.json", False)]


def test_the_cache_answers_before_the_hub(tmp_path, monkeypatch, online):
    fake = FakeHub(tmp_path, files={MODEL: _config()}, cached={MODEL: _config(num_hidden_layers=5)})
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake)
    config, source = load_model_config(MODEL)
    assert (config.num_hidden_layers, source) == (5, hub.CACHE)
    assert fake.calls == [(MODEL, "config.json", True)]


def test_a_built_in_id_never_asks_the_hub(tmp_path, monkeypatch, online):
    fake = FakeHub(tmp_path)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake)
    assert load_model_config("Qwen/Qwen2.5-0.5B")[1] == "built-in table"
    assert fake.calls == []


def test_plan_prints_a_fetched_model(tmp_path, monkeypatch, capsys, online):
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", FakeHub(tmp_path, files={MODEL: _config()}))
    assert cli.main(["plan", "--model", MODEL, "--gpus", "1", "--gpu-mem", "24", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["source"] == hub.HUB


def _refusal(kind: type, status: int) -> Exception:
    """One of the hub's refusals as the hub library raises it: several lines, the response attached."""
    request = httpx2.Request("HEAD", f"https://huggingface.co/{MODEL}/resolve/main/config.json")
    response = httpx2.Response(status, headers={"x-request-id": "abc"}, request=request)
    return kind(f"{status} Client Error.\n\nRepository Not Found for url: {request.url}", response=response)


@pytest.mark.parametrize(
    "failure, words",
    [
        (errors.LocalEntryNotFoundError("check your connection"), "the hub could not be reached"),
        (_refusal(errors.GatedRepoError, 403), "gated on the hub"),
        (_refusal(errors.RepositoryNotFoundError, 404), "the hub has no such model"),
        (_refusal(errors.RemoteEntryNotFoundError, 404), "has no config.json"),
    ],
)
def test_a_failed_fetch_is_one_line_naming_the_id(tmp_path, monkeypatch, capsys, online, failure, words):
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", FakeHub(tmp_path, failure=failure))
    assert cli.main(["plan", "--model", MODEL]) == 2
    err = capsys.readouterr().err
    assert MODEL in err and words in err and err.count("\n") == 1


def test_a_model_type_transformers_does_not_know_is_one_line(tmp_path, monkeypatch, capsys, online):
    remote = _config(model_type="brand_new", auto_map={"AutoConfig": "configuration_brand_new.Config"})
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", FakeHub(tmp_path, files={MODEL: remote}))
    assert cli.main(["plan", "--model", MODEL]) == 2
    err = capsys.readouterr().err
    assert "'brand_new' is not one transformers" in err and MODEL in err and err.count("\n") == 1


def test_offline_keeps_to_the_table_and_the_cache(tmp_path, monkeypatch):
    """HF_HUB_OFFLINE set as a user sets it, in a fresh process with the real hub library: an id in the cache
    plans, one outside it is today's one line, and nothing goes to the network (it would fail here)."""
    snapshot = tmp_path / "models--someone--cached-model" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(_config(num_hidden_layers=3)))
    (tmp_path / "models--someone--cached-model" / "refs").mkdir()
    (tmp_path / "models--someone--cached-model" / "refs" / "main").write_text("0" * 40)
    code = (
        "import json, sys; from toolkit.errors import UserError; from toolkit.plan.counts import "
        "load_model_config\nconfig, source = load_model_config('someone/cached-model')\n"
        "try:\n    load_model_config(sys.argv[1])\nexcept UserError as exc:\n    print(json.dumps([config."
        "num_hidden_layers, source, str(exc)]))"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code, MODEL], env=env, capture_output=True, text=True)
    layers, source, message = json.loads(done.stdout)
    assert (layers, source) == (3, hub.CACHE)
    assert f"--model {MODEL}: no such path, not in the built-in table" in message
    assert "HF_HUB_OFFLINE is set" in message
