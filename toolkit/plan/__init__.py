"""The estimator behind `ftkit plan`: parameter counts, per-GPU memory by backend, the report."""

from typing import Literal

# The words of `ftkit plan` options, declared once: PlanRequest's fields and the command line read them here.
GradCkpt = Literal["auto", "on", "off"]
PlanDtype = Literal["auto", "float32", "bfloat16"]
PlanPrecision = Literal["bf16", "no"]
Objective = Literal["sft", "dpo", "grpo", "embed"]
