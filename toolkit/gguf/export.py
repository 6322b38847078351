"""`ftkit export RUN --gguf TYPE`: the checkpoint merged as `--merge-lora` does, converted by llama.cpp's
converter (tokenizer, BOS/EOS policy and chat template included), quantized by llama.cpp's quantizer, and an
Ollama Modelfile beside it. Work happens in a hidden folder inside --out; the two files appear only when
both are complete, and no existing file is replaced."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from safetensors import safe_open
from transformers import AutoTokenizer

from toolkit.checkpoint import CONFIG, MARKER
from toolkit.checkpoint.rundir import MARKER as RUN_MARKER
from toolkit.checkpoint.save import latest_checkpoint
from toolkit.checkpoint.to_hf import export_checkpoint, run_config
from toolkit.errors import UserError
from toolkit.gguf import convert, modelfile
from toolkit.gguf.tools import INSTALL, Tools, find_tools
from toolkit.model import vision
from toolkit.model.load import local_path

logger = logging.getLogger(__name__)
# What each type is made from: the converter writes the 16-bit files, the quantizer the others from f16.
QUANT_TYPES = ("f16", "bf16", "q8_0", "q4_k_m", "q5_k_m", "q6_k")
CONVERTED = ("f16", "bf16")
GENERATION_START = re.compile(r"\{%(-?)\s*generation\s*(-?)%\}")
GENERATION_END = re.compile(r"\{%(-?)\s*endgeneration\s*(-?)%\}")


def export_gguf(
    source: Path,
    quant: str,
    out_dir: Path | None,
    llama_cpp_dir: Path | None = None,
    base_model: str | None = None,
    trust_remote_code: bool = False,
) -> str:
    """Write NAME-TYPE.gguf and NAME-TYPE.Modelfile into `out_dir` (default: RUN-gguf beside the run);
    returns a one-line summary."""
    if quant not in QUANT_TYPES:
        raise UserError(f"--gguf: unknown type {quant!r}; choose one of {', '.join(QUANT_TYPES)}")
    out_dir, gguf_file, model_file = _targets(source, quant, out_dir)
    checkpoint = _checkpoint_of(source)
    tools = find_tools(llama_cpp_dir)
    if quant not in CONVERTED and not tools.quantizer:
        raise UserError(f"--gguf {quant}: no llama.cpp quantizer (llama-quantize) found; run {INSTALL}")
    cfg = run_config(checkpoint)
    _check_base(Path(local_path(base_model or cfg.model.path)), out_dir)
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    work = out_dir / f".{gguf_file.name}.tmp"
    started = time.perf_counter()
    try:
        shutil.rmtree(work, ignore_errors=True)  # left by a killed export of this same file
        merged = work / "merged"
        export_checkpoint(checkpoint, merged, cfg.model.method != "full", None, base_model, trust_remote_code)
        written = convert_model(tools, merged, work, quant)
        tokenizer = AutoTokenizer.from_pretrained(str(merged))
        text = modelfile.modelfile(
            gguf_file.name,
            modelfile.ollama_template(tokenizer),
            modelfile.stop_tokens(merged, tokenizer),
            cfg.data.max_length,
        )
        (work / "Modelfile").write_text(text)
        _place(written, gguf_file)
        _place(work / "Modelfile", model_file)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if created and not any(out_dir.iterdir()):
            out_dir.rmdir()
    size = gguf_file.stat().st_size / 2**20
    return (
        f"exported {gguf_file} ({size:.1f} MiB, {quant}) and {model_file.name} from {checkpoint} "
        f"in {time.perf_counter() - started:.0f} s"
    )


def _targets(source: Path, quant: str, out_dir: Path | None) -> tuple[Path, Path, Path]:
    """The output folder, GGUF file and Modelfile, refused where they would replace anything."""
    run_dir = source if (source / "checkpoints").is_dir() else source.parent.parent
    out_dir = out_dir or run_dir.with_name(f"{run_dir.name}-gguf")
    for parent in [out_dir.absolute(), *out_dir.absolute().parents]:
        if (parent / RUN_MARKER).is_file() or (parent / MARKER).is_file():
            raise UserError(f"--out: {out_dir} is or lies inside a training run ({parent}); export elsewhere")
    files = out_dir / f"{run_dir.name}-{quant}.gguf", out_dir / f"{run_dir.name}-{quant}.Modelfile"
    for path in files:
        if path.exists():
            raise UserError(
                f"--out: {path} exists; ftkit never replaces it (move it or choose another --out)"
            )
    return (out_dir, *files)


def _checkpoint_of(source: Path) -> Path:
    """A checkpoint given as itself or as its run (then the newest complete one)."""
    if (source / "checkpoints").is_dir():
        latest = latest_checkpoint(source)
        if latest is None:
            raise UserError(f"{source}: the run has no complete checkpoint to export")
        return latest
    if not (source / CONFIG).is_file() and not (source.parent.parent / CONFIG).is_file():
        raise UserError(f"{source}: neither a run directory nor one of its checkpoints")
    return source


def _check_base(base_dir: Path, out_dir: Path) -> None:
    """Refuse before writing anything a vision-language model, and a disk where the merged model, the f16
    file and the quantized one (at most as large) will not fit: 4 + 2 + 2 bytes a parameter."""
    config = base_dir / "config.json"
    if config.is_file() and vision.is_vision(json.loads(config.read_text()).get("model_type")):
        raise UserError(
            "--gguf: a vision-language run; ftkit does not write the projector file (mmproj) llama.cpp "
            "loads beside it, so export it with --merge-lora instead"
        )
    params = 0
    for file in base_dir.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                shape = handle.get_slice(name).get_shape()
                params += math.prod(shape)
    existing = next(p for p in [out_dir, *out_dir.absolute().parents] if p.exists())
    free, needed = shutil.disk_usage(existing).free, params * 8
    if free < needed:
        raise UserError(
            f"--out: {out_dir} has {free / 2**30:.1f} GiB free; the merged model and its f16 file need about "
            f"{needed / 2**30:.1f} GiB"
        )


def _prepare_tokenizer(merged: Path, tokenizer) -> None:
    """What the converter copies into the GGUF file, set as training used it.

    BOS/EOS: training tokenized the rendered chat template without adding special tokens, so the file's
    tokenizer adds a BOS exactly where the template writes one, and never an EOS. llama.cpp's chat path
    renders the embedded template (BOS included) and adds nothing; Ollama renders the Modelfile's template,
    which has no BOS, and adds one where the file says so: BOS once either way, or not at all.
    The template: transformers' {% generation %} markers (which only locate the trained tokens) become
    always-true blocks, which llama.cpp's and Ollama's Jinja engines read and which render the same text."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    bos = tokenizer.bos_token
    path = merged / "tokenizer_config.json"
    settings = json.loads(path.read_text())
    settings["add_bos_token"] = bool(bos) and rendered.startswith(bos)
    settings["add_eos_token"] = False
    settings["chat_template"] = GENERATION_END.sub(
        r"{%\1 endif \2%}", GENERATION_START.sub(r"{%\1 if true \2%}", tokenizer.chat_template)
    )
    path.write_text(json.dumps(settings, indent=2))


def convert_model(tools: Tools, merged: Path, work: Path, quant: str) -> Path:
    """The Hugging Face model in `merged` (its tokenizer files adjusted in place) as a GGUF file of type
    `quant`, written in `work`."""
    _prepare_tokenizer(merged, AutoTokenizer.from_pretrained(str(merged)))
    half = "bf16" if quant == "bf16" else "f16"
    converted = work / f"model-{half}.gguf"
    command = [sys.executable, "-m", "toolkit.gguf.convert", str(tools.converter)]
    command += ["--outtype", half, "--outfile", str(converted), str(merged)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode == convert.UNSUPPORTED:
        raise UserError(f"--gguf: {result.stdout.strip().splitlines()[-1]}")
    if result.returncode != 0:
        raise RuntimeError(f"llama.cpp's converter failed:\n{result.stderr[-4000:]}")
    if quant in CONVERTED:
        return converted
    quantized = work / f"model-{quant}.gguf"
    result = subprocess.run(
        [*tools.quantizer, str(converted), str(quantized), quant.upper()], capture_output=True, text=True
    )
    said = result.stdout + result.stderr
    if result.returncode != 0 or not quantized.is_file():
        raise RuntimeError(f"llama.cpp's quantizer failed:\n{said[-4000:]}")
    converted.unlink()
    fallbacks = re.findall(r"falling back to\s+(\w+)", said)
    if fallbacks:  # k-quants store rows in blocks of 256: llama.cpp gives narrower tensors another type
        logger.warning(
            "%d tensors have rows that are not a multiple of 256; llama.cpp stored them as %s",
            len(fallbacks),
            " or ".join(sorted(set(fallbacks))),
        )
    return quantized


def _place(path: Path, target: Path) -> None:
    """Move into place without replacing: a hard link fails where `target` appeared meanwhile."""
    os.link(path, target)
    path.unlink()
