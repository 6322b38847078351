"""The New run page: the form checked (Check) and started (Start), an uploaded JSONL as its data."""

from __future__ import annotations

import json
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse

from toolkit.errors import UserError
from toolkit.studio import runner, runs
from toolkit.studio.context import Studio
from toolkit.studio.guard import Roots, run_folder

UPLOAD_DIR = "uploads"


def add_routes(router: FastAPI, studio: Studio) -> None:
    """This page's routes, on the app itself (so every route is the app's own, as its tests list them)."""

    def choices() -> dict:
        from toolkit.commands.train import backend_names

        return {
            "recipes": list(runner.RECIPES),
            "methods": runner.METHODS,
            "backends": ["auto", *backend_names()],
        }

    @router.get("/new", response_class=HTMLResponse)
    def new_page(request: Request):
        return studio.page(request, "new.html", form=runner.NewRun(), shown=None, **choices())

    @router.post("/new", response_class=HTMLResponse)
    async def new_submit(request: Request):
        data = await request.form()
        form = runner.NewRun.from_form(data)
        upload, written = data.get("upload"), None
        if upload is not None and getattr(upload, "filename", ""):
            cap_mb = studio.max_upload_mb
            try:
                written = save_upload(
                    studio.roots, form.name, await upload.read(int(cap_mb * 2**20) + 1), cap_mb
                )
            except UserError as exc:
                shown = runner.Preview(errors={"upload": str(exc)})
                return studio.page(request, "new.html", form=form, shown=shown, **choices())
            form.data = str(written)
        starting = data.get("action") == "start"
        shown = (runner.start if starting else runner.preview)(form, studio.roots)
        if written and shown.errors:
            written.unlink(missing_ok=True)  # nothing is kept from a form with a mistake
            form.data = ""
        if starting and not shown.errors:
            return RedirectResponse(f"/run/{form.name}?message=started", status_code=303)
        return studio.page(request, "new.html", form=form, shown=shown, **choices())


def save_upload(roots: Roots, name: str, content: bytes, cap_mb: float) -> Path:
    """An uploaded JSONL, checked line by line, as RUNS/.studio/uploads/NAME.jsonl."""
    run_folder(name, roots)  # the upload is named after the run
    if len(content) > cap_mb * 2**20:
        raise UserError(f"upload: larger than {cap_mb:g} MiB (--max-upload-mb)")
    for number, line in enumerate(content.decode(errors="replace").splitlines(), start=1):
        try:
            if line.strip():
                json.loads(line)
        except ValueError as exc:
            raise UserError(f"upload: line {number}: not valid JSON ({exc})") from None
    folder = roots.runs / runs.STUDIO_DIR / UPLOAD_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.jsonl"
    path.write_bytes(content)
    return path
