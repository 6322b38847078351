"""How a launch becomes a checked Accelerator: the machine (one probe), what the launcher asked for
(request.py: the Launch every other module reads), the backend's Accelerator (backend.py, with what only
one family needs beside it: deepspeed.py, fsdp.py, model_parallel.py), the checks of a launch against the
recipe config and the model's facts (checks.py), and the stop signals a launcher or scheduler sends
(preemption.py)."""
