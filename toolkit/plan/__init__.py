"""The estimator behind `ftkit plan`: parameter counts, per-GPU memory by backend, the report."""
