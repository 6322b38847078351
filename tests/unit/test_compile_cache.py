"""The compile cache a run keeps (`toolkit/checkpoint/compile_cache.py`): loaded only when signed with this
user's key, so a cache copied from someone else's run or damaged is never loaded (it is compiled code);
never written over a file ftkit did not write; off where nothing compiles. torch's own save and load are
stood in for here: tests/e2e/test_speed_runs.py runs them for real."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from toolkit.checkpoint import compile_cache
from toolkit.checkpoint.compile_cache import CompileCache, open_cache, user_key
from toolkit.errors import UserError

ARTIFACTS = SimpleNamespace(artifacts={"inductor": ["a", "b"], "aot_autograd": ["c"]})


@pytest.fixture
def torch_cache(monkeypatch, tmp_path):
    """torch's portable cache stood in for: what it would save, and every load it is asked for."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    loads = []
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"compiled code", ARTIFACTS))
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: loads.append(data) or ARTIFACTS)
    return loads


def saved_run(tmp_path) -> CompileCache:
    cache = open_cache("", tmp_path / "run", compiling=True)
    assert "none yet" in cache.note
    cache.after_step(is_main=True)
    return cache


def test_a_saved_cache_is_signed_and_loaded_by_the_next_start(torch_cache, tmp_path):
    cache = saved_run(tmp_path)
    manifest = json.loads(cache.manifest_path.read_text())
    assert manifest["written_by"] == "ftkit" and manifest["graphs"] == 3
    assert (tmp_path / "home" / "ftkit" / "signing.key").stat().st_mode & 0o777 == 0o600
    again = open_cache("", tmp_path / "run", compiling=True)
    assert torch_cache == [b"compiled code"]
    assert again.note == f"compile cache: 3 compiled artifacts loaded from {cache.data_path}"


def test_a_cache_signed_by_another_key_or_damaged_is_not_loaded(torch_cache, tmp_path, monkeypatch):
    cache = saved_run(tmp_path)
    cache.data_path.write_bytes(b"compiled c0de")
    assert "not signed with this user's key" in open_cache("", tmp_path / "run", compiling=True).note
    cache.data_path.write_bytes(b"compiled code")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "someone else"))
    assert "not signed with this user's key" in open_cache("", tmp_path / "run", compiling=True).note
    assert torch_cache == []


def test_a_key_others_can_read_is_not_used(torch_cache, tmp_path):
    saved_run(tmp_path)
    key = tmp_path / "home" / "ftkit" / "signing.key"
    assert user_key(create=False) is not None
    os.chmod(key, 0o644)
    assert user_key(create=False) is None
    assert "not signed" in open_cache("", tmp_path / "run", compiling=True).note
    assert torch_cache == []


def test_a_file_ftkit_did_not_write_is_left_as_it_is(torch_cache, tmp_path):
    cache = CompileCache(tmp_path / "shared")
    cache.folder.mkdir()
    cache.data_path.write_bytes(b"someone's file")
    cache.save()
    assert cache.data_path.read_bytes() == b"someone's file"
    assert "was not written by ftkit" in cache.note


def test_nothing_is_kept_without_compiling_or_when_off(torch_cache, tmp_path):
    for setting, compiling in (("", False), ("off", True)):
        cache = open_cache(setting, tmp_path / "run", compiling)
        assert cache.folder is None and cache.after_step(is_main=True) == {}
    assert not (tmp_path / "run").exists()


def test_a_shared_folder_serves_runs_of_the_same_shapes(torch_cache, tmp_path):
    shared = tmp_path / "shared-cache"
    first = open_cache(str(shared), tmp_path / "run-1", compiling=True)
    first.after_step(is_main=True)
    second = open_cache(str(shared), tmp_path / "run-2", compiling=True)
    assert second.note.startswith("compile cache: 3 compiled artifacts loaded from " + str(shared))
    assert compile_cache.machine_kind()[0] in second.data_path.name


def test_a_file_given_as_the_folder_is_one_line_and_a_folder_not_made_costs_only_the_cache(
    torch_cache, tmp_path, capsys
):
    given = tmp_path / "a-file"
    given.write_text("mine")
    with pytest.raises(UserError, match=f"model.compile_cache: {given} is a file, not a folder"):
        open_cache(str(given), tmp_path / "run", compiling=True)
    # A folder that cannot be made (under a file; mode bits do not stop root): the run goes on.
    cache = open_cache(str(given / "cache"), tmp_path / "run", compiling=True)
    assert cache.after_step(is_main=True) is not None
    assert given.read_text() == "mine"
    assert f"compile cache: not kept in {given / 'cache'}" in capsys.readouterr().out
