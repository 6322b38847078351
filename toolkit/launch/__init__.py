"""How a launch becomes a checked Accelerator: the machine (one probe), the backend the launcher asked for
and its Accelerator (backend.py), the checks of a launch against the recipe config (checks.py), and the
stop signals a launcher or scheduler sends (preemption.py)."""
