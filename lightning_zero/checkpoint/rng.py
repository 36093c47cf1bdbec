"""Every rank's random number generators, saved with a checkpoint and restored on an exact resume.

Lightning's checkpoints hold no generator state, so after a resume dropout draws other masks than the
uninterrupted run did. Each rank's states (torch's CPU and current CUDA generator, Python's ``random``,
NumPy's legacy global one) are gathered into Lightning's state in the checkpoint (about 8 KB a rank) and
set again as the first training batch of a run resumed on as many ranks starts (front/trainer_checkpoints.py,
[Note: generators across a resume]); where validation followed the save, the states it left are written
beside the shards afterwards (``AFTER_VALIDATION``) and taken instead. On another world size there is no
rank-to-rank map: the states are not restored and the run goes on from the seeded ones.
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_zero.checkpoint.atomic import write_atomically
from lightning_zero.checkpoint.format import AFTER_VALIDATION, is_checkpoint

KEY = "lightning_zero_rng"
_STATE_KEYS = {"torch", "cuda", "python", "numpy"}


def capture() -> dict[str, Any]:
    """This rank's generator states, as tensors, ints and strings (loadable with ``weights_only``)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, py_state, py_gauss = random.getstate()
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return {
        "torch": torch.get_rng_state(),
        "cuda": cuda,
        "python": (version, torch.tensor(py_state, dtype=torch.int64), py_gauss),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
    }


def restore(state: dict[str, Any]) -> None:
    """Sets this rank's generators to ``state`` (``capture``'s); the CUDA one only if saved and CUDA is available."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    version, py_state, py_gauss = state["python"]
    random.setstate((version, tuple(py_state.tolist()), py_gauss))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


def write_after_validation(directory: Path, record: dict[str, Any]) -> None:
    """Writes ``record`` (every rank's states, as ``KEY`` holds them) into the complete checkpoint ``directory``, if
    it is still there (a top-k removal may have taken it), with one atomic write."""
    if directory.is_symlink() or not is_checkpoint(directory):
        return
    write_atomically(directory / AFTER_VALIDATION, lambda f: torch.save(record, f))


def read_after_validation(directory: Path) -> dict[str, Any] | None:
    """The states written into ``directory`` after the validation that followed its save, or None; a file that
    is not such a record is a warning (the states saved in the checkpoint are taken: exact up to that
    validation's draws)."""
    path = directory / AFTER_VALIDATION
    if not directory.is_dir() or not path.is_file():
        return None
    try:
        record = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(record["world_size"], int) and len(record["states"]) == record["world_size"]:
            if all(set(state) == _STATE_KEYS for state in record["states"]):
                return record
        problem = "not a record of random generator states"
    except Exception as error:  # noqa: BLE001 - truncated, not a torch file, not our record
        problem = f"not a record of random generator states ({str(error).splitlines()[0][:200]})"
    warnings.warn(f"lightning_zero: {path}: {problem}; the generators saved in the checkpoint are set", stacklevel=2)
    return None
