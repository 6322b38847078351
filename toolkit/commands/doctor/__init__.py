"""`ftkit doctor`: is this machine ready to train? Versions, GPUs, P2P, NCCL settings and a pairwise
all-reduce, CPU, RAM, disk.

`probe.gather_probes` is the only function that looks at the machine; `report.diagnose` turns its `Probes`
into findings through the checks of `software`, `gpus` and `host`, so a test can describe any machine (two
RTX 4090s without P2P, mismatched GPUs, little RAM) as plain data (`records`).
"""
