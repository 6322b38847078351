"""The tools demo's calculator, as a GRPO environment's tool (grpo.environment.tools): it adds and
subtracts whole numbers, read without evaluating any code."""

import re

TERM = re.compile(r"\s*([+-]?)\s*(\d+)\s*")


def calculator(expression: str) -> str:
    """Add or subtract whole numbers.

    Args:
        expression: the sum to work out, e.g. "38 + 47"
    """
    position, total = 0, 0
    while position < len(expression):
        match = TERM.match(expression, position)
        if match is None or (position and not match.group(1)):
            raise ValueError(f"cannot read {expression!r}: write whole numbers joined by + or -")
        total += -int(match.group(2)) if match.group(1) == "-" else int(match.group(2))
        position = match.end()
    if not position:
        raise ValueError("the expression is empty")
    return str(total)
