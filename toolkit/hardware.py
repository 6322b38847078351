"""Facts about machines that the launch check, `ftkit doctor` and `ftkit plan` share (no torch import, so
the doctor can still report on a broken install)."""

import re

GIB = 1 << 30
# GeForce RTX 40xx boards have no working GPU-to-GPU (P2P) path, whatever the driver reports.
GEFORCE_40 = re.compile(r"GeForce RTX 40\d\d", re.IGNORECASE)
