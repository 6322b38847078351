"""A hub model's config.json for `ftkit plan`: from the local Hugging Face cache, else, when the machine is
online, fetched alone from the hub (a few kilobytes; no weights, no code). The caller reads it as JSON."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import errors

from toolkit.errors import UserError

CACHE = "local Hugging Face cache"
HUB = "Hugging Face hub"
# A missing repository or file, a refused or broken connection, a malformed id: all the user's to fix.
_FAILURES = (OSError, ValueError, errors.EntryNotFoundError, errors.HTTPError)


def config_json(model: str, known: list[str]) -> tuple[Path, str]:
    """(path of `model`'s config.json, where it came from). `known` (the built-in ids) goes into the message
    when the id can be found nowhere."""
    from huggingface_hub import constants, hf_hub_download

    try:
        return Path(hf_hub_download(model, "config.json", local_files_only=True)), CACHE
    except _FAILURES:
        pass
    missing = f"--model {model}: no such path, not in the built-in table, not in the {CACHE}"
    where = f"(built in: {', '.join(known)}; or pass a directory holding config.json)"
    if constants.HF_HUB_OFFLINE:
        raise UserError(f"{missing}, and HF_HUB_OFFLINE is set {where}")
    try:
        return Path(hf_hub_download(model, "config.json")), HUB
    except _FAILURES as exc:
        raise UserError(f"{missing}, and {_why(exc)} {where}") from None


def _why(exc: Exception) -> str:
    """The fetch's failure in words: the hub's own messages span several lines and a request id."""
    if isinstance(exc, errors.GatedRepoError):
        return "it is gated on the hub (accept its terms there, then `hf auth login`)"
    if isinstance(exc, errors.RepositoryNotFoundError):
        return "the hub has no such model (or it is private: `hf auth login`)"
    if isinstance(exc, errors.RemoteEntryNotFoundError):
        return "its hub repository has no config.json"
    if isinstance(exc, errors.HFValidationError):
        return "it is not a hub id (owner/name)"
    return "the hub could not be reached"
