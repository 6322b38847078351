"""Data-parallel copies of one engine (grpo.vllm.replicas): every copy serves the same weights, a round's
requests are split between them by prompt, and each call that changes what they serve (an adapter loaded,
whole weights reloaded, sleep and wake-up) goes to all of them at once.

A completion is decided by its prompt, its seed and the weights alone (vLLM seeds each request's generator
from its seed), so the split does not change what comes back: the same completions as one engine's, in the
same order. A copy that fails a call is named in the error (`ReplicaError.replica`), so only that one is
started again.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from toolkit.engine import client
from toolkit.engine.server import Engine
from toolkit.errors import UserError


class ReplicaError(UserError):
    """A call to one copy failed: `replica` is its index, `cause` the error it raised."""

    def __init__(self, replica: int, cause: UserError):
        super().__init__(str(cause))
        self.replica, self.cause = replica, cause


class Replicas:
    """The engines a run samples with: one, or grpo.vllm.replicas copies of it."""

    def __init__(self, engines: list[Engine]):
        self.engines = engines

    def __len__(self) -> int:
        return len(self.engines)

    def label(self, replica: int) -> str:
        """How errors name copy `replica`: "" with one engine."""
        return f" (replica {replica + 1} of {len(self.engines)})" if len(self.engines) > 1 else ""

    def each(self, call) -> list:
        """`call(engine)` on every copy at once, their results in order; a failure is a ReplicaError naming
        the first copy that failed."""
        return self.each_indexed(lambda _, engine: call(engine))

    def each_indexed(self, call) -> list:
        """`each` with `call(index, engine)`."""
        if len(self.engines) == 1:
            return [_named(0, call, self.engines[0])]
        with ThreadPoolExecutor(max_workers=len(self.engines), thread_name_prefix="engine-replica") as pool:
            futures = [pool.submit(_named, i, call, engine) for i, engine in enumerate(self.engines)]
            return [future.result() for future in futures]

    def complete(self, name: str, prompts, seeds, sampling, stop_ids, n=1, max_tokens=None, stop=None):
        """`client.complete` with the prompts split between the copies in contiguous shares (each prompt's
        `n` completions from one copy), the completions back in the prompts' order."""
        count = len(self.engines)
        shares = [(len(prompts) * i // count, len(prompts) * (i + 1) // count) for i in range(count)]

        def share(i: int, engine: Engine):
            begin, end = shares[i]
            budgets = max_tokens[begin:end] if max_tokens else None
            return client.complete(
                engine.url, name, prompts[begin:end], seeds[begin:end], sampling, stop_ids, budgets, stop, n
            )

        parts = self.each_indexed(share)
        return [completion for part in parts for completion in part]

    def check_alive(self) -> None:
        for i, engine in enumerate(self.engines):
            _named(i, lambda _, e: e.check_alive(), engine)

    def stop(self) -> None:
        for engine in self.engines:
            engine.stop()


def _named(replica: int, call, engine: Engine):
    """`call(replica, engine)`, its UserError a ReplicaError naming the copy."""
    try:
        return call(replica, engine)
    except ReplicaError:
        raise
    except UserError as exc:
        raise ReplicaError(replica, exc) from exc
