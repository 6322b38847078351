"""The walk a newcomer takes from the SFT recipe's `main(argv)` to its loop, and GRPO's: every call the run
makes until the first step, traced. A room is a folder of the tree (recipes/, toolkit/'s root, each toolkit
package); a climb back up is a module of a package calling into toolkit/'s root, counted once per (caller,
callee) pair. `pytest tests/unit/test_recipe_walk.py -s` prints the walk."""

import sys
from pathlib import Path

import pytest
from helpers import QUICK, REPO, load_recipe

ROOMS, CLIMBS = 8, 5
# GRPO's walk passes through its own package (toolkit/grpo/) too, and climbs once more from there for the
# shared config schema (measured: 9 rooms, 6 climbs; the aim was 20 climbs or fewer).
GRPO_ROOMS, GRPO_CLIMBS = 9, 6


class FirstStep(Exception):
    """Raised where the loop would take its first step: the walk ends there."""


def room(path: str) -> str:
    parts = Path(path).parts
    return "recipes" if parts[0] == "recipes" else "/".join(parts[:-1])


def project_module(frame) -> str | None:
    name = frame.f_code.co_filename
    inside = name.startswith((str(REPO / "toolkit"), str(REPO / "recipes")))
    return str(Path(name).relative_to(REPO)) if inside else None


def importing(frame, caller) -> bool:
    """A module's body running as it is first imported: whether it is depends on which tests ran before in
    the same process, so it is not part of the walk."""
    return "<module>" in (frame.f_code.co_name, caller.f_code.co_name)


def walk(recipe, out: Path, overrides: list[str] = QUICK) -> list[tuple[str, str]]:
    """(caller module, callee module) of every call between two project modules, in order."""
    calls = []

    def profile(frame, event, arg):
        callee = project_module(frame) if event == "call" else None
        caller = frame.f_back
        while callee and caller is not None and project_module(caller) is None:
            caller = caller.f_back
        if (
            callee
            and caller is not None
            and project_module(caller) != callee
            and not importing(frame, caller)
        ):
            calls.append((project_module(caller), callee))

    sys.setprofile(profile)
    try:
        recipe.main([f"output_dir={out}", *overrides])
    except FirstStep:
        pass
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.usefixtures("signal_handlers_restored")
def test_from_argv_to_the_loop_the_recipe_enters_few_rooms_and_climbs_back_rarely(
    recipe, tmp_path, monkeypatch
):
    monkeypatch.setattr(recipe.Run, "steps", lambda *args, **kwargs: (_ for _ in ()).throw(FirstStep()))
    rooms, climbs = rooms_and_climbs(walk(recipe, tmp_path / "run"))
    assert "toolkit/launch" in rooms and "toolkit/train" in rooms, "the walk did not reach the launch"
    assert len(rooms) <= ROOMS and len(climbs) <= CLIMBS, (rooms, climbs)


@pytest.mark.usefixtures("signal_handlers_restored")
def test_grpo_from_argv_to_its_loop_enters_few_rooms_and_climbs_back_rarely(tmp_path, monkeypatch):
    grpo = load_recipe("grpo_llm")
    monkeypatch.setattr(grpo.Run, "step_numbers", lambda *args, **kwargs: (_ for _ in ()).throw(FirstStep()))
    quick = ["train.max_steps=2", "eval.exact_match_samples=0", "eval.max_batches=1"]
    rooms, climbs = rooms_and_climbs(walk(grpo, tmp_path / "run", quick))
    assert "toolkit/grpo" in rooms and "toolkit/train" in rooms, "the walk did not reach the launch"
    assert len(rooms) <= GRPO_ROOMS and len(climbs) <= GRPO_CLIMBS, (rooms, climbs)


def rooms_and_climbs(calls: list[tuple[str, str]]) -> tuple[list[str], list[tuple[str, str]]]:
    """The rooms the walk entered, in order, and its climbs back up (each printed with -s)."""
    rooms = list(dict.fromkeys(room(module) for pair in calls for module in pair))
    climbs = sorted(
        {(a, b) for a, b in calls if room(b) == "toolkit" and room(a) not in ("toolkit", "recipes")}
    )
    print(f"\nrooms ({len(rooms)}): {', '.join(rooms)}\nclimbs back up ({len(climbs)}):")
    print("\n".join(f"  {a} -> {b}" for a, b in climbs))
    return rooms, climbs
