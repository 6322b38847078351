"""The Chat page: one or two models side by side, each answer streamed from the model's worker process."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, StreamingResponse

from toolkit.studio.chat import ChatError
from toolkit.studio.context import Studio
from toolkit.studio.guard import inside


def add_routes(router: FastAPI, studio: Studio) -> None:
    """This page's routes, on the app itself (so every route is the app's own, as its tests list them)."""

    def models() -> list[tuple[str, str]]:
        """(value, label): each finished run's final/, and each run's base model."""
        found = []
        for view in studio.views():
            if (studio.roots.runs / view.name / "final").is_dir():
                found.append((f"run:{view.name}", f"{view.name} (fine-tuned)"))
            if view.model:
                found.append((f"path:{view.model}", f"{view.model} (base of {view.name})"))
        return list(dict.fromkeys(found))

    def model_dir(choice: str) -> Path:
        kind, _, value = choice.partition(":")
        if kind == "run":
            return studio.named_run(value) / "final"
        return inside(value, studio.roots, "model")

    @router.get("/chat", response_class=HTMLResponse)
    def chat_page(request: Request):
        return studio.page(request, "chat.html", models=models(), loaded=studio.workers.loaded())

    @router.post("/api/chat")
    async def chat_answer(request: Request):
        form = await request.form()
        path = model_dir(str(form.get("model", "")))
        tokens = int(form.get("max_new_tokens") or 64)

        def stream():
            try:
                yield from studio.workers.ask(path, str(form.get("prompt", "")), tokens)
            except ChatError as exc:
                yield f"\n[error] {exc}"

        return StreamingResponse(stream(), media_type="text/plain; charset=utf-8")
