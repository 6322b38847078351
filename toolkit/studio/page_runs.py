"""The Runs, Run and Compare pages, their live parts, and Stop, Resume and Delete."""

from __future__ import annotations

from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse

from toolkit.grpo import samples
from toolkit.studio import runner, runs
from toolkit.studio.context import Studio
from toolkit.studio.guard import run_folder


def add_routes(router: FastAPI, studio: Studio) -> None:
    """This page's routes, on the app itself (so every route is the app's own, as its tests list them)."""

    @router.get("/", response_class=HTMLResponse)
    def runs_page(request: Request):
        return studio.page(request, "runs.html", runs=studio.views(), root=studio.roots.runs)

    @router.get("/fragment/runs", response_class=HTMLResponse)
    def runs_rows(request: Request):
        return studio.fragment(request, "runs_rows.html", runs=studio.views())

    @router.get("/run/{name}", response_class=HTMLResponse)
    def run_page(request: Request, name: str, message: str = ""):
        run_dir = studio.named_run(name)
        view = runs.summarize(studio.roots.runs, run_dir)
        config = (run_dir / "config.yaml").read_text() if (run_dir / "config.yaml").is_file() else ""
        rounds = samples.read(run_dir)  # a GRPO run's sample rollouts, newest round first
        return studio.page(request, "run.html", run=view, config=config, message=message, rounds=rounds)

    @router.get("/fragment/run/{name}", response_class=HTMLResponse)
    def run_head(request: Request, name: str):
        view = runs.summarize(studio.roots.runs, studio.named_run(name))
        log = runs.log_tail(studio.roots.runs, name, 8192)
        return studio.fragment(request, "run_head.html", run=view, log=log)

    @router.get("/api/metrics/{name}")
    def run_metrics(name: str):
        series, lines = studio.metrics.series(studio.named_run(name) / "metrics.jsonl")
        return JSONResponse({"name": name, "series": series, "lines": lines})

    @router.post("/run/{name}/stop")
    def stop(name: str):
        done = runs.stop_run(studio.roots.runs, studio.named_run(name))
        return RedirectResponse(f"/run/{name}?message={quote(done)}", status_code=303)

    @router.post("/run/{name}/resume")
    def resume(name: str):
        runner.resume(studio.roots.runs, studio.named_run(name))
        return RedirectResponse(f"/run/{name}?message=resumed", status_code=303)

    @router.post("/run/{name}/delete")
    async def delete(request: Request, name: str):
        form = await request.form()
        runner.delete(studio.roots.runs, run_folder(name, studio.roots), str(form.get("confirm", "")))
        return RedirectResponse("/", status_code=303)

    @router.get("/compare", response_class=HTMLResponse)
    def compare(request: Request):
        chosen = [n for n in request.query_params.getlist("run") if (studio.roots.runs / n).is_dir()]
        return studio.page(request, "compare.html", runs=studio.views(), chosen=chosen)
