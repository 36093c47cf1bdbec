"""The sharded checkpoint format: what is in the directory, its metadata, and how it is checked.

A checkpoint is a directory::

    <name>.ckpt/
        metadata.json        format and version; for every sharded parameter its name, state-dict
                             keys, shape and dtype, grouped by unit with the unit's bucket bounds, so
                             that the owner of any element at the saved world size can be recomputed
                             (``layout.py``); the optimizers' param groups by parameter name; the
                             size and checksum of every other file (``DIGESTS``)
        lightning.pt         Lightning's own state (epoch, step, loops, callbacks, LR schedulers,
                             precision plugin / loss scaler, hyper-parameters) and the parameters and
                             buffers that are not sharded
        rank-00000.pt ...    what each rank owns: per unit its fp32 master partition and the
                             optimizer state of its pieces (elementwise state as partition-sized
                             tensors, scalars such as Adam's step per piece)
        consolidated.ckpt    (with ``ZeroConfig(save_consolidated=True)``) the whole model's weights in
                             fp32 as a Lightning checkpoint, for ``MyModule.load_from_checkpoint``
                             (checkpoint/consolidate.py)
        COMPLETE             written last: a directory without it is not a checkpoint
        rng_after_validation.pt  (when validation followed the save while fitting) every rank's random
                             generators as that validation left them, written after publication:
                             what a resume sets (checkpoint/rng.py)

Every file is written under a temporary name, fsynced and renamed, and hashed as it is written; the
directory is assembled under a hidden name and published last (see [Note: the save protocol] in
save.py). Reading validates the metadata against what a save writes (``_validate``) before opening
any file it names, and loads Lightning's state with ``weights_only=True`` unless told otherwise.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch
import xxhash

FORMAT = "lightning_zero.sharded"
VERSION = 2  # 2: files are checksummed with xxh3-128 (version 1's sha256, on one core, was most of a save's time)
READS = (1, 2)
# Each file's checksum, by the metadata key that holds it: (hasher, hexadecimal digits). Integrity against a
# truncated, corrupted or mixed-up file, not a signature: files are data, loaded with weights_only=True.
DIGESTS = {"xxh3_128": (xxhash.xxh3_128, 32), "sha256": (hashlib.sha256, 64)}
WRITTEN_DIGEST = "xxh3_128"
METADATA = "metadata.json"
LIGHTNING = "lightning.pt"
COMPLETE = "COMPLETE"
CONSOLIDATED = "consolidated.ckpt"  # optional: see the module's docstring
AFTER_VALIDATION = "rng_after_validation.pt"  # optional, written after publication: see rng.py
# [Note: averaged weights in a checkpoint]
# A run with a weight-averaging callback (sharding/averaging.py) saves its average beside the weights: each rank
# file's unit entries hold their averaged partition ("averaged", laid out as "master"), and lightning.pt holds
# the averaged parameters of no unit and buffers whole under AVERAGED, and AVERAGED_IN_SHARDS = {"exported":
# bool}: whether the average is what the checkpoint presents as the model's weights (Lightning's
# WeightAveraging saves its average as the checkpoint's "state_dict", so testing or exporting the checkpoint reads
# it, as under ddp), or only the callback's state (StochasticWeightAveraging). Read as such, AVERAGED without
# AVERAGED_IN_SHARDS (an earlier version's stage-1/2 checkpoint, or a plain ddp file's "state_dict" beside
# CURRENT, the model's own weights there) holds the whole average, presented as the weights.
CURRENT = "current_model_state"
AVERAGED = "averaged_state_dict"
AVERAGED_IN_SHARDS = "averaged_in_shards"


def averaged_exported(lightning: dict[str, Any], path: Any) -> bool:
    """AVERAGED_IN_SHARDS's "exported" flag, checked (see [Note: averaged weights in a checkpoint])."""
    settings = lightning[AVERAGED_IN_SHARDS]
    exported = settings.get("exported") if isinstance(settings, dict) else None
    if not isinstance(exported, bool):
        raise CheckpointError(f"{path}: {AVERAGED_IN_SHARDS} must be a dict with a bool 'exported', got {settings!r}")
    return exported


def rank_file(rank: int) -> str:
    """The name of saved rank ``rank``'s file in a checkpoint directory (``rank-00003.pt``)."""
    return f"rank-{rank:05d}.pt"


def partial_dir(path: Path) -> Path:
    """The hidden directory beside ``path`` in which a save assembles the checkpoint before publishing it."""
    return path.parent / f".{path.name}.partial"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the file or parameter."""


@dataclass
class ParamEntry:
    """One sharded parameter in the metadata: its name, state-dict keys, shape and dtype."""

    name: str  # the first name under which the module registers it
    keys: list[str]  # every state-dict key that holds it (tied parameters have several)
    shape: list[int]
    dtype: str


@dataclass
class UnitEntry:
    """One unit in the metadata: its parameters in flat order and its buckets' bounds."""

    params: list[ParamEntry]
    buckets: list[list[int]]  # [first_param, end_param) of each bucket


@dataclass
class Metadata:
    """``metadata.json``: what was saved (stage, world size, step, epoch), every unit's parameters and buckets, the
    optimizers' param groups by name, the LightningModule's state-dict keys and each file's size and checksum."""

    stage: int
    world_size: int
    global_step: int
    epoch: int
    units: list[UnitEntry]
    optimizers: list[list[list[str]]]  # per optimizer, per param group: its parameters by name
    state_dict_keys: list[str]  # the LightningModule's state-dict keys, in order
    weights_only: bool
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> {"bytes", WRITTEN_DIGEST}
    format: str = FORMAT
    version: int = VERSION

    def to_json(self) -> str:
        """The metadata as the JSON text of ``metadata.json``."""
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str, where: Path) -> Metadata:
        """Parses and validates metadata (see ``_validate``) before anything it names is opened."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as error:
            raise CheckpointError(f"{where}: not valid JSON ({error})") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
            raise CheckpointError(f"{where}: not a lightning_zero checkpoint (format {found!r})")
        if raw.get("version") not in READS:
            raise CheckpointError(
                f"{where}: checkpoint format version {raw.get('version')!r} is not supported"
                f" (this lightning_zero reads versions {', '.join(map(str, READS))})"
            )
        _validate(raw, where)
        raw["units"] = [
            UnitEntry([ParamEntry(**p) for p in u["params"]], [list(b) for b in u["buckets"]]) for u in raw["units"]
        ]
        return cls(**raw)


MAX_WORLD_SIZE = 1 << 20
MAX_NUMEL = 1 << 44
DTYPES = {"float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"}


def _fail(where: Path, field: str, value: Any, allowed: str) -> NoReturn:
    raise CheckpointError(f"{where}: {field} must be {allowed}, got {str(value)[:80]!r}")


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _names(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(name, str) for name in value)


# Metadata's plain fields: (field, predicate of its value, what is allowed); the counts come before the
# files, whose checks read the world size, and the names after the units, as they are listed in Metadata.
COUNT_FIELDS = (
    ("stage", lambda stage: stage in (1, 2, 3), "1, 2 or 3"),
    (
        "world_size",
        lambda world: _integer(world) and 1 <= world <= MAX_WORLD_SIZE,
        f"an integer in [1, {MAX_WORLD_SIZE}]",
    ),
    ("global_step", lambda step: _integer(step) and step >= 0, "an integer >= 0"),
    ("epoch", lambda epoch: _integer(epoch) and epoch >= 0, "an integer >= 0"),
)
NAME_FIELDS = (
    ("state_dict_keys", _names, "a list of names"),
    (
        "optimizers",
        lambda optimizers: (
            isinstance(optimizers, list)
            and all(isinstance(groups, list) and all(_names(group) for group in groups) for groups in optimizers)
        ),
        "per optimizer, a list of param groups' parameter names",
    ),
    ("weights_only", lambda weights_only: isinstance(weights_only, bool), "true or false"),
)


def _validate(raw: dict[str, Any], where: Path) -> None:
    """Raises a CheckpointError naming the first field that is not what a lightning_zero save writes:
    every file a plain name inside the checkpoint (``rank-NNNNN.pt`` for each saved rank, ``lightning.pt``),
    world size and shapes bounded, dtypes known."""
    expected = {"stage", "world_size", "global_step", "epoch", "units", "optimizers", "state_dict_keys"}
    expected |= {"weights_only", "files", "format", "version"}
    if set(raw) != expected:
        _fail(where, "its fields", sorted(raw), f"{sorted(expected)}")
    _check_fields(raw, COUNT_FIELDS, where)
    _validate_files(raw["files"], raw["world_size"], raw["version"], where)
    _validate_units(raw["units"], where)
    _check_fields(raw, NAME_FIELDS, where)


def _check_fields(raw: dict[str, Any], rows: tuple[tuple[str, Callable[[Any], bool], str], ...], where: Path) -> None:
    for key, ok, allowed in rows:
        if not ok(raw[key]):
            _fail(where, key, raw[key], allowed)


def _validate_files(files: Any, world: int, version: int, where: Path) -> None:
    """Exactly the files a save of ``world`` ranks writes, each with its size and checksum."""
    if not isinstance(files, dict):
        _fail(where, "files", files, "an object of file name -> size and checksum")
    # The count first: no set of a million names is built for a crafted world size.
    optional = {CONSOLIDATED} & set(files)
    wanted = {rank_file(r) for r in range(world)} | {LIGHTNING} if len(files) == world + 1 + len(optional) else set()
    if set(files) - optional != wanted:
        odd = sorted((set(files) - optional) ^ wanted)[:3]
        _fail(
            where, "files", odd, f"exactly {LIGHTNING} and rank-00000.pt .. {rank_file(world - 1)} (and {CONSOLIDATED})"
        )
    digest = "sha256" if version == 1 else WRITTEN_DIGEST
    digits = DIGESTS[digest][1]
    for name, entry in files.items():
        if not isinstance(entry, dict) or set(entry) != {"bytes", digest}:
            _fail(where, f"files[{name!r}]", entry, f'{{"bytes": ..., "{digest}": ...}}')
        if not _integer(entry["bytes"]) or entry["bytes"] < 0:
            _fail(where, f"files[{name!r}].bytes", entry["bytes"], "an integer >= 0")
        if not isinstance(entry[digest], str) or not re.fullmatch(f"[0-9a-f]{{{digits}}}", entry[digest]):
            _fail(where, f"files[{name!r}].{digest}", entry[digest], f"{digits} hexadecimal digits")


def _validate_units(units: Any, where: Path) -> None:
    if not isinstance(units, list):
        _fail(where, "units", units, "a list")
    for u, unit in enumerate(units):
        if not isinstance(unit, dict) or set(unit) != {"params", "buckets"} or not isinstance(unit["params"], list):
            _fail(where, f"units[{u}]", unit, '{"params": [...], "buckets": [...]}')
        for p, param in enumerate(unit["params"]):
            _validate_param(param, f"units[{u}].params[{p}]", where)
        _validate_buckets(unit["buckets"], len(unit["params"]), f"units[{u}].buckets", where)


def _validate_param(param: Any, field: str, where: Path) -> None:
    if not isinstance(param, dict) or set(param) != {"name", "keys", "shape", "dtype"}:
        _fail(where, field, param, '{"name", "keys", "shape", "dtype"}')
    if not isinstance(param["name"], str) or not isinstance(param["keys"], list):
        _fail(where, field, param, "a name and a list of keys")
    shape = param["shape"]
    if not isinstance(shape, list) or not all(_integer(d) and d >= 0 for d in shape) or math.prod(shape) > MAX_NUMEL:
        _fail(where, f"{field}.shape", shape, f"a list of sizes >= 0 with at most {MAX_NUMEL} elements")
    if param["dtype"] not in DTYPES:
        _fail(where, f"{field}.dtype", param["dtype"], f"one of {', '.join(sorted(DTYPES))}")


def _validate_buckets(bounds: Any, n: int, field: str, where: Path) -> None:
    """[first, end) pairs covering the unit's ``n`` parameters in order."""
    if not isinstance(bounds, list) or not all(
        isinstance(b, list) and len(b) == 2 and all(map(_integer, b)) for b in bounds
    ):
        _fail(where, field, bounds, "a list of [first, end] pairs")
    if bounds and (
        [b[0] for b in bounds[1:]] != [b[1] for b in bounds[:-1]] or bounds[0][0] != 0 or bounds[-1][1] != n
    ):
        _fail(where, field, bounds, f"[first, end) ranges covering parameters 0..{n} in order")


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a complete lightning_zero checkpoint directory (its metadata says so)."""
    try:
        return (path / COMPLETE).is_file() and json.loads((path / METADATA).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def file_digest(path: Path, algorithm: str = WRITTEN_DIGEST) -> str:
    """The hexadecimal checksum of the file at ``path`` with ``algorithm`` (a key of ``DIGESTS``)."""
    digest = DIGESTS[algorithm][0]()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_file(directory: Path, name: str, expected: dict[str, Any], *, checksum: bool) -> None:
    """Raises CheckpointError if the file is missing, truncated or (with ``checksum``) corrupted."""
    path = directory / name
    if not path.is_file():
        raise CheckpointError(f"{path}: missing from the checkpoint")
    size = path.stat().st_size
    if size != expected["bytes"]:
        raise CheckpointError(f"{path}: truncated or changed: {size} bytes, the metadata says {expected['bytes']}")
    algorithm = next(k for k in expected if k in DIGESTS)
    if checksum and file_digest(path, algorithm) != expected[algorithm]:
        raise CheckpointError(f"{path}: corrupted: its {algorithm} checksum does not match the metadata")


def check_files(directory: Path, meta: Metadata, *, checksum: bool, share: tuple[int, int] | None = None) -> None:
    """Every file the metadata lists: present, of its size and (``checksum``) its checksum; with ``share`` =
    (rank, world size), this rank hashes only every world-size-th file (the ranks split the hashing)."""
    for i, (name, expected) in enumerate(sorted(meta.files.items())):
        mine = share is None or i % share[1] == share[0]
        # (the consolidated file is for load_from_checkpoint: nothing here reads it, so its size is enough)
        check_file(directory, name, expected, checksum=checksum and mine and name != CONSOLIDATED)


def read_metadata(directory: Path) -> Metadata:
    """The validated metadata of the checkpoint ``directory``; raises a CheckpointError if ``directory`` does not
    exist, is not a lightning_zero checkpoint, is incomplete (no ``COMPLETE``) or its metadata is invalid."""
    if not directory.exists():
        raise CheckpointError(
            f"{directory}: no such checkpoint (on a multi-node run: is it on a filesystem every node shares?)"
        )
    if not directory.is_dir() or not any((directory / n).exists() for n in (METADATA, COMPLETE)):
        raise CheckpointError(f"{directory}: not a lightning_zero checkpoint (a directory with {METADATA})")
    if not (directory / COMPLETE).is_file():
        raise CheckpointError(f"{directory}: incomplete checkpoint (no {COMPLETE} marker): its save was interrupted")
    if not (directory / METADATA).is_file():
        raise CheckpointError(f"{directory / METADATA}: missing from the checkpoint")
    return Metadata.from_json((directory / METADATA).read_text(), directory / METADATA)


def latest(dirpath: str | os.PathLike, *, excluding: Path | None = None) -> Path | None:
    """The complete checkpoint with the highest global step under ``dirpath``: the one to resume from.

    Partial saves, hidden directories, links (``last.ckpt``: their targets are the checkpoints) and checkpoints
    whose metadata is invalid or whose files are missing or of the wrong size are skipped (checksums are not
    computed); of two at the same step, the one modified last is taken.

    Args:
        dirpath: The directory the checkpoints are saved in.
        excluding: A checkpoint directory under ``dirpath`` not to return (one about to be replaced or removed).

    Returns:
        The checkpoint directory, or None if ``dirpath`` holds no complete checkpoint.

    Raises:
        OSError: ``dirpath`` cannot be listed (it does not exist or is not a directory).
    """
    best: tuple[int, float, Path] | None = None
    for child in Path(dirpath).iterdir():
        if child.name.startswith(".") or child.is_symlink() or child == excluding or not (child / COMPLETE).is_file():
            continue
        try:
            meta = read_metadata(child)
            check_files(child, meta, checksum=False)
        except (CheckpointError, OSError):
            continue
        key = (meta.global_step, child.stat().st_mtime, child)
        best = key if best is None or key[:2] > best[:2] else best
    return None if best is None else best[2]


class UnsafePickleError(CheckpointError):
    """Safe loading (``weights_only=True``) refused an object in a checkpoint's pickle."""


def unsafe_pickle_error(path: Path, error: pickle.UnpicklingError) -> UnsafePickleError:
    """One line naming the file, what safe loading refused (torch's reason, without its colour codes) and
    the opt-in, which is only for a file whose origin is trusted."""
    lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", str(error)).splitlines() if line.strip()]
    # torch's message opens with advice; the line naming the refused global says what the file holds.
    reason = next((line for line in lines if "Unsupported global" in line), lines[0] if lines else "")
    reason = reason.partition(". Please use")[0]
    return UnsafePickleError(
        f"{path}: holds objects that safe loading refuses ({reason[:200]}); only if you trust where it came from:"
        " load it with weights_only=False (fabric.load(..., weights_only=False); the Trainer does not pass"
        " trainer.fit's weights_only on to this strategy: torch.serialization.add_safe_globals([the classes named]))"
    )


def load_torch_file(path: Path, *, weights_only: bool) -> Any:
    """``torch.load`` on the CPU, memory-mapped (tensors are read page by page, not held whole per rank),
    unpickled safely unless ``weights_only`` is False; every failure is a one-line CheckpointError."""
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
    except pickle.UnpicklingError as error:
        raise unsafe_pickle_error(path, error) from None
    except Exception as error:  # noqa: BLE001 - truncated, not a torch file, ...
        raise CheckpointError(f"{path}: not a readable checkpoint file: {str(error).splitlines()[0][:200]}") from None


def load_lightning_state(path: Path, *, weights_only: bool = True) -> dict[str, Any]:
    """``lightning.pt``, unpickled safely unless ``weights_only`` is False."""
    state = load_torch_file(path / LIGHTNING, weights_only=weights_only)
    if not isinstance(state, dict) or not isinstance(state.get("state_dict"), dict):
        raise CheckpointError(f"{path / LIGHTNING}: not Lightning's state of a lightning_zero checkpoint")
    return state
