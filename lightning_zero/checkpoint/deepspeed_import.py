"""Migration in from DeepSpeed: a ZeRO stage 1, 2 or 3 checkpoint directory (``engine.save_checkpoint``,
or Lightning's ``DeepSpeedStrategy``) becomes one plain Lightning checkpoint file, which the ZeRO
strategies here resume from at any stage and world size (``plain.py``).

DeepSpeed's save directory holds ``latest`` (the tag) and ``<tag>/`` with ``mp_rank_00_model_states.pt``
(stage 3: ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per rank): the module's state dict (stage 3:
placeholders), trainable parameters' shapes per param group in flattening order, frozen parameters
(stage 3: per-rank fragments), tied names and the client state (Lightning's, under DeepSpeedStrategy);
and ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt``: rank r's fp32 master partition of each param
group and the torch optimizer's state over it. Stages 1/2 flatten a param group (``param_alignment_paddings``
after each parameter) and cut it into equal rank partitions, each saved without the group's end padding:
concatenated, they are the flat group. Stage 3 partitions every parameter: each rank holds
``ceil(numel / world)`` of its elements (the last rank zero-padded), parameter after parameter. Adam's
``exp_avg``... lies over the same partitions, so it is cut into parameters as the weights are (DeepSpeed's
own reader: ``deepspeed/utils/zero_to_fp32.py``).

The files are pickles holding DeepSpeed's classes (its loss scalers, its stage enum, ``fragment_address``):
they are loaded with torch's weights-only unpickler, DeepSpeed's classes stood in for by inert stubs
(``_Stub``), so nothing in them runs and DeepSpeed need not be installed. A file holding anything else is
unpickled only when the user trusts the checkpoint (``trust_pickles``).
"""

from __future__ import annotations

import logging
import math
import pickle
import re
import types
from pathlib import Path
from typing import Any

import lightning
import torch
from torch import Tensor

from lightning_zero.checkpoint.atomic import write_atomically
from lightning_zero.checkpoint.format import CheckpointError

log = logging.getLogger(__name__)

_MODEL = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt")
_OPTIM = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
# DeepSpeed's own keys in a model-states file; every other key is the client state (Lightning's, under
# DeepSpeedStrategy) and is carried over as it is.
_DEEPSPEED_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "csr_tensor_module_names", "skipped_steps", "global_steps", "global_samples", "dp_world_size",
    "mp_world_size", "checkpoint_parallel_dimensions", "ds_config", "ds_version", "universal_checkpoint_info",
}  # fmt: skip
_LIGHTNING_PREFIX = "_forward_module."  # Lightning < 2.1 wrapped the module and saved names under it


class _Stub:
    """Stands for a DeepSpeed class when unpickling: keeps its constructor arguments and state, runs nothing."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Stub:
        stub = super().__new__(cls)
        stub.args = args
        return stub

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _stub_class(full_name: str) -> type[_Stub]:
    """A stub class standing for the DeepSpeed class (or function) ``module.Name``."""
    module, _, name = full_name.rpartition(".")
    return type(name, (_Stub,), {"__module__": module})


def _is_deepspeed(full_name: str) -> bool:
    return full_name.startswith("deepspeed.")


# [Note: loading DeepSpeed's pickles safely]
# torch.load(weights_only=True) builds only tensors, storages, torch.Size, dtypes and plain containers; it calls
# (REDUCE), instantiates (NEWOBJ) or sets the state of (BUILD) nothing else unless the name is allowed through
# safe_globals. DeepSpeed 0.19.8's ZeRO files (stages 1-3, fp32/fp16/bf16, optimizer offload, also under
# Lightning's DeepSpeedStrategy with its callbacks and hyperparameters) hold four other names, all DeepSpeed's:
# LossScaler, DynamicLossScaler, ZeroStageEnum and fragment_address. Every ``deepspeed.*`` name is allowed, but
# as a _Stub, never as the class itself (nothing is imported): called or instantiated it keeps its arguments,
# given state it keeps that as data, so the name cannot make anything run and is not worth checking one by one.
# Any other name (``io.open``, ``os.system``, a user's class) is refused before loading and named in the
# error; only trust_pickles unpickles it.
def _load_safely(path: Path) -> tuple[Any, str]:
    """The file loaded with only tensors, containers and DeepSpeed's stubs, and ""; or None and what safe
    loading refused (a name, or torch's reason)."""
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(path)  # the pickle's names, nothing loaded
        refused = sorted(name for name in found if not _is_deepspeed(name))
        if refused:
            return None, ", ".join(refused)
        with torch.serialization.safe_globals([(_stub_class(name), name) for name in found]):
            return torch.load(path, map_location="cpu", mmap=True, weights_only=True), ""
    except pickle.UnpicklingError as error:  # an opcode or a construction the weights-only unpickler refuses
        detail = str(error).split("WeightsUnpickler error:")[-1]  # torch.load's message: past its advice
        reason = next((line.strip() for line in detail.splitlines() if line.strip()), type(error).__name__)
        return None, f"its pickle ({reason[:200]})"


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if _is_deepspeed(f"{module}.{name}"):
            return _stub_class(f"{module}.{name}")
        return super().find_class(module, name)


_TRUSTED_PICKLE = types.SimpleNamespace(Unpickler=_Unpickler, load=pickle.load, __name__="pickle")


def _load(path: Path, trust_pickles: bool) -> dict[str, Any]:
    try:
        loaded, refused = _load_safely(path)
    except Exception as error:  # noqa: BLE001 - truncated, not a torch file, ...
        raise CheckpointError(f"{path}: not a readable checkpoint file: {str(error).splitlines()[0][:200]}") from None
    if refused and not trust_pickles:
        raise CheckpointError(
            f"{path}: safe loading refuses {refused} (it allows tensors, containers and DeepSpeed's own classes):"
            " unpickling it could run code; pass --trust-pickles (trust_pickles=True) only for a checkpoint you trust"
        )
    if refused:
        try:
            loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=False, pickle_module=_TRUSTED_PICKLE)
        except Exception as error:  # noqa: BLE001 - a class of a module not installed here, ...
            raise CheckpointError(f"{path}: cannot be unpickled: {str(error).splitlines()[0][:200]}") from None
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{path}: not a DeepSpeed checkpoint file (holds a {type(loaded).__name__})")
    return loaded


def _tag_dir(ds_dir: Path) -> Path:
    """The directory holding the files: ``ds_dir/<tag named by latest>``, or ``ds_dir`` itself."""
    if not ds_dir.is_dir():
        raise CheckpointError(f"{ds_dir}: no such directory")
    if (ds_dir / "latest").is_file():
        tag = (ds_dir / "latest").read_text().strip()
        if not tag or not (ds_dir / tag).is_dir():
            raise CheckpointError(f"{ds_dir / 'latest'}: names tag {tag!r}, but {ds_dir / tag} is not a directory")
        return ds_dir / tag
    return ds_dir


def _files(tag_dir: Path) -> tuple[dict[int, Path], dict[int, Path]]:
    """Model-states files (-1: the one of stages 1/2) and optimizer files, by data-parallel rank."""
    models: dict[int, Path] = {}
    optims: dict[int, Path] = {}
    for path in sorted(tag_dir.iterdir()):
        if path.name.startswith(("layer_", "expert_")):
            kind = "pipeline-parallel" if path.name.startswith("layer_") else "mixture-of-experts"
            raise CheckpointError(f"{path}: {kind} DeepSpeed checkpoints are not supported")
        match = _MODEL.fullmatch(path.name) or _OPTIM.fullmatch(path.name)
        if match is None:
            continue
        if int(match.group(2)) != 0:
            raise CheckpointError(f"{path}: tensor-parallel checkpoints (model-parallel rank > 0) are not supported")
        rank = -1 if match.group(1) is None else int(match.group(1))
        (optims if match.re is _OPTIM else models)[rank] = path
    if not models:
        raise CheckpointError(f"{tag_dir}: not a DeepSpeed checkpoint: no mp_rank_00_model_states.pt, no 'latest' file")
    return models, optims


def _stage12(flats: list[Tensor], shapes: dict[str, Any], paddings: list[int], world: int, where: str) -> dict:
    """Cuts one param group, flattened (padding after each parameter) and split in rank partitions."""
    flat = torch.cat([f.detach().reshape(-1) for f in flats])  # the master partitions were saved as parameters
    out, offset = {}, 0
    for (name, shape), padding in zip(shapes.items(), paddings):
        numel = math.prod(shape)
        if offset + numel > flat.numel():
            raise CheckpointError(f"{where}: holds {flat.numel()} elements, too few for {name} {tuple(shape)}")
        out[name] = flat[offset : offset + numel].view(tuple(shape)).clone()
        offset += numel + padding

    def align(n: int) -> int:  # the group is padded to a multiple of 2 * world (older saves keep part of it)
        return -(-n // (2 * world)) * 2 * world

    if align(offset) != align(flat.numel()):
        raise CheckpointError(f"{where}: holds {flat.numel()} elements, its parameters {offset}")
    return out


def _stage3(flats: list[Tensor], shapes: dict[str, Any], world: int, where: str) -> dict:
    """Cuts one sub-group: per parameter, each rank's ``ceil(numel / world)`` elements in turn."""
    flats = [f.detach().reshape(-1) for f in flats]  # the master partitions were saved as parameters
    out, offset = {}, 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        part = -(-numel // world)
        out[name] = torch.cat([f[offset : offset + part] for f in flats])[:numel].view(tuple(shape)).clone()
        offset += part
    if any(f.numel() != offset for f in flats):
        sizes = sorted({f.numel() for f in flats})
        raise CheckpointError(f"{where}: holds {sizes} elements per rank, its parameters need {offset}")
    return out


def _optimizer_state(
    bases: list[Any], flats: list[list[Tensor]], names: list[list[str]], cut
) -> tuple[dict | None, str]:
    """Torch's optimizer state_dict over parameters, from each rank's base optimizer's over its partitions
    (flat group ``k`` is its parameter ``k``; ``names[k]``: its parameters in the user's param group order),
    or None and why the layout does not allow it."""
    if not all(isinstance(b, dict) and {"state", "param_groups"} <= set(b) for b in bases):
        return None, "no torch optimizer state_dict per rank (an elastic checkpoint or a DeepSpeed optimizer)"
    indices = [i for group in bases[0]["param_groups"] for i in group["params"]]
    if indices != list(range(len(names))):
        return None, f"the optimizer's param groups hold {indices}, not the {len(names)} flat groups"
    state: dict[int, dict[str, Any]] = {}
    for k, group_names in enumerate(names):
        per_rank = [b["state"].get(k) for b in bases]
        if all(s is None for s in per_rank):
            continue  # never stepped
        if any(s is None for s in per_rank):
            return None, f"some ranks have no optimizer state for flat group {k}"
        elementwise = [key for key, v in per_rank[0].items() if torch.is_tensor(v) and v.dim() > 0]
        # Each rank's state covers its partition and (stages 1/2) the group's end padding: cut off as the weights'.
        pieces = {
            key: cut(k, [s[key].reshape(-1)[: f[k].numel()] for s, f in zip(per_rank, flats)]) for key in elementwise
        }
        scalars = {key: v for key, v in per_rank[0].items() if key not in elementwise}
        if not torch.is_tensor(scalars.get("step")):  # DeepSpeed's Adams: an int, or (FusedAdam) in the group
            step = scalars.get(
                "step", next((g.get("step") for g in bases[0]["param_groups"] if k in g["params"]), None)
            )
            if step is not None:
                scalars["step"] = torch.tensor(float(step))  # as torch's Adam keeps it
        first = sum(len(n) for n in names[:k])
        for index, name in enumerate(group_names, start=first):
            # A tensor per parameter: torch steps "step" in place, so parameters must not share it.
            state[index] = {key: v.clone() if torch.is_tensor(v) else v for key, v in scalars.items()}
            state[index].update({key: pieces[key][name] for key in elementwise})
    param_groups, first = [], 0
    for group in bases[0]["param_groups"]:
        count = sum(len(names[k]) for k in group["params"])
        hyper = {key: v for key, v in group.items() if key != "params"}
        # By name too (torch's own optional key), so a resume can match parameters when the groups also
        # hold frozen ones, which DeepSpeed leaves out of its flat groups.
        group_names = [n.removeprefix(_LIGHTNING_PREFIX) for k in group["params"] for n in names[k]]
        param_groups.append({**hyper, "params": list(range(first, first + count)), "param_names": group_names})
        first += count
    return {"state": state, "param_groups": param_groups}, "with optimizer state"


def _stage_of(state: dict[str, Any]) -> Any:
    value = (state.get("optimizer_state_dict") or {}).get("zero_stage")
    return value.args[0] if isinstance(value, _Stub) and value.args else value  # DeepSpeed's ZeroStageEnum(n)


def _read_optimizers(tag_dir: Path, files: dict[int, Path], trust: bool) -> tuple[int, int, list[dict[str, Any]]]:
    """The ZeRO stage, the world size and every rank's optimizer file, checked to be of one save."""
    if not files:
        raise CheckpointError(f"{tag_dir}: no *_optim_states.pt files: not a ZeRO stage 1, 2 or 3 checkpoint")
    loaded = {rank: _load(path, trust) for rank, path in files.items()}
    lowest = min(loaded)
    stage, counts = _stage_of(loaded[lowest]), (loaded[lowest].get("optimizer_state_dict") or {}).get("partition_count")
    if stage not in (1, 2, 3):
        raise CheckpointError(f"{files[lowest]}: ZeRO stage {stage!r} is not supported (1, 2 or 3)")
    seen = {counts} if isinstance(counts, int) else set(counts or [])  # stages 1/2: per param group
    world = seen.pop() if len(seen) == 1 else 0  # mixture-of-experts groups differ: not supported
    if not isinstance(world, int) or world < 1:
        raise CheckpointError(f"{files[lowest]}: partition counts {counts!r} are not one world size")
    for rank in range(world):
        if rank not in loaded:
            name = files[lowest].name.replace(f"zero_pp_rank_{lowest}_", f"zero_pp_rank_{rank}_")
            raise CheckpointError(f"{tag_dir / name}: missing (the checkpoint was saved by {world} ranks)")
    for rank, state in loaded.items():
        if rank >= world or state["optimizer_state_dict"].get("partition_count") != counts or _stage_of(state) != stage:
            raise CheckpointError(
                f"{files[rank]}: not of the same save as {files[0].name} (ZeRO stage {stage}, {world} ranks):"
                " a mix of checkpoints, or saved at another world size"
            )
    return stage, world, [loaded[rank]["optimizer_state_dict"] for rank in range(world)]


def _read_models(tag_dir: Path, files: dict[int, Path], stage: int, world: int, trust: bool) -> list[dict[str, Any]]:
    """The model-states file (stages 1/2) or every rank's (stage 3)."""
    ranks = list(range(world)) if stage == 3 else [-1]
    for rank in ranks:
        if rank not in files:
            name = f"zero_pp_rank_{rank}_mp_rank_00" if rank >= 0 else "mp_rank_00"
            raise CheckpointError(f"{tag_dir / name}_model_states.pt: missing (ZeRO stage {stage})")
    models = [_load(files[rank], trust) for rank in ranks]
    model, where = models[0], files[ranks[0]]
    if not isinstance(model.get("module"), dict) or not isinstance(model.get("param_shapes"), list):
        raise CheckpointError(f"{where}: not a ZeRO model-states file (no module state dict or parameter shapes)")
    if model.get("dp_world_size", world) != world:
        raise CheckpointError(f"{where}: saved by {model['dp_world_size']} ranks, the optimizer files by {world}")
    return models


def _state_dict(models: list[dict[str, Any]], trained: dict[str, Tensor], stage: int, where: Path) -> dict:
    """The module's state dict in its order, in fp32: trained parameters from the master partitions, frozen
    ones from their fragments (stage 1 saves none: the module holds them whole), tied names, buffers."""
    model = models[0]
    frozen = {}
    for name, shape in (model.get("frozen_param_shapes") or {}).items():
        fragments = torch.cat([m["frozen_param_fragments"][name].reshape(-1) for m in models])
        if fragments.numel() < math.prod(shape):
            raise CheckpointError(f"{where}: frozen {name} has {fragments.numel()} elements, not {tuple(shape)}")
        frozen[name] = fragments[: math.prod(shape)].view(tuple(shape))
    shared = model.get("shared_params") or {}
    state_dict = {}
    for name, value in model["module"].items():
        if name in shared:
            continue  # filled in from its target below
        value = trained.get(name, frozen.get(name, value))
        if stage == 3 and value is model["module"][name] and name not in model.get("buffer_names", []):
            raise CheckpointError(f"{where}: no data for {name}: neither trained, frozen nor tied")  # a placeholder
        # One copy each (own storage, not a view into a whole flat group; fp32 from bf16/fp16 in the same step)
        state_dict[name] = value.to(torch.float32 if value.is_floating_point() else value.dtype, copy=True)
    for name, target in shared.items():
        if target in state_dict:
            state_dict[name] = state_dict[target]
    return {k.removeprefix(_LIGHTNING_PREFIX): state_dict[k] for k in model["module"] if k in state_dict}


def _convert(ds_dir: Path, output: Path, trust_pickles: bool) -> tuple[str, bool]:
    """Writes ``output``; returns a summary and whether it holds the optimizer state."""
    if output.exists() or not output.parent.is_dir():
        why = "exists (nothing is overwritten: remove it or choose another name)" if output.exists() else None
        raise CheckpointError(f"{output}: {why or f'no such directory to write it into: {output.parent}'}")
    tag_dir = _tag_dir(ds_dir)
    model_files, optim_files = _files(tag_dir)
    stage, world, optims = _read_optimizers(tag_dir, optim_files, trust_pickles)
    models = _read_models(tag_dir, model_files, stage, world, trust_pickles)
    model, where = models[0], model_files[0 if stage == 3 else -1]
    key = "single_partition_of_fp32_groups" if stage < 3 else "fp32_flat_groups"
    flats, shapes = [o.get(key) for o in optims], model["param_shapes"]
    paddings = optims[0].get("param_alignment_paddings") or [[0] * len(s) for s in shapes]  # older saves: none
    for rank, groups in enumerate(flats):
        if not isinstance(groups, list) or len(groups) != len(shapes):
            raise CheckpointError(f"{optim_files[rank]}: {key} is not the {len(shapes)} flat groups {where.name} says")
    if list(map(len, paddings)) != list(map(len, shapes)):
        raise CheckpointError(f"{optim_files[0]}: param_alignment_paddings do not match {where.name}'s parameters")

    def cut(k: int, per_rank: list[Tensor]) -> dict[str, Tensor]:
        at = f"{optim_files[0]}: flat group {k}"
        if stage < 3:
            return _stage12(per_rank, shapes[k], paddings[k], world, at)
        return _stage3(per_rank, shapes[k], world, at)

    trained = {name: value for k in range(len(shapes)) for name, value in cut(k, [f[k] for f in flats]).items()}
    state_dict = _state_dict(models, trained, stage, where)
    names = [list(group) for group in shapes]  # each group's parameters in the optimizer's order
    config = model.get("ds_config") if isinstance(model.get("ds_config"), dict) else {}
    if stage < 3 and (config.get("zero_optimization") or {}).get("round_robin_gradients"):
        # Then stages 1/2 flatten a group's parameters i = 0, W, 2W, ... first, then 1, W + 1, ...: undo it.
        for k, group in enumerate(names):
            flattened_from = sorted(range(len(group)), key=lambda i: (i % world, i))
            names[k] = [name for _, name in sorted(zip(flattened_from, group))]
    bases = [o.get("base_optimizer_state" if stage < 3 else "optimizer_state_dict") for o in optims]
    optimizer, note = _optimizer_state(bases, flats, names, cut)
    checkpoint = {k: v for k, v in model.items() if k not in _DEEPSPEED_KEYS}  # the client state
    checkpoint.setdefault("global_step", model.get("global_steps", 0))
    checkpoint.setdefault("pytorch-lightning_version", lightning.__version__)
    checkpoint.setdefault("lr_schedulers", [])  # DeepSpeed's own scheduler is not Lightning's: it restarts
    checkpoint["state_dict"] = state_dict
    if optimizer is not None:
        checkpoint["optimizer_states"] = [optimizer]
    write_atomically(output, lambda f: torch.save(checkpoint, f))
    held = note if optimizer is not None else f"without optimizer state ({note})"
    summary = f"{output}: ZeRO stage {stage} checkpoint of {world} ranks, {len(state_dict)} tensors, {held}"
    return summary, optimizer is not None


def convert(ds_dir: str | Path, output: str | Path, *, trust_pickles: bool) -> str:
    """Writes the DeepSpeed ZeRO checkpoint ``ds_dir`` (the save directory or its tag directory) as the plain
    Lightning checkpoint file ``output``: fp32 weights, the optimizer's state where the layout allows,
    and the client state (Lightning's, under DeepSpeedStrategy). Returns a one-line summary (which says
    when the optimizer state could not be converted); raises CheckpointError."""
    summary, complete = _convert(Path(ds_dir), Path(output), trust_pickles)
    if not complete:
        log.warning(summary)
    return summary
