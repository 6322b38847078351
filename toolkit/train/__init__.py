"""The training step and what a recipe's loop touches: step-shaped batches (batches), the token-exact loss
(loss) and its chunked head (head), a mixture of experts' router balance (router), the optimizer and
schedule (optim), the update and the run's end (steps), the non-finite guard (nonfinite), the stall
watchdog (watchdog), metrics.jsonl (metrics), held-out evaluation (evaluate) and greedy answers
(generation)."""
