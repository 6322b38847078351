"""Multi-turn GRPO beyond the core loop: bad input refused before the run writes anything, a model turn that
ends at its tool call's close, the turn's stops on HF generate and on the engine, and rewards that read the
whole conversation."""

from __future__ import annotations

import pytest
from helpers import REPO, load_recipe

from toolkit.engine import server
from toolkit.errors import USER_ERROR_EXIT_CODE, run_main

CALCULATOR = f"{REPO / 'toolkit' / 'assets' / 'demo' / 'calculator.py'}:calculator"
UNTYPED = '''
def untyped(x):
    """No hints.

    Args:
        x: anything
    """
    return x
'''


@pytest.mark.usefixtures("signal_handlers_restored")
@pytest.mark.parametrize(
    "case, message",
    [
        ("unimportable", "grpo.environment.tools: cannot import nowhere_module"),
        ("untyped", "grpo.environment.tools: untyped: no JSON schema from its signature"),
        ("max_turns", "grpo.max_turns: 0 must be at least 1"),
        ("no engine", "grpo.generation=vllm: no engine environment at"),
    ],
)
def test_bad_input_is_one_line_and_nothing_is_written(case, message, tmp_path, monkeypatch, capsys):
    (tmp_path / "tools.py").write_text(UNTYPED)
    monkeypatch.setattr(server, "ENGINE_VENV", tmp_path / "no-venv")  # whether or not this checkout has one
    overrides = {
        "unimportable": ["grpo.environment.tools=[nowhere_module:f]"],
        "untyped": [f"grpo.environment.tools=[{tmp_path / 'tools.py'}:untyped]"],
        "max_turns": ["grpo.max_turns=0"],
        "no engine": ["grpo.generation=vllm", f"grpo.environment.tools=[{CALCULATOR}]"],
    }[case]
    out = tmp_path / "run"
    argv = [f"output_dir={out}", "model.adapter=null", *overrides]
    assert run_main(load_recipe("grpo_llm").main, argv, "grpo_llm") == USER_ERROR_EXIT_CODE
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not out.exists()
