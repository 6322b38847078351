"""Image references: where a record's image lives, and opening it.

A reference is what a record gave (`formats.to_example` lists them): a path, relative to the data file's
folder, a file:// URL, or a data:image/...;base64 URL. `resolve_image` turns it into a canonical one (an
absolute path or the data URL) before training starts, so a missing file fails the data build, not step
900. Remote URLs are refused rather than downloaded: a download per step would stall training and make
the run depend on a server. Decoding is PIL's, restricted to plain raster formats, so no image runs code
(EPS, for one, would start Ghostscript).
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import re
from pathlib import Path
from urllib.parse import unquote, urlparse

from PIL import Image

from toolkit.errors import UserError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
# Any scheme://, so s3:// or hf:// get the same answer as http(s):// rather than "file not found".
REMOTE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
DATA_URL = re.compile(r"^data:image/[A-Za-z0-9.+-]+;base64,", re.IGNORECASE)
SHOWN = 60
"""A data URL is cut to this many characters in messages (they run to megabytes)."""


def resolve_image(ref: str, base_dir: Path | None, where: str) -> str:
    """The canonical form of `ref`: an absolute path of an existing file, or the data URL unchanged. A
    relative path starts from `base_dir` (the data file's folder; None: the current directory)."""
    if ref.startswith("data:"):
        _check_data_url(ref, where)
        return ref
    if ref.lower().startswith("file://"):
        url = urlparse(ref)
        if url.netloc not in ("", "localhost"):
            raise UserError(
                f"{where}: image {ref}: a file URL must not name a host; write file:///absolute/path"
            )
        path = Path(unquote(url.path))
    elif REMOTE.match(ref):
        raise UserError(
            f"{where}: image {_shown(ref)}: remote images are not downloaded during training; "
            "fetch them and give the local path"
        )
    else:
        path = Path(ref).expanduser()
    if not path.is_absolute():
        path = (base_dir or Path.cwd()) / path
    path = path.resolve()
    if not path.is_file():
        raise UserError(f"{where}: image {_shown(ref)}: file not found ({path})")
    return str(path)


def open_image(ref: str, where: str, max_pixels: int | None = None) -> Image.Image:
    """The RGB image at canonical reference `ref` (see `resolve_image`), fully decoded so a corrupt file
    fails here, with its name; with `max_pixels`, shrunk to at most that many pixels."""
    source = _data_bytes(ref, where) if ref.startswith("data:") else ref
    try:
        with Image.open(source, formats=FORMATS) as image:
            # PIL decodes lazily; decode every byte here, where a corrupt file can be named.
            image.load()
            rgb = image.convert("RGB")
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as exc:
        reason = " ".join(str(exc).split())
        raise UserError(
            f"{where}: image {_shown(ref)}: not a readable {', '.join(FORMATS)} image ({reason})"
        ) from None
    return _within(rgb, max_pixels) if max_pixels is not None else rgb


def _within(image: Image.Image, max_pixels: int) -> Image.Image:
    """`image` scaled down, aspect kept, to at most `max_pixels` pixels (each side at least 1), so one huge
    screenshot cannot fill the sequence with image tokens."""
    width, height = image.size
    if width * height <= max_pixels:
        return image
    scale = math.sqrt(max_pixels / (width * height))
    new_width, new_height = max(1, int(width * scale)), max(1, int(height * scale))
    # A side held at 1 pixel leaves the other less room; float rounding may overshoot by a pixel row.
    new_width = min(new_width, max(1, max_pixels // new_height))
    new_height = min(new_height, max(1, max_pixels // new_width))
    return image.resize((new_width, new_height), Image.Resampling.LANCZOS)


def _check_data_url(ref: str, where: str) -> None:
    if not DATA_URL.match(ref):
        raise UserError(f"{where}: image {_shown(ref)}: a data URL must read data:image/<type>;base64,<data>")


def _data_bytes(ref: str, where: str) -> io.BytesIO:
    _check_data_url(ref, where)
    payload = "".join(ref.partition(",")[2].split())
    try:
        return io.BytesIO(base64.b64decode(payload, validate=True))
    except binascii.Error as exc:
        raise UserError(f"{where}: image {_shown(ref)}: the base64 data is invalid ({exc})") from None


def _shown(ref: str) -> str:
    return f"{ref[:SHOWN]}..." if ref.startswith("data:") and len(ref) > SHOWN else ref
