"""The engine's HTTP API, the few calls ftkit makes: health, seeded completions of token ids with the
sampled tokens' log-probabilities, LoRA adapters loaded and unloaded while it runs, whole weights
reloaded, and sleep and wake-up (vLLM's sleep mode)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from toolkit.errors import UserError

TIMEOUT_S = 600


@dataclass
class Completion:
    tokens: list[int]
    """Sampled token ids, the end token included when one was sampled."""
    logps: list[float]
    """The engine's log-probability of each sampled token under the distribution it drew it from (after
    temperature, top-k and top-p: vLLM's processed log-probs)."""


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
            return answer.status == 200
    except (OSError, urllib.error.URLError):
        return False


class Unreachable(UserError):
    """The engine gave no answer: nothing listens, the connection broke, or it timed out."""


def post(url: str, path: str, payload: dict) -> dict | str:
    """The answer's JSON (or text); an engine that cannot be reached (Unreachable) or refuses is one line."""
    request = urllib.request.Request(
        f"{url}{path}", json.dumps(payload).encode(), {"Content-Type": "application/json"}
    )
    return _answer(url, path, request, TIMEOUT_S)


def get(url: str, path: str) -> dict | str:
    """`post`'s answer to a GET of `path`, given 30 seconds."""
    return _answer(url, path, urllib.request.Request(f"{url}{path}"), 30)


def _answer(url: str, path: str, request, timeout_s: float) -> dict | str:
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            body = answer.read().decode()
    except urllib.error.HTTPError as exc:
        raise UserError(f"grpo.vllm: the engine at {url} refused {path}: {_message(exc)}") from exc
    except (OSError, urllib.error.URLError) as exc:
        raise Unreachable(
            f"grpo.vllm: the engine at {url} is not reachable ({getattr(exc, 'reason', exc)})"
        ) from exc
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        return body


def _message(exc: urllib.error.HTTPError) -> str:
    text = exc.read().decode(errors="replace")
    try:
        return json.loads(text).get("error", {}).get("message", text)[:300]
    except (json.JSONDecodeError, AttributeError):
        return text[:300]


def complete(
    url: str,
    model: str,
    prompts: list[list[int]],
    seeds: list[int],
    sampling,
    stop_ids: list[int],
    max_tokens: list[int] | None = None,
    stop: list[str] | None = None,
    n: int = 1,
) -> list[Completion]:
    """`n` completions per (prompt, seed), in their order, sampled per `sampling` (max_new_tokens,
    temperature, top_k, top_p). The requests go at once, so the engine batches them; each one's seed alone
    decides its draws: with `n` > 1 one request asks for all n, and vLLM seeds its i-th with seed + i
    (v1/engine/parallel_sampling.py), so they are the n completions seeded seed, seed + 1, ... asked for
    one by one, the prompt sent once. `max_tokens`: each row's own budget (else max_new_tokens); `stop`:
    strings that end a completion, kept in it (a tool call's close)."""
    budgets = max_tokens or [sampling.max_new_tokens] * len(prompts)

    def one(prompt: list[int], seed: int, budget: int) -> list[Completion]:
        payload = {
            "model": model,
            "prompt": prompt,
            "max_tokens": budget,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k or -1,
            "seed": seed,
            "logprobs": 0,
            "return_token_ids": True,
            "stop_token_ids": stop_ids,
            "n": n,
        }
        if stop:
            payload.update(stop=stop, include_stop_str_in_output=True)
        choices = sorted(post(url, "/v1/completions", payload)["choices"], key=lambda c: c.get("index", 0))
        return [Completion(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in choices]

    with ThreadPoolExecutor(max_workers=min(64, max(1, len(prompts)))) as pool:
        return [done for group in pool.map(one, prompts, seeds, budgets) for done in group]


def load_adapter(url: str, name: str, path: str) -> None:
    post(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})


def unload_adapter(url: str, name: str) -> None:
    post(url, "/v1/unload_lora_adapter", {"lora_name": name})


def reload_weights(url: str, folder: str) -> None:
    """The engine's weights replaced in place by the checkpoint in `folder` (vLLM's reload_weights, reached
    through /collective_rpc, which its development mode opens), then its prefix cache dropped: the cached
    prompts were computed with the old weights."""
    try:
        post(url, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": folder}})
    except UserError as exc:
        if "Not Found" not in str(exc):
            raise
        raise UserError(
            f"grpo.vllm: the engine at {url} takes no weights: model.method full reloads them through its "
            "/collective_rpc, which VLLM_SERVER_DEV_MODE=1 in the engine's environment opens"
        ) from exc
    post(url, "/reset_prefix_cache", {})


def sleep(url: str, level: int) -> None:
    """The engine frees its GPU memory: level 1 keeps its weights in CPU memory, level 2 drops them (they
    are reloaded before it serves again); both drop the KV cache. Requests in flight are aborted."""
    _dev(url, f"/sleep?level={level}")


def wake_up(url: str, tags: tuple[str, ...] = ()) -> None:
    """The engine's GPU memory back: all of it, or only `tags` ("weights", "kv_cache"), so a reload of
    whole weights does not meet the KV cache on the GPU."""
    query = "".join(f"{'&' if i else '?'}tags={tag}" for i, tag in enumerate(tags))
    _dev(url, f"/wake_up{query}")


def _dev(url: str, path: str) -> None:
    try:
        post(url, path, {})
    except UserError as exc:
        if "Not Found" not in str(exc):
            raise
        raise UserError(
            f"grpo.vllm.sleep: the engine at {url} has no {path.split('?')[0]}: sleep mode needs "
            "--enable-sleep-mode and VLLM_SERVER_DEV_MODE=1 in the engine's environment"
        ) from exc
