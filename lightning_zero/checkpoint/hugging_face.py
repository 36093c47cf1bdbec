"""A sharded checkpoint of a LightningModule that holds a Hugging Face model, exported as ``save_pretrained``
writes it: ``config.json`` and the weights in safetensors files of at most ``max_shard_bytes`` each with
their index (one ``model.safetensors`` when they fit), which ``AutoModelForCausalLM.from_pretrained(out_dir)``
loads with no lightning_zero installed.

[Note: the Hugging Face description in a checkpoint]
When the model being saved holds a Hugging Face ``PreTrainedModel`` (the outermost one: anything with a
``config`` that has ``to_json_string`` and a ``save_pretrained``), every checkpoint records where it is and its
configuration in Lightning's state under ``HUGGING_FACE``: ``{"prefix": "model.", "config": {...}}`` (plain
JSON values, so the state still loads with ``weights_only=True``). The export takes the keys under that
prefix without it, writes one copy of each tied parameter (as ``save_pretrained``: the model ties them again
on load), and streams the weights in fp32 (the masters) parameter by parameter from the ranks' shards, as
``consolidate`` does: never the whole model in memory. The description is checked before anything is written:
a config is a JSON object nested at most ``MAX_CONFIG_DEPTH`` deep and about ``MAX_CONFIG_BYTES`` in all, when it
is recorded (else none is, with a warning) and when it is read back (a checkpoint is data: a config nested
thousands deep, or of gigabytes, is one line, not a RecursionError or a huge config.json).
"""

from __future__ import annotations

import json
import math
import os
import reprlib
import warnings
from pathlib import Path
from typing import Any

from torch.nn import Module

from lightning_zero.checkpoint.atomic import atomic_file
from lightning_zero.checkpoint.consolidate import _sources, _write_safetensors
from lightning_zero.checkpoint.format import CheckpointError, check_files, load_lightning_state, read_metadata
from lightning_zero.checkpoint.publish import check_new_directory, write_new_directory

HUGGING_FACE = "hugging_face"
MAX_SHARD_BYTES = 5 * 10**9  # save_pretrained's default
# Hugging Face configs nest a few levels (a text_config in a multimodal config, its rope_scaling) and the largest
# config.json files (label maps of tens of thousands of classes) hold a few MB.
MAX_CONFIG_DEPTH = 64
MAX_CONFIG_BYTES = 16 * 2**20


def describe(model: Module) -> dict[str, Any]:
    """``{HUGGING_FACE: {"prefix", "config"}}`` for the outermost Hugging Face model inside ``model``, else {}."""
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if hasattr(module, "save_pretrained") and hasattr(config, "to_json_string"):
            try:
                recorded = json.loads(config.to_json_string())
                problem = _config_problem(recorded)
            except (TypeError, ValueError, RecursionError) as error:
                problem = f"not JSON ({error})"
            if problem is None:
                return {HUGGING_FACE: {"prefix": f"{name}." if name else "", "config": recorded}}
            # the checkpoint is still saved, without the description
            warnings.warn(f"lightning_zero: {name or 'the model'}'s config is {problem}; checkpoints will not export"
                          " it for Hugging Face", stacklevel=2)  # fmt: skip
            return {}
    return {}


def _config_problem(config: Any) -> str | None:
    """What keeps ``config`` from being a config.json (a JSON object of plain values, nested at most
    MAX_CONFIG_DEPTH deep, about MAX_CONFIG_BYTES encoded), or None. Walked without recursion, up to the first
    problem: a hostile value is never walked whole."""
    if not isinstance(config, dict):
        return f"a {type(config).__name__}, not a JSON object"
    size, stack = 0, [(config, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_CONFIG_DEPTH:
            return f"nested more than {MAX_CONFIG_DEPTH} deep"
        if isinstance(value, dict):
            if not all(isinstance(key, str) for key in value):
                return "a JSON object with a key that is not a string"
            size += sum(len(key) for key in value)
            stack.extend((item, depth + 1) for item in value.values())
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)
        elif isinstance(value, str):
            size += len(value)
        elif value is not None and not isinstance(value, (bool, int, float)):
            return f"holding a {type(value).__name__}, not a JSON value"
        size += 8  # (punctuation, a number)
        if size > MAX_CONFIG_BYTES:
            return f"larger than {MAX_CONFIG_BYTES:,} bytes"
    return None


def _checked(description: Any, path: Path) -> tuple[str, dict[str, Any]]:
    if description is None:
        raise CheckpointError(
            f"{path}: holds no Hugging Face model (its LightningModule had no transformers PreTrainedModel when it was"
            " saved); export it with consolidate to .ckpt, .pt or .safetensors instead"
        )
    ok = isinstance(description, dict) and isinstance(description.get("prefix"), str)
    ok = ok and isinstance(description.get("config"), dict) and isinstance(description["config"].get("model_type"), str)
    if not ok:  # (reprlib: bounded, however deep or large)
        raise CheckpointError(f"{path}: its Hugging Face description is malformed: {reprlib.repr(description)}")
    problem = _config_problem(description["config"])
    if problem is not None:
        raise CheckpointError(
            f"{path}: its Hugging Face config is {problem}; a config.json is a JSON object nested at most"
            f" {MAX_CONFIG_DEPTH} deep, of at most {MAX_CONFIG_BYTES:,} bytes"
        )
    return description["prefix"], description["config"]


def export_hugging_face(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    weights_only: bool = True,
) -> Path:
    """Writes the Hugging Face model of a sharded checkpoint to the new directory ``out_dir`` (see the module's
    docstring), atomically. Bad input raises a one-line CheckpointError before anything is written.

    For a LightningModule that holds a transformers ``PreTrainedModel``: the output is what ``save_pretrained``
    writes (``config.json`` and safetensors weights in fp32, the master weights), which
    ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads with no lightning_zero installed. The weights are
    streamed from the ranks' shards one parameter at a time, and a tied parameter is written once. The command
    ``lightning-zero consolidate CKPT OUT_DIR --hf`` does the same.

    Args:
        checkpoint: a sharded checkpoint directory of lightning_zero (any world size and stage) saved from a
            module that held a Hugging Face model.
        out_dir: the directory to create; it must not exist, its parent must.
        max_shard_bytes: the most bytes of one safetensors file (``save_pretrained``'s 5 GB by default); one
            ``model.safetensors`` when the weights fit, else numbered files with their index.
        weights_only: unpickle the checkpoint's Lightning state safely (True), or without restrictions (False).

    Returns:
        ``out_dir``, as a Path.

    Raises:
        CheckpointError: ``out_dir`` exists or is a link, or its parent is missing; ``max_shard_bytes`` is not an
            integer > 0; ``checkpoint`` is missing, incomplete or damaged (a file's size or checksum), holds no
            Hugging Face model (or a malformed description of it), or holds objects that safe unpickling refuses.

    Example:
        ```python
        lightning_zero.export_hugging_face("ckpts/last.ckpt", "my-model")
        # then, anywhere: AutoModelForCausalLM.from_pretrained("my-model")
        ```
    """
    directory, out_dir = Path(checkpoint), Path(out_dir)
    check_new_directory(out_dir)
    if not (isinstance(max_shard_bytes, int) and max_shard_bytes > 0):
        raise CheckpointError(f"max_shard_bytes must be an integer > 0, got {max_shard_bytes!r}")
    meta = read_metadata(directory)
    check_files(directory, meta, checksum=True)
    lightning = load_lightning_state(directory, weights_only=weights_only)
    prefix, config = _checked(lightning.get(HUGGING_FACE), directory)
    seen, weights = set(), []
    for key, source in _sources(directory, meta, lightning):
        if key.startswith(prefix) and source[0] not in seen:  # (a tied parameter once)
            seen.add(source[0])
            weights.append((key.removeprefix(prefix), source))
    if not weights:
        raise CheckpointError(f"{directory}: no weights under {reprlib.repr(prefix)}, where its Hugging Face model was")
    shards: list[list] = [[]]
    size = 0
    for key, source in weights:
        nbytes = math.prod(source[2]) * source[3].itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((key, source))
        size += nbytes
    return write_new_directory(out_dir, lambda directory: _write(directory, config, shards))


def _write(directory: Path, config: dict[str, Any], shards: list[list]) -> None:
    config = {**config, "torch_dtype": "float32", "dtype": "float32"}  # the fp32 masters (both spellings)
    with atomic_file(directory / "config.json") as f:
        f.write((json.dumps(config, indent=2, sort_keys=True) + "\n").encode())
    count = len(shards)
    names = [f"model-{index:05d}-of-{count:05d}.safetensors" for index in range(1, count + 1)]
    names = ["model.safetensors"] if count == 1 else names
    for name, shard in zip(names, shards):
        with atomic_file(directory / name) as f:
            _write_safetensors(f, shard)
    if len(shards) == 1:
        return
    weight_map = {key: name for name, shard in zip(names, shards) for key, _ in shard}
    total = sum(math.prod(shape) * dtype.itemsize for shard in shards for _, (_, _, shape, dtype) in shard)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with atomic_file(directory / "model.safetensors.index.json") as f:
        f.write((json.dumps(index, indent=2) + "\n").encode())
