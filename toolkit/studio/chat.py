"""Chat: each model answers in a worker process of its own, loaded on the first question by the function
`ftkit generate` loads with (never with trust_remote_code), its tokens streamed back as they come, and ended
after IDLE_S without a question so its memory goes back."""

from __future__ import annotations

import multiprocessing
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from toolkit.studio.chat_place import free_gpus, place

IDLE_S = 300.0
DONE = None


def _serve(model_dir: str, requests, replies, device: str = "cpu") -> None:
    """The worker: load once (onto `device`), then answer each (prompt, max_new_tokens) as ("text",
    piece)... ("end", "")."""
    from transformers import TextIteratorStreamer

    from toolkit.errors import UserError
    from toolkit.model.for_generation import load_for_generation
    from toolkit.train.generation import chat_prompt_ids, greedy_answer

    try:
        model, tokenizer = load_for_generation(Path(model_dir), trust_remote_code=False)
        if device != "cpu":  # a 4-bit model is placed as it loads; the CPU is where every model loads
            model.to(device)
        if not tokenizer.chat_template:
            raise UserError(f"--model: {model_dir} has no chat template; it was not saved by ftkit")
    except UserError as exc:
        replies.put(("error", str(exc)))
        return
    replies.put(("ready", ""))
    while (request := requests.get()) is not DONE:
        prompt, max_new_tokens = request
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        ids = chat_prompt_ids(tokenizer, prompt)
        thread = threading.Thread(
            target=greedy_answer, args=(model, tokenizer, ids, max_new_tokens, False, None, streamer)
        )
        thread.start()
        for piece in streamer:
            if piece:
                replies.put(("text", piece))
        thread.join()
        replies.put(("end", ""))


class Worker:
    def __init__(self, model_dir: Path, gpus: list[tuple[int, int]] | None = None):
        self.device, self.note = place(model_dir, free_gpus() if gpus is None else gpus)
        """Where it answers, and the one line saying why not on a GPU ("": nothing to say)."""
        context = multiprocessing.get_context("spawn")
        self.requests, self.replies = context.Queue(), context.Queue()
        self.process = context.Process(
            target=_serve, args=(str(model_dir), self.requests, self.replies, self.device), daemon=True
        )
        self.process.start()
        self.lock = threading.Lock()
        self.ready = False
        self.used = time.monotonic()

    def ask(self, prompt: str, max_new_tokens: int) -> Iterator[str]:
        with self.lock:
            self.used = time.monotonic()
            if not self.ready:
                kind, text = self._next()
                if kind == "error":
                    raise ChatError(text)
                self.ready = True
                if self.note:
                    yield f"[{self.note}]\n"
            self.requests.put((prompt, max_new_tokens))
            while (reply := self._next())[0] == "text":
                yield reply[1]
            self.used = time.monotonic()

    def _next(self) -> tuple[str, str]:
        while True:
            try:
                return self.replies.get(timeout=1.0)
            except queue.Empty:
                if not self.process.is_alive():
                    raise ChatError(f"the model's worker ended (exit {self.process.exitcode})") from None

    def close(self) -> None:
        if self.process.is_alive():
            self.requests.put(DONE)
            self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.terminate()


class ChatError(Exception):
    """The worker could not load the model or died; the message is one line."""


class Workers:
    """One worker per model folder, made on demand and ended when idle."""

    def __init__(self, idle_s: float = IDLE_S):
        self.idle_s = idle_s
        self._workers: dict[Path, Worker] = {}
        self._lock = threading.Lock()

    def ask(self, model_dir: Path, prompt: str, max_new_tokens: int) -> Iterator[str]:
        self.close_idle()
        with self._lock:
            worker = self._workers.get(model_dir)
            if worker is None or not worker.process.is_alive():
                worker = self._workers[model_dir] = Worker(model_dir)
        try:
            yield from worker.ask(prompt, max_new_tokens)
        except ChatError:
            with self._lock:
                self._workers.pop(model_dir, None)
            raise

    def loaded(self) -> list[str]:
        return [str(path) for path, worker in self._workers.items() if worker.process.is_alive()]

    def close_idle(self) -> None:
        now = time.monotonic()
        with self._lock:
            idle = [p for p, w in self._workers.items() if not w.lock.locked() and now - w.used > self.idle_s]
            for path in idle:
                self._workers.pop(path).close()

    def close_all(self) -> None:
        with self._lock:
            for worker in self._workers.values():
                worker.close()
            self._workers.clear()
