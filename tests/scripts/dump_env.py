"""Writes what this process has (environment, argv, sys.path[0], __file__, torch's thread count, its pid) to
<out>/rank-<RANK>.json, then runs the Python statement given as the second argument on rank 1 (on the only
process where RANK is unset): how tests/e2e/test_helpers.py compares a warm start with a real one. DeepSpeed
is imported first, as a recipe's rank does (its import sets PYTORCH_NVML_BASED_CUDA_CHECK, which a warm rank
has from the warm process); with DUMP_RECIPE_IMPORTS=1, all a recipe's rank imports (a real rank takes
several seconds of a core more for them)."""

import json
import os
import sys
from pathlib import Path

import deepspeed  # noqa: F401
import torch

if os.environ.get("DUMP_RECIPE_IMPORTS") == "1":
    import peft  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    import toolkit.run  # noqa: F401

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
rank = os.environ.get("RANK", "1")
started = {"env": dict(os.environ), "argv": sys.argv, "path0": sys.path[0], "file": __file__}
started["threads"] = torch.get_num_threads()
(out / f"rank-{rank}.json").write_text(json.dumps({**started, "pid": os.getpid()}, indent=1))
# One write of the whole line: the ranks share the launcher's stdout, and print's text and newline are two
# writes when stdout is unbuffered, which two ranks can interleave ("rank 1 startedrank 0 started").
os.write(sys.stdout.fileno(), f"rank {rank} started\n".encode())
if len(sys.argv) > 2 and rank == "1":
    exec(sys.argv[2])
