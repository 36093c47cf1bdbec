"""Every rank's random number generators, saved with a checkpoint and restored on an exact resume.

Lightning's checkpoints hold no generator state, so after a resume dropout draws other masks than the
uninterrupted run did. Each rank's states (torch's CPU and current CUDA generator, Python's ``random``,
NumPy's legacy global one) are gathered into Lightning's state in the checkpoint (about 8 KB a rank) and
set again as the first training batch of a run resumed on as many ranks starts (front/trainer_checkpoints.py,
[Note: generators across a resume]). On another world size there is no rank-to-rank map: the states are
not restored and the run goes on from the seeded ones.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

KEY = "lightning_zero_rng"


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
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    version, py_state, py_gauss = state["python"]
    random.setstate((version, tuple(py_state.tolist()), py_gauss))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


def snapshot() -> tuple:
    """torch's CPU and CUDA generators and Python's, as they are, for putting back in this process: taken
    every training step, so NumPy's (about 40-80 us to copy, 10x the rest) is left out."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda, random.getstate()


def put_back(state: tuple) -> None:
    cpu, cuda, python = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
    random.setstate(python)
