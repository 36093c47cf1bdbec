"""The LightningModule's weights in fp32 from a sharded checkpoint, streamed parameter by parameter.

By the output's name: a ``.ckpt`` is a Lightning checkpoint that ``MyModule.load_from_checkpoint(path)``
loads in a plain process (the state dict, the hyper-parameters, Lightning's version, epoch and step; no
optimizer or loop state: training resumes from the sharded checkpoint itself); a ``.pt`` (``.pth``,
``.bin``) is the plain state dict for ``torch.load``; a ``.safetensors`` the same in safetensors. All
load with no lightning_zero installed, with the keys of the module's own ``state_dict()``. Shapes and
dtypes are all known from the metadata, so the output file's layout is fixed first and each parameter
is then assembled from the ranks' shards and written into its place: peak memory is about one
parameter (plus the small unsharded part: buffers and frozen parameters).

[Note: writing a .pt without holding the model]
torch.save needs every tensor in memory. Instead, a skeleton of the state dict made of FakeTensors is
saved under ``torch.serialization.skip_data``, which reserves each storage's bytes without writing
them (tied keys share one storage); each storage is then written at its offset in the (uncompressed)
zip archive, found from the zip's local headers. A ``.ckpt`` puts Lightning's entries (no tensors in
them: checked) before the state dict, so the storages are still the state dict's, in its order.
"""

from __future__ import annotations

import io
import json
import os
import struct
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_zero.checkpoint.atomic import atomic_file, check_not_a_link, fsync_dir
from lightning_zero.checkpoint.format import (
    AVERAGED,
    AVERAGED_IN_SHARDS,
    CheckpointError,
    Metadata,
    averaged_exported,
    check_files,
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


# What Lightning's load_from_checkpoint reads besides the state dict (and the epoch and step, for the record).
LIGHTNING_KEYS = (
    "epoch",
    "global_step",
    "pytorch-lightning_version",
    "hparams_name",
    "hyper_parameters",
    "datamodule_hparams_name",
    "datamodule_hyper_parameters",
)


def _sources(
    directory: Path, meta: Metadata, lightning: dict[str, Any], *, average: bool = True
) -> list[tuple[str, Source]]:
    """(state-dict key, where its value comes from), in the module's key order; tied keys share a source. With
    ``average``, a weight average the checkpoint presents as its weights instead of the trained ones."""
    reader = ShardReader(directory, meta, keep_open=False)
    replicated = lightning["state_dict"]
    # WeightAveraging's average is what Lightning's checkpoint holds as the weights (format.py's Note)
    in_shards = AVERAGED_IN_SHARDS in lightning
    exported = average and AVERAGED in lightning and (not in_shards or averaged_exported(lightning, directory))
    in_shards = in_shards and exported
    averaged = lightning[AVERAGED] if exported else {}
    by_key: dict[str, Source] = {}
    for unit in meta.units:
        for entry in unit.params:
            source = (
                entry.name,
                lambda n=entry.name: reader.full(n, averaged=in_shards),
                tuple(entry.shape),
                torch.float32,
            )
            by_key.update({key: source for key in entry.keys})
    for key, value in {**replicated, **averaged}.items():
        dtype = torch.float32 if value.is_floating_point() else value.dtype
        by_key[key] = (f"{id(value)}", lambda v=value, d=dtype: v.to("cpu", d), tuple(value.shape), dtype)
    return [(key, by_key[key]) for key in meta.state_dict_keys]


def _unique(sources: list[tuple[str, Source]]) -> Iterator[Source]:
    seen = set()
    for _, source in sources:
        if source[0] not in seen:
            seen.add(source[0])
            yield source


def _holds_storage(obj: Any) -> bool:
    """Whether saving ``obj`` writes any tensor data (wherever a tensor hides in it)."""
    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
    except RecursionError:  # (what a checkpoint records is data: it may be hostile)
        raise CheckpointError(
            "the checkpoint's Lightning state (hyper-parameters) is nested too deep to be written again"
        ) from None
    with zipfile.ZipFile(buffer) as archive:
        return any("/data/" in name for name in archive.namelist())


def _write_torch(f: BinaryIO, sources: list[tuple[str, Source]], head: dict[str, Any] | None = None) -> None:
    """The state dict alone, or (``head``: Lightning's entries, holding no tensor) a Lightning checkpoint holding
    it, into the new file ``f`` (open for reading and writing)."""
    with FakeTensorMode():
        fakes = {s[0]: torch.empty(s[2], dtype=s[3]) for s in _unique(sources)}
    skeleton = {key: fakes[source[0]] for key, source in sources}
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(skeleton if head is None else {**head, "state_dict": skeleton}, f)
    f.flush()
    f.seek(0)
    with zipfile.ZipFile(f) as archive:  # (a file passed in stays open)
        records = {i.filename.split("/", 1)[1]: i for i in archive.infolist()}
    for index, (identity, produce, _, _) in enumerate(_unique(sources)):  # storages in first-seen order
        info = records[f"data/{index}"]
        value = produce().contiguous()
        if info.file_size != value.nbytes:
            raise RuntimeError(f"internal: storage {index} has {info.file_size} bytes, {identity} needs {value.nbytes}")
        f.seek(info.header_offset + 26)
        name_length, extra_length = struct.unpack("<HH", f.read(4))
        f.seek(info.header_offset + 30 + name_length + extra_length)
        f.write(memoryview(value.reshape(-1).view(torch.uint8).numpy()))


def _write_safetensors(f: BinaryIO, sources: list[tuple[str, Source]]) -> None:
    """The state dict into the new file ``f`` in safetensors' layout, one tensor at a time."""
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
    f.write(struct.pack("<Q", len(encoded)))
    f.write(encoded)
    for _, (_, produce, _, _) in sources:
        f.write(memoryview(produce().contiguous().reshape(-1).view(torch.uint8).numpy()))


SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".safetensors")


def consolidate(checkpoint: str | os.PathLike, output: str | os.PathLike, *, weights_only: bool = True) -> Path:
    """Writes the fp32 weights of a sharded checkpoint to one file that loads without lightning_zero.

    The whole checkpoint is checked first (every file's size and checksum), then the weights are streamed
    parameter by parameter into a new file that takes ``output``'s name only once complete: peak memory is
    about one parameter. A weight average that the checkpoint presents as its weights (Lightning's
    WeightAveraging) is written instead of the trained weights.

    Args:
        checkpoint: The sharded checkpoint directory.
        output: The file to write, which must not exist; its suffix picks the format (see the module's
            docstring): ``.ckpt`` a Lightning checkpoint for ``load_from_checkpoint``, ``.pt``, ``.pth`` or
            ``.bin`` the state dict for ``torch.load``, ``.safetensors`` the state dict in safetensors.
        weights_only: False unpickles the checkpoint's Lightning state without restrictions: only for a
            checkpoint you trust.

    Returns:
        The path written, ``output``.

    Raises:
        CheckpointError: ``output`` is a link, a directory or an existing file, its directory does not exist
            or its suffix is none of the above; or the checkpoint is incomplete, invalid or corrupted, or (for a
            ``.ckpt``) its hyper-parameters hold tensors. Raised, as one line, before anything is written.
    """
    directory, output = Path(checkpoint), Path(output)
    check_not_a_link(output)
    if output.is_dir():
        raise CheckpointError(f"{output}: is a directory; give the path of the file to write (.ckpt, .pt, ...)")
    if output.exists():
        raise CheckpointError(f"{output}: exists (nothing is overwritten: remove it or choose another name)")
    if not output.parent.is_dir():
        raise CheckpointError(f"{output.parent}: no such directory to write {output.name} into")
    if output.suffix not in SUFFIXES:
        raise CheckpointError(f"{output}: the output must end in {', '.join(SUFFIXES[:-1])} or {SUFFIXES[-1]}")
    meta = read_metadata(directory)
    check_files(directory, meta, checksum=True)
    lightning = load_lightning_state(directory, weights_only=weights_only)
    write_consolidated(directory, meta, lightning, output)
    fsync_dir(output.parent)
    return output


def write_consolidated(directory: Path, meta: Metadata, lightning: dict[str, Any], output: Path) -> None:
    """``output`` (by its suffix) from the checkpoint files in ``directory``, described by ``meta`` and
    ``lightning`` (its Lightning state), checked already; atomically (nothing is left on failure)."""
    sources = _sources(directory, meta, lightning)
    head = {k: lightning[k] for k in LIGHTNING_KEYS if k in lightning} if output.suffix == ".ckpt" else None
    if head is not None and _holds_storage(head):
        raise CheckpointError(
            f"{output.name}: the checkpoint's hyper-parameters hold tensors, which a streamed .ckpt cannot take;"
            " write a .pt (the state dict) and save the hyper-parameters yourself"
        )
    with atomic_file(output) as f:
        if output.suffix == ".safetensors":
            _write_safetensors(f, sources)
        else:
            _write_torch(f, sources, head)
