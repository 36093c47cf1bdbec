"""A plain fp32 state dict of the LightningModule from a sharded checkpoint, streamed parameter by parameter.

The output (``.pt`` for ``torch.load``, ``.safetensors`` by name) has the keys of the module's own
``state_dict()`` and loads with ``load_state_dict`` into the unsharded module, with no lightning_zero
installed. Shapes and dtypes are all known from the metadata, so the output file's layout is fixed
first and each parameter is then assembled from the ranks' shards and written into its place: peak
memory is about one parameter (plus the small unsharded part: buffers and frozen parameters).

[Note: writing a .pt without holding the model]
torch.save needs every tensor in memory. Instead, a skeleton of the state dict made of FakeTensors is
saved under ``torch.serialization.skip_data``, which reserves each storage's bytes without writing
them (tied keys share one storage); each storage is then written at its offset in the (uncompressed)
zip archive, found from the zip's local headers.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_zero.checkpoint.format import (
    CheckpointError,
    check_files,
    fsync_dir,
    load_lightning_state,
    read_metadata,
)
from lightning_zero.checkpoint.shards import ShardReader

_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}

Source = tuple[str, Callable[[], Tensor], tuple[int, ...], torch.dtype]  # (identity, produce, shape, dtype)


def _sources(directory: Path, weights_only: bool) -> list[tuple[str, Source]]:
    """(state-dict key, where its value comes from), in the module's key order; tied keys share a source."""
    meta = read_metadata(directory)
    check_files(directory, meta, checksum=True)
    reader = ShardReader(directory, meta, keep_open=False)
    replicated = load_lightning_state(directory, weights_only=weights_only)["state_dict"]
    by_key: dict[str, Source] = {}
    for unit in meta.units:
        for entry in unit.params:
            source = (entry.name, lambda n=entry.name: reader.full(n), tuple(entry.shape), torch.float32)
            by_key.update({key: source for key in entry.keys})
    for key, value in replicated.items():
        dtype = torch.float32 if value.is_floating_point() else value.dtype
        by_key[key] = (key, lambda v=value, d=dtype: v.to(d), tuple(value.shape), dtype)
    return [(key, by_key[key]) for key in meta.state_dict_keys]


def _unique(sources: list[tuple[str, Source]]) -> Iterator[Source]:
    seen = set()
    for _, source in sources:
        if source[0] not in seen:
            seen.add(source[0])
            yield source


def _write_torch(path: Path, sources: list[tuple[str, Source]]) -> None:
    with FakeTensorMode():
        fakes = {s[0]: torch.empty(s[2], dtype=s[3]) for s in _unique(sources)}
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save({key: fakes[source[0]] for key, source in sources}, path)
    with zipfile.ZipFile(path) as archive:
        records = {i.filename.split("/", 1)[1]: i for i in archive.infolist()}
    with open(path, "r+b") as f:
        for index, (identity, produce, _, _) in enumerate(_unique(sources)):  # storages in first-seen order
            info = records[f"data/{index}"]
            value = produce().contiguous()
            if info.file_size != value.nbytes:
                raise RuntimeError(
                    f"internal: storage {index} of {path} has {info.file_size} bytes, {identity} needs {value.nbytes}"
                )
            f.seek(info.header_offset + 26)
            name_length, extra_length = struct.unpack("<HH", f.read(4))
            f.seek(info.header_offset + 30 + name_length + extra_length)
            f.write(memoryview(value.reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())


def _write_safetensors(path: Path, sources: list[tuple[str, Source]]) -> None:
    header, offset = {}, 0
    for key, (_, _, shape, dtype) in sources:  # safetensors has no shared tensors: tied keys get a copy each
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        header[key] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for _, (_, produce, _, _) in sources:
            f.write(memoryview(produce().contiguous().reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())


def consolidate(checkpoint: str | os.PathLike, output: str | os.PathLike, *, weights_only: bool = True) -> Path:
    """Writes the plain fp32 state dict of a sharded checkpoint to ``output`` (.pt or .safetensors), atomically.

    ``weights_only=False`` unpickles the checkpoint's Lightning state without restrictions: only for a
    checkpoint you trust. Bad input raises a one-line CheckpointError before anything is written."""
    directory, output = Path(checkpoint), Path(output)
    if output.is_dir():
        raise CheckpointError(f"{output}: is a directory; give the path of the file to write (.pt or .safetensors)")
    if output.exists():
        raise CheckpointError(f"{output}: exists (nothing is overwritten: remove it or choose another name)")
    if not output.parent.is_dir():
        raise CheckpointError(f"{output.parent}: no such directory to write {output.name} into")
    if output.suffix not in (".pt", ".pth", ".bin", ".safetensors"):
        raise CheckpointError(f"{output}: the output must end in .pt, .pth, .bin or .safetensors")
    sources = _sources(directory, weights_only)
    tmp = output.with_name(f".{output.name}.tmp")
    try:
        (_write_safetensors if output.suffix == ".safetensors" else _write_torch)(tmp, sources)
        os.replace(tmp, output)
    except BaseException:
        tmp.unlink(missing_ok=True)  # nothing is left behind
        raise
    fsync_dir(output.parent)
    return output
