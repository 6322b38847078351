"""Pickled checkpoint files read without running code.

DeepSpeed's loaders and torch.distributed.checkpoint unpickle freely, and a pickle can call any function
while it loads. Every pickle they would read is first read here under an allow-list of the plain types
those writers store; a file that needs anything else is refused, naming the file and what it asked for.
"""

from __future__ import annotations

import collections
import functools
import io
import pickle
import re
from pathlib import Path

import torch

from toolkit.errors import UserError

DCP_METADATA = ".metadata"


def deepspeed_types() -> list:
    """Classes DeepSpeed pickles beside tensors in its ZeRO checkpoints: loss scalers, stage enum,
    fragment addresses. Each only holds numbers; building one runs no code of the file's choosing."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def check_torch_file(path: Path, allowed: list = ()) -> None:
    """Read a torch.save file with `weights_only=True` (tensors mapped, not copied); refuse it if its
    pickle names a global outside torch's own tensor types and `allowed`."""
    try:
        with torch.serialization.safe_globals(list(allowed)):
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        raise UserError(f"{path}: refused to load: {_wanted(str(exc))}") from None
    except (RuntimeError, EOFError, ValueError) as exc:
        raise UserError(f"{path}: unreadable: {str(exc).splitlines()[0]}") from None


def check_deepspeed(directory: Path) -> None:
    """Every DeepSpeed state file under `directory` (model states and ZeRO partitions)."""
    allowed = deepspeed_types()
    for path in sorted(directory.rglob("*.pt")):
        check_torch_file(path, allowed)


def read_dcp_metadata(directory: Path):
    """The `.metadata` of a torch.distributed.checkpoint directory, unpickled under an allow-list."""
    path = directory / DCP_METADATA
    try:
        with path.open("rb") as handle:
            return _DcpUnpickler(handle).load()
    except _Refused as exc:
        raise UserError(f"{path}: refused to load: it needs {exc}, which could run code") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError) as exc:
        raise UserError(f"{path}: unreadable: {exc}") from None


def check_dcp(directory: Path) -> None:
    """A DCP directory's metadata, and every non-tensor item it stores (DCP unpickles those freely)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = read_dcp_metadata(directory)
    for index, info in metadata.storage_data.items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        path = directory / info.relative_path
        if getattr(info, "transform_descriptors", None):
            raise UserError(f"{path}: refused to load: {index.fqn} is stored through a transform")
        with path.open("rb") as handle:
            handle.seek(info.offset)
            item = io.BytesIO(handle.read(info.length))
        try:
            torch.load(item, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UserError(f"{path}: refused to load {index.fqn}: {_wanted(str(exc))}") from None


def _wanted(message: str) -> str:
    """What a refused pickle asked for, from torch's weights_only error."""
    found = re.search(r"GLOBAL ([\w.]+)", message)
    what = found.group(1) if found else "an object that is not plain data"
    return f"it needs {what}, which could run code"


class _Refused(Exception):
    pass


@functools.cache
def _dcp_globals() -> dict[tuple[str, str], object]:
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata

    names = [
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    ]
    allowed = {(metadata.__name__, name): getattr(metadata, name) for name in names}
    allowed[(filesystem.__name__, "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    for cls in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath):
        allowed[("pathlib", cls.__name__)] = cls
    return allowed


class _DcpUnpickler(pickle.Unpickler):
    """Builds only DCP's metadata records, torch sizes, dtypes and layouts, and paths."""

    def find_class(self, module: str, name: str):
        found = _dcp_globals().get((module, name))
        if found is None and module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            found = getattr(torch, name)
        if found is None:
            raise _Refused(f"{module}.{name}")
        return found
