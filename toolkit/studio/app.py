"""The studio's web app: server-rendered pages (templates/), a little script of its own (static/) and JSON
routes the script polls. Every route is written here: none is added behind the page's back."""

from __future__ import annotations

import json
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    StreamingResponse,
)
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from starlette.formparsers import MultiPartParser

from toolkit.errors import UserError
from toolkit.studio import chat, jobs, runner, runs
from toolkit.studio.guard import COOKIE, Roots, cross_origin, inside, run_folder, token_matches
from toolkit.studio.metrics import MetricsReader

HERE = Path(__file__).resolve().parent
UPLOAD_DIR = "uploads"


def create_app(roots: Roots, secret: str | None, hosts: set[str], max_upload_mb: float = 64) -> FastAPI:
    workers = chat.Workers()

    @asynccontextmanager
    async def lifespan(app):
        yield
        workers.close_all()

    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    templates = Jinja2Templates(directory=str(HERE / "templates"))
    templates.env.globals.update(eta_text=runs.eta_text, age_text=runs.age_text)
    metrics = MetricsReader()
    # An upload up to the cap stays in memory while the form is read: nothing of it lands outside the runs
    # folder (starlette spools larger parts to the system's temp folder).
    MultiPartParser.spool_max_size = int(max_upload_mb * 2**20) + 1
    app.mount("/static", StaticFiles(directory=str(HERE / "static")), name="static")

    @app.middleware("http")
    async def strangers(request: Request, call_next):
        refused = cross_origin(request.method, request.headers, hosts)
        if refused:
            return PlainTextResponse(f"refused: {refused}\n", status_code=403)
        if int(request.headers.get("content-length") or 0) > (max_upload_mb + 1) * 2**20:
            return PlainTextResponse(f"refused: larger than {max_upload_mb:g} MiB (--max-upload-mb)\n", 413)
        given = request.query_params.get("token") or request.cookies.get(COOKIE)
        bearer = request.headers.get("authorization", "")
        if bearer.startswith("Bearer "):
            given = bearer.removeprefix("Bearer ")
        if not token_matches(given, secret):
            return PlainTextResponse("refused: this studio needs its token (printed when it started)\n", 401)
        response = await call_next(request)
        if secret and request.query_params.get("token"):
            response.set_cookie(COOKIE, secret, httponly=True, samesite="strict")
        return response

    def page(request: Request, name: str, **values):
        return templates.TemplateResponse(request, name, {"page": name.split(".")[0], **values})

    def views() -> list[runs.RunView]:
        locks = runs.lock_table()
        return [runs.summarize(roots.runs, d, locks) for d in runs.run_dirs(roots.runs)]

    def named_run(name: str) -> Path:
        path = run_folder(name, roots)
        if not path.is_dir() and not runs.read_record(roots.runs, name):
            raise UserError(f"run {name}: no such run in {roots.runs}")
        return path

    @app.exception_handler(UserError)
    async def user_error(request: Request, exc: UserError):
        return PlainTextResponse(f"{exc}\n", status_code=400)

    @app.get("/", response_class=HTMLResponse)
    def runs_page(request: Request):
        return page(request, "runs.html", runs=views(), root=roots.runs)

    @app.get("/fragment/runs", response_class=HTMLResponse)
    def runs_rows(request: Request):
        return templates.TemplateResponse(request, "runs_rows.html", {"runs": views()})

    @app.get("/run/{name}", response_class=HTMLResponse)
    def run_page(request: Request, name: str, message: str = ""):
        run_dir = named_run(name)
        view = runs.summarize(roots.runs, run_dir)
        config = (run_dir / "config.yaml").read_text() if (run_dir / "config.yaml").is_file() else ""
        return page(request, "run.html", run=view, config=config, message=message)

    @app.get("/fragment/run/{name}", response_class=HTMLResponse)
    def run_head(request: Request, name: str):
        view = runs.summarize(roots.runs, named_run(name))
        log = runs.log_tail(roots.runs, name, 8192)
        return templates.TemplateResponse(request, "run_head.html", {"run": view, "log": log})

    @app.get("/api/metrics/{name}")
    def run_metrics(name: str):
        series, lines = metrics.series(named_run(name) / "metrics.jsonl")
        return JSONResponse({"name": name, "series": series, "lines": lines})

    @app.post("/run/{name}/stop")
    def stop(name: str):
        done = runs.stop_run(roots.runs, named_run(name))
        return RedirectResponse(f"/run/{name}?message={quote(done)}", status_code=303)

    @app.post("/run/{name}/resume")
    def resume(name: str):
        runner.resume(roots.runs, named_run(name))
        return RedirectResponse(f"/run/{name}?message=resumed", status_code=303)

    @app.post("/run/{name}/delete")
    async def delete(request: Request, name: str):
        form = await request.form()
        runner.delete(roots.runs, run_folder(name, roots), str(form.get("confirm", "")))
        return RedirectResponse("/", status_code=303)

    @app.get("/new", response_class=HTMLResponse)
    def new_page(request: Request):
        return page(request, "new.html", form=runner.NewRun(), shown=None, **choices())

    @app.post("/new", response_class=HTMLResponse)
    async def new_submit(request: Request):
        data = await request.form()
        form = runner.NewRun.from_form(data)
        upload = data.get("upload")
        written = None
        if upload is not None and getattr(upload, "filename", ""):
            try:
                written = save_upload(roots, form.name, await upload.read(int(max_upload_mb * 2**20) + 1))
            except UserError as exc:
                shown = runner.Preview(errors={"upload": str(exc)})
                return page(request, "new.html", form=form, shown=shown, **choices())
            form.data = str(written)
        act = runner.start if data.get("action") == "start" else runner.preview
        shown = act(form, roots)
        if written and shown.errors:
            written.unlink(missing_ok=True)  # nothing is kept from a form with a mistake
            form.data = ""
        if data.get("action") == "start" and not shown.errors:
            return RedirectResponse(f"/run/{form.name}?message=started", status_code=303)
        return page(request, "new.html", form=form, shown=shown, **choices())

    def save_upload(roots: Roots, name: str, content: bytes) -> Path:
        run_folder(name, roots)  # the upload is named after the run
        if len(content) > max_upload_mb * 2**20:
            raise UserError(f"upload: larger than {max_upload_mb:g} MiB (--max-upload-mb)")
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

    def choices() -> dict:
        from toolkit.commands.train import backend_names

        return {
            "recipes": list(runner.RECIPES),
            "methods": runner.METHODS,
            "backends": ["auto", *backend_names()],
        }

    @app.get("/compare", response_class=HTMLResponse)
    def compare(request: Request):
        chosen = [n for n in request.query_params.getlist("run") if (roots.runs / n).is_dir()]
        return page(request, "compare.html", runs=views(), chosen=chosen)

    def chat_models() -> list[tuple[str, str]]:
        found = []
        for view in views():
            if (roots.runs / view.name / "final").is_dir():
                found.append((f"run:{view.name}", f"{view.name} (fine-tuned)"))
            if view.model:
                found.append((f"path:{view.model}", f"{view.model} (base of {view.name})"))
        return list(dict.fromkeys(found))

    def model_dir(choice: str) -> Path:
        kind, _, value = choice.partition(":")
        if kind == "run":
            return named_run(value) / "final"
        return inside(value, roots, "model")

    @app.get("/chat", response_class=HTMLResponse)
    def chat_page(request: Request):
        return page(request, "chat.html", models=chat_models(), loaded=workers.loaded())

    @app.post("/api/chat")
    async def chat_answer(request: Request):
        form = await request.form()
        path = model_dir(str(form.get("model", "")))
        tokens = int(form.get("max_new_tokens") or 64)

        def stream():
            try:
                yield from workers.ask(path, str(form.get("prompt", "")), tokens)
            except chat.ChatError as exc:
                yield f"\n[error] {exc}"

        return StreamingResponse(stream(), media_type="text/plain; charset=utf-8")

    @app.get("/tools", response_class=HTMLResponse)
    def tools_page(request: Request, run: str = ""):
        finished = [v for v in views() if v.checkpoints or v.status == "finished"]
        listed = jobs.list_jobs(roots.runs, run) if run else []
        return page(request, "tools.html", runs=finished, run=run, jobs=listed, gguf=jobs.gguf_missing())

    @app.post("/tools/{name}")
    async def tools_start(request: Request, name: str):
        form = await request.form()
        run_dir = named_run(name)
        if form.get("action") == "eval":
            jobs.start_eval(roots, run_dir, str(form.get("tasks", "")), str(form.get("limit", "")))
        else:
            jobs.start_export(roots, run_dir, str(form.get("kind", "merged")))
        return RedirectResponse(f"/tools?run={quote(name)}", status_code=303)

    @app.get("/fragment/jobs/{name}", response_class=HTMLResponse)
    def jobs_rows(request: Request, name: str):
        named_run(name)
        return templates.TemplateResponse(request, "jobs.html", {"jobs": jobs.list_jobs(roots.runs, name)})

    def reap():
        while True:
            time.sleep(30)
            workers.close_idle()

    threading.Thread(target=reap, daemon=True).start()
    return app
