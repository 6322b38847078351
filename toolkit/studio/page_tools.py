"""The Evaluate & export page: `ftkit eval` and `ftkit export` jobs of a run, and their output."""

from __future__ import annotations

from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse

from toolkit.studio import jobs
from toolkit.studio.context import Studio


def add_routes(router: FastAPI, studio: Studio) -> None:
    """This page's routes, on the app itself (so every route is the app's own, as its tests list them)."""

    @router.get("/tools", response_class=HTMLResponse)
    def tools_page(request: Request, run: str = ""):
        usable = [v for v in studio.views() if v.checkpoints or v.status == "finished"]
        listed = jobs.list_jobs(studio.roots.runs, run) if run else []
        return studio.page(request, "tools.html", runs=usable, run=run, jobs=listed, gguf=jobs.gguf_missing())

    @router.post("/tools/{name}")
    async def tools_start(request: Request, name: str):
        form = await request.form()
        run_dir = studio.named_run(name)
        if form.get("action") == "eval":
            jobs.start_eval(studio.roots, run_dir, str(form.get("tasks", "")), str(form.get("limit", "")))
        else:
            jobs.start_export(studio.roots, run_dir, str(form.get("kind", "merged")))
        return RedirectResponse(f"/tools?run={quote(name)}", status_code=303)

    @router.get("/fragment/jobs/{name}", response_class=HTMLResponse)
    def jobs_rows(request: Request, name: str):
        studio.named_run(name)
        return studio.fragment(request, "jobs.html", jobs=jobs.list_jobs(studio.roots.runs, name))
