"""A generation engine (vLLM's OpenAI-compatible server) as a process of its own, in its own environment
(`.venv-vllm`, built by `make install-vllm`): started, watched and stopped here (server.py), talked to over
HTTP (client.py). GRPO's rollouts call it; nothing here knows about training."""
