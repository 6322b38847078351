"""`ftkit studio`: check the options, build the app, serve it until Ctrl-C."""

from __future__ import annotations

import argparse
from pathlib import Path

from toolkit.errors import UserError

DEFAULT_PORT = 7860


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", default="runs", help="the runs folder (default: runs/ here)")
    parser.add_argument(
        "--data-root", default=".", help="the folder models and data may be read from (default: here)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}")
    parser.add_argument(
        "--token", action="store_true", help="require a token, printed at start (needed off loopback)"
    )
    parser.add_argument("--password-file", help="require the secret this file holds (needed off loopback)")
    parser.add_argument("--max-upload-mb", type=float, default=64.0, help="largest JSONL upload (default 64)")


def studio_cli(args) -> int:
    from toolkit.studio.guard import Roots, allowed_hosts, server_token

    secret = server_token(args.host, args.token, args.password_file)
    runs_root, data_root = Path(args.runs).expanduser(), Path(args.data_root).expanduser()
    if runs_root.exists() and not runs_root.is_dir():
        raise UserError(f"--runs: {runs_root} is a file, not a folder")
    if not data_root.is_dir():
        raise UserError(f"--data-root: {data_root} is not a folder")
    if not 0 < args.port < 65536:
        raise UserError(f"--port: {args.port} is not a port number")
    runs_root.mkdir(parents=True, exist_ok=True)
    import uvicorn

    from toolkit.studio.app import create_app

    roots = Roots(runs_root.resolve(), data_root.resolve())
    app = create_app(roots, secret, allowed_hosts(args.host, args.port), args.max_upload_mb)
    shown = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{shown}:{args.port}/" + (f"?token={secret}" if secret and args.token else "")
    print(f"ftkit studio: {roots.runs} on {url}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
