"""What every page of the studio shares: the roots, the templates, the metrics reader, the chat workers, and
the run folders read as views."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fastapi import Request
from fastapi.templating import Jinja2Templates

from toolkit.errors import UserError
from toolkit.studio import runs
from toolkit.studio.chat import Workers
from toolkit.studio.guard import Roots, run_folder
from toolkit.studio.metrics import MetricsReader

HERE = Path(__file__).resolve().parent


@dataclass
class Studio:
    roots: Roots
    max_upload_mb: float
    templates: Jinja2Templates
    metrics: MetricsReader
    workers: Workers

    @classmethod
    def create(cls, roots: Roots, max_upload_mb: float) -> Studio:
        templates = Jinja2Templates(directory=str(HERE / "templates"))
        templates.env.globals.update(eta_text=runs.eta_text, age_text=runs.age_text)
        return cls(roots, max_upload_mb, templates, MetricsReader(), Workers())

    def page(self, request: Request, name: str, **values):
        """A whole page (`name` a template; the navigation marks the page by the template's stem)."""
        return self.templates.TemplateResponse(request, name, {"page": name.split(".")[0], **values})

    def fragment(self, request: Request, name: str, **values):
        """A part of a page its script refreshes."""
        return self.templates.TemplateResponse(request, name, values)

    def views(self) -> list[runs.RunView]:
        locks = runs.lock_table()
        return [runs.summarize(self.roots.runs, d, locks) for d in runs.run_dirs(self.roots.runs)]

    def named_run(self, name: str) -> Path:
        """The folder of the run called `name` (one the studio launched may not have made it yet)."""
        path = run_folder(name, self.roots)
        if not path.is_dir() and not runs.read_record(self.roots.runs, name):
            raise UserError(f"run {name}: no such run in {self.roots.runs}")
        return path
