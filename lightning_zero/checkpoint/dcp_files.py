"""A torch.distributed.checkpoint (DCP) directory's files, read as data (what they mean is ``dcp.py``'s).

``.metadata`` is unpickled allowing only the classes DCP's metadata is made of and plain file names, then checked
against the files before any is read: every byte range it gives lies in its file (a missing or truncated file is
named, with a tensor stored in it) and the saved chunks of each tensor tile it. Reading goes through DCP's own
file reader one item at a time, so that a failure is one CheckpointError naming the file, the tensor and the
cause (safe loading's refusal, bytes that are not the chunk ``.metadata`` says): DCP's own error is a
``CheckpointException`` that reads ``CheckpointException ranks:dict_keys([0])``. Non-tensor values are unpickled
with ``weights_only=True`` (DCP's own loader unpickles them, and ``.metadata``, without restriction).
"""

from __future__ import annotations

import io
import math
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, create_default_local_load_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.futures import Future

from lightning_zero.checkpoint.format import CheckpointError, unsafe_pickle_error

DCP_METADATA = ".metadata"
_DCP_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib._local", "PosixPath"), ("pathlib._local", "PurePosixPath"),  # (Python 3.13)
}  # fmt: skip
_DTYPE_NAMES = (
    "float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32",
    "uint64", "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    "float8_e8m0fnu",
)  # fmt: skip


def is_dcp(path: Path) -> bool:
    """Whether ``path`` is a directory holding a DCP ``.metadata`` file."""
    return path.is_dir() and (path / DCP_METADATA).is_file()


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_METADATA_CLASSES or (module == "torch" and name in _DTYPE_NAMES):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def read_dcp_metadata(path: Path) -> Any:
    """The directory's DCP metadata, unpickled allowing only the classes DCP's metadata is made of, and checked
    against the files (see the module's docstring)."""
    try:
        with open(path / DCP_METADATA, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"{path / DCP_METADATA}: not a torch.distributed.checkpoint metadata file (it refers to {error}, which"
            " DCP's metadata does not hold; nothing in it was run)"
        ) from None
    except (EOFError, ValueError, TypeError, AttributeError) as error:
        raise CheckpointError(f"{path / DCP_METADATA}: unreadable ({error})") from None
    if not isinstance(getattr(metadata, "state_dict_metadata", None), dict) or not isinstance(
        getattr(metadata, "storage_data", None), dict
    ):
        raise CheckpointError(f"{path / DCP_METADATA}: not a torch.distributed.checkpoint metadata file")
    if not isinstance(metadata.planner_data or {}, dict):
        raise CheckpointError(f"{path / DCP_METADATA}: its planner_data is not a dict of paths")
    for info in metadata.storage_data.values():  # files inside the directory, by plain names
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
            raise CheckpointError(f"{path / DCP_METADATA}: names a data file {name!r}; a plain file name is allowed")
    _check_byte_ranges(path, metadata)
    _check_chunks(path, metadata)
    return metadata


def _check_byte_ranges(path: Path, metadata: Any) -> None:
    """Every byte range ``.metadata`` gives lies in its file: a missing or truncated file is named with a tensor
    stored in it before anything is read."""
    sizes: dict[str, int | None] = {}
    for index, info in metadata.storage_data.items():
        name, offset, length = info.relative_path, getattr(info, "offset", None), getattr(info, "length", None)
        if name not in sizes:
            sizes[name] = (path / name).stat().st_size if (path / name).is_file() else None
        if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length >= 0):
            raise CheckpointError(f"{path / DCP_METADATA}: stores {_item(index)} at {offset!r}+{length!r} bytes")
        if sizes[name] is None:
            raise CheckpointError(f"{path / name}: missing ({DCP_METADATA} stores {_item(index)} in it)")
        if offset + length > sizes[name]:
            raise CheckpointError(
                f"{path / name}: truncated: {sizes[name]:,} bytes, and {DCP_METADATA} stores {_item(index)} at bytes"
                f" [{offset:,}, {offset + length:,})"
            )


def _item(index: Any) -> str:
    """A saved item by its key, and its chunk's offsets when a tensor is saved in several."""
    offset = getattr(index, "offset", None)
    return f"{index.fqn}" + (f" (its chunk at {list(offset)})" if offset is not None and any(offset) else "")


def _check_chunks(path: Path, metadata: Any) -> None:
    """The saved chunks of each tensor tile it: every element is read from a file, once."""
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        size = torch.Size(md.size)
        inside = all(
            len(c.offsets) == len(size) == len(c.sizes) and all(0 <= o and o + n <= d for o, n, d in
                                                                zip(c.offsets, c.sizes, size))
            for c in md.chunks
        )  # fmt: skip
        if not inside or sum(math.prod(c.sizes) for c in md.chunks) != size.numel() or _overlap(md.chunks, size):
            raise CheckpointError(f"{path / DCP_METADATA}: the chunks saved of {key} do not cover its {list(size)}")


def _overlap(chunks: list, size: torch.Size) -> bool:
    """Whether saved chunks overlap (with their total size right, a gap then hides beside the overlap): rows of
    whole tensors (FSDP2's dim-0 shards) are compared as intervals; other tilings pairwise, up to 64 chunks."""
    if all(tuple(c.sizes[1:]) == tuple(size[1:]) and not any(c.offsets[1:]) for c in chunks):
        rows = sorted((c.offsets[0], c.offsets[0] + c.sizes[0]) for c in chunks if c.sizes[0]) if size else []
        return any(a[1] > b[0] for a, b in zip(rows, rows[1:]))
    if len(chunks) > 64:
        return False

    def meet(a: Any, b: Any) -> bool:
        return all(a.offsets[d] < b.offsets[d] + b.sizes[d] and b.offsets[d] < a.offsets[d] + a.sizes[d] for d in
                   range(len(size)))  # fmt: skip

    return any(meet(a, b) for i, a in enumerate(chunks) for b in chunks[i + 1 :])


def dcp_failure(error: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's ``CheckpointException`` (which says only which ranks failed)."""
    failures = getattr(error, "failures", None) or {}
    return next(iter(failures.values()))[0] if failures else error


def one_line(error: BaseException) -> str:
    """An exception's type and the first line of what it says."""
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"


class DcpStorage(dcp.FileSystemReader):
    """DCP's file reader, with the metadata read once (and safely) above, reading one item at a time so that a
    failure is a CheckpointError naming the file, the tensor and the cause."""

    def __init__(self, path: Path, metadata: Any) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: Any) -> Future[None]:
        for item in plan.items:
            try:
                super().read_data(LoadPlan([item]), planner)
            except Exception as error:  # noqa: BLE001 - whatever the file holds, one line naming it
                raise CheckpointError(self._failed(item, error)) from None
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _failed(self, item: Any, error: Exception) -> str:
        info = self.storage_data[item.storage_index]
        file = Path(self.path) / info.relative_path
        if isinstance(error, pickle.UnpicklingError):
            refused = str(unsafe_pickle_error(file, error)).partition("; load it with")[0]
            return f"{refused}, in {_item(item.storage_index)} (nothing in it was run)"
        return (
            f"{file}: {_item(item.storage_index)}, at bytes [{info.offset:,}, {info.offset + info.length:,}), is not"
            f" what {DCP_METADATA} says: {one_line(error)}"
        )


class SlicePlanner(DefaultLoadPlanner):
    """Loads ``state_dict``'s tensors as slices of the saved ones: ``offsets[key]`` is where the slice a tensor
    holds starts in the saved tensor (its size is the tensor's); other values are unpickled with
    ``weights_only=True``."""

    def __init__(self, offsets: dict[str, tuple[int, ...]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.offsets = offsets

    def create_local_plan(self) -> LoadPlan:
        others = {k: v for k, v in self.state_dict.items() if k not in self.offsets}
        items = create_default_local_load_plan(others, self.metadata).items
        for key, start in self.offsets.items():
            chunk = ChunkStorageMetadata(offsets=torch.Size(start), sizes=self.state_dict[key].size())
            items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [chunk])
        return LoadPlan(items)

    def resolve_tensor(self, read_item: Any) -> Tensor:
        tensor = self.state_dict[read_item.dest_index.fqn]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            tensor = tensor.narrow(dim, start, length)
        return tensor

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)
