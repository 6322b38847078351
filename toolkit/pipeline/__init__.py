"""Pipeline parallelism: a causal LM's decoder layers split into stages across the processes of a
pipeline (`pipeline.size`), micro-batches run through torch.distributed.pipelining's schedules.

    stages.py    which layers each stage holds, the model trimmed to a process's stages, a stage's forward
    batches.py   a step's micro-batches stacked at one fixed shape (the schedule's buffers are fixed)
    runtime.py   the Pipeline a recipe steps: schedule, gradient sync across replicas, norm, eval loss
"""
