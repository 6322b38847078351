"""The studio's web app: server-rendered pages (templates/, one module a tab: page_*.py), a little script of
its own (static/) and the JSON routes it polls. Every route is written in those modules and passes the
middleware below: none is added behind the page's back (FastAPI's own /docs and /openapi.json are off)."""

from __future__ import annotations

import threading
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from fastapi.staticfiles import StaticFiles
from starlette.formparsers import MultiPartParser

from toolkit.errors import UserError
from toolkit.studio import page_chat, page_new, page_runs, page_tools
from toolkit.studio.context import HERE, Studio
from toolkit.studio.guard import COOKIE, Roots, cross_origin, token_matches

REAP_S = 30.0


def create_app(roots: Roots, secret: str | None, hosts: set[str], max_upload_mb: float = 64) -> FastAPI:
    studio = Studio.create(roots, max_upload_mb)

    @asynccontextmanager
    async def lifespan(app):
        yield
        studio.workers.close_all()

    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    # An upload up to the cap stays in memory while the form is read: nothing of it lands outside the runs
    # folder (starlette spools larger parts to the system's temp folder).
    MultiPartParser.spool_max_size = int(max_upload_mb * 2**20) + 1
    app.mount("/static", StaticFiles(directory=str(HERE / "static")), name="static")
    app.middleware("http")(guard(secret, hosts, max_upload_mb))
    app.exception_handler(UserError)(one_line)
    for page in (page_runs, page_new, page_chat, page_tools):
        page.add_routes(app, studio)
    threading.Thread(target=reap, args=(studio,), daemon=True).start()
    return app


def guard(secret: str | None, hosts: set[str], max_upload_mb: float):
    """The middleware every request passes: its origin and host, its size, its secret."""

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

    return strangers


async def one_line(request: Request, exc: UserError):
    """A mistake a request made: the CLI's one line, status 400."""
    return PlainTextResponse(f"{exc}\n", status_code=400)


def reap(studio: Studio) -> None:
    """End the chat workers left idle."""
    while True:
        time.sleep(REAP_S)
        studio.workers.close_idle()
