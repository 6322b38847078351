"""`ftkit eval`: a model scored on benchmarks through lm-evaluation-harness, beside its base model.

tasks.py names the tasks (lm-eval's own, a user's folder of task YAMLs, and ftkit's local ones built on the
demo data); harness.py scores one loaded model on them; compare.py sets two models' scores side by side."""
