"""The studio's rules for strangers: loopback unless authenticated, requests that change anything only from
the page's own origin, every path inside the runs folder or the data folder, uploads capped."""

from __future__ import annotations

import hmac
import ipaddress
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from toolkit.errors import UserError

COOKIE = "ftkit_studio_token"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


@dataclass(frozen=True)
class Roots:
    runs: Path
    """Where run folders are (resolved)."""
    data: Path
    """The folder whose files the page may read as models and data (resolved)."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def server_token(host: str, token: bool, password_file: str | None) -> str | None:
    """The secret every request must carry: none on loopback unless asked; refused elsewhere without one."""
    if password_file:
        try:
            secret = Path(password_file).read_text().strip()
        except OSError as exc:
            raise UserError(f"--password-file: cannot read {password_file}: {exc.strerror}") from None
        if len(secret) < 8:
            raise UserError(f"--password-file: {password_file} holds fewer than 8 characters")
        return secret
    if token:
        return secrets.token_urlsafe(24)
    if not is_loopback(host):
        raise UserError(
            f"--host {host}: other machines could reach the studio; add --token (a token printed at "
            "start) or --password-file FILE"
        )
    return None


def token_matches(given: str | None, secret: str | None) -> bool:
    return secret is None or (given is not None and hmac.compare_digest(given.encode(), secret.encode()))


def allowed_hosts(host: str, port: int) -> set[str]:
    """Host headers the server answers: its own names, so that a page on another site whose name was
    pointed at this address (DNS rebinding) is refused."""
    names = {host, "127.0.0.1", "localhost", "[::1]"} if is_loopback(host) else {host}
    if host in ("0.0.0.0", "::"):
        return set()  # any name reaches it; the token guards it
    return {f"{name}:{port}" for name in names} | names


def cross_origin(method: str, headers, hosts: set[str]) -> str:
    """Why a request is refused as coming from another site ("" when it is the page's own, or one that
    changes nothing)."""
    host = headers.get("host", "")
    if hosts and host not in hosts:
        return f"Host {host!r} is not this studio's address"
    if method in SAFE_METHODS:
        return ""
    if headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        return f"a {headers['sec-fetch-site']} request may not change anything"
    origin = headers.get("origin") or _origin_of(headers.get("referer", ""))
    if origin and urlsplit(origin).netloc != host:
        return f"origin {origin} is not this studio's"
    return ""


def _origin_of(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}" if parts.netloc else ""


def inside(path: str | Path, roots: Roots, key: str, must_exist: bool = True) -> Path:
    """`path` (relative to the data folder) resolved, symlinks followed; refused in one line unless it lies
    under the runs folder or the data folder."""
    text = str(path).strip()
    if not text:
        raise UserError(f"{key}: empty")
    candidate = Path(text).expanduser()
    resolved = (candidate if candidate.is_absolute() else roots.data / candidate).resolve()
    if not any(resolved.is_relative_to(root) for root in (roots.runs, roots.data)):
        raise UserError(
            f"{key}: {text} lies outside the runs folder ({roots.runs}) and the data folder ({roots.data})"
        )
    if must_exist and not resolved.exists():
        raise UserError(f"{key}: {text} does not exist")
    return resolved


def run_folder(name: str, roots: Roots) -> Path:
    """A run's folder by its name: one plain name directly under the runs folder."""
    if not RUN_NAME.match(name or ""):
        raise UserError(
            f"name: {name!r} is not a run name (letters, digits, '.', '_' and '-', starting with a letter "
            "or digit)"
        )
    path = (roots.runs / name).resolve()
    if path.parent != roots.runs:
        raise UserError(f"name: {name} leads outside the runs folder ({roots.runs})")
    return path
