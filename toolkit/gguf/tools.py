"""Where llama.cpp's converter and quantizer come from, decided once: the `export` extra installs
llama-cpp-python (it builds llama.cpp, quantizer included), and `python -m toolkit.gguf.tools` copies the
converter that ships inside the same release's source archive into ftkit's cache. `--llama-cpp DIR` (a
llama.cpp checkout, built or not) replaces both. Nothing is downloaded while exporting."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from toolkit.errors import UserError

PACKAGE = "llama-cpp-python"
INSTALL = (
    "make install-export (or: pip install -c constraints.txt -e '.[export]' && python -m toolkit.gguf.tools)"
)
# What the converter needs from a llama.cpp tree: the script, its model classes and its own gguf package.
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/")


@dataclass
class Tools:
    converter: Path
    """A llama.cpp directory holding convert_hf_to_gguf.py, conversion/ and gguf-py/."""
    quantizer: list[str]
    """The command that quantizes: SRC DST TYPE follow."""


def find_tools(llama_cpp_dir: Path | None) -> Tools:
    """The converter and quantizer to use, or one line saying what to install."""
    if llama_cpp_dir is not None:
        return _from_checkout(llama_cpp_dir)
    version = _installed_version()
    if version is None:
        raise UserError(f"--gguf: llama.cpp is not installed here; run {INSTALL}, or pass --llama-cpp DIR")
    converter = cache_dir(version)
    if not (converter / "convert_hf_to_gguf.py").is_file():
        raise UserError(
            f"--gguf: {PACKAGE} {version} is installed but its converter is not in {converter}; "
            "run python -m toolkit.gguf.tools"
        )
    return Tools(converter, [sys.executable, "-m", "toolkit.gguf.quantize"])


def _from_checkout(root: Path) -> Tools:
    if not (root / "convert_hf_to_gguf.py").is_file():
        raise UserError(f"--llama-cpp: {root} has no convert_hf_to_gguf.py; pass a llama.cpp checkout")
    built = [root / "build" / "bin" / "llama-quantize", root / "llama-quantize"]
    binary = next((str(p) for p in built if p.is_file()), None) or shutil.which("llama-quantize")
    if binary:
        return Tools(root, [binary])
    if _installed_version():
        return Tools(root, [sys.executable, "-m", "toolkit.gguf.quantize"])
    return Tools(root, [])


def _installed_version() -> str | None:
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        return None


def cache_dir(version: str) -> Path:
    """Where the converter of llama-cpp-python `version` is kept (one per release, never mixed)."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "ftkit" / f"llama.cpp-{PACKAGE}-{version}"


def install_converter(version: str, sdist: Path | None = None) -> Path:
    """Copy the converter out of llama-cpp-python's source archive (pip's cache makes the download, when
    `sdist` is not given, free after `pip install` built the package)."""
    target = cache_dir(version)
    if (target / "convert_hf_to_gguf.py").is_file():
        return target
    with tempfile.TemporaryDirectory() as scratch:
        if sdist is None:
            pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
            subprocess.run([*pip, "-d", scratch, f"{PACKAGE}=={version}"], check=True)
            sdist = next(Path(scratch).glob("*.tar.gz"))
        partial = Path(scratch) / "llama.cpp"
        _extract_converter(sdist, partial)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(partial), target)
    return target


def _extract_converter(sdist: Path, out: Path) -> None:
    """Regular files only, under vendor/llama.cpp/, so the archive cannot write outside `out`."""
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            _, _, inside = member.name.partition("/vendor/llama.cpp/")
            if not member.isfile() or not inside.startswith(CONVERTER_PARTS) or ".." in inside.split("/"):
                continue
            (out / inside).parent.mkdir(parents=True, exist_ok=True)
            (out / inside).write_bytes(archive.extractfile(member).read())
    if not (out / "convert_hf_to_gguf.py").is_file():
        raise RuntimeError(f"{sdist}: no vendor/llama.cpp/convert_hf_to_gguf.py inside")


if __name__ == "__main__":
    installed = _installed_version()
    if installed is None:
        sys.exit(f"{PACKAGE} is not installed; pip install -c constraints.txt -e '.[export]' first")
    given = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    print(install_converter(installed, given))
