"""Stage 3 set-up: which unit owns which parameter, sharded initialization from the meta device, the
full state dict gathered unit by unit, and ``load_state_dict`` into the shards.

[Note: unit ownership]
Units are modules: those whose class name is in ``unit_module_classes``, or by default every child of
an ``nn.ModuleList`` (transformer blocks); a candidate inside another one belongs to the outer unit,
so units never nest and their forwards never overlap (which the schedule relies on). A parameter
belongs to the unit that encloses every module registering it; parameters of no unit form the root
unit, gathered for the whole step. Frozen parameters are sharded too: a unit's frozen parameters form
a flat unit of their own (its shard only: no master weights, gradients or optimizer state), gathered
with the trainable one.
A weight tied between the embedding and the output head therefore lands in the unit enclosing both
(the root), so each of its uses finds it gathered. Buffers are not sharded.

[Note: sharded initialization]
A model built on the meta device (``configure_model`` under the strategy) is materialized without
ever holding it whole: modules are visited in ``Module.apply`` order; each one's own sharded
parameters are created full-size for a moment (filled with NaN), initialized by
``lightning_module.init_module(module, generator)`` when the LightningModule defines it, else by
``module.reset_parameters()``, and only this rank's piece is kept. Every rank draws from a generator
seeded with rank 0's ``torch.initial_seed()``, so the values equal those of a whole model initialized
by the same procedure with the same seed (``model.apply(lambda m: init(m, generator))``, as the GPT's
``init_weights`` does). A parameter left NaN
was not initialized by its module: that is an error, not silent garbage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.nn import Module, ModuleDict, ModuleList, Parameter, ParameterDict, ParameterList

from lightning_zero.sharding import collectives
from lightning_zero.sharding.flat_unit import FlatUnit
from lightning_zero.sharding.layout import build_layout
from lightning_zero.sharding.stage3 import Stage3Runtime
from lightning_zero.sharding.unit_index import UnitIndex

InitFn = Callable[[Module, torch.Generator], None]


@dataclass
class ShardedModule:
    """A LightningModule's stage-3 shards, kept on the module between Trainer runs (``fit`` then
    ``validate``, or a second ``fit``): the module stays sharded, and a later zero3 run on the same
    ranks continues from these shards instead of the NaN placeholders."""

    units: list[FlatUnit]
    modules: list[Module | None]
    world_size: int
    rank: int
    load_hooks: list

    _ATTRIBUTE = "_lightning_zero_shards"

    @classmethod
    def of(cls, module: Module) -> ShardedModule | None:
        """The shards kept on ``module``, or None when it is not sharded."""
        return module.__dict__.get(cls._ATTRIBUTE)

    @classmethod
    def attach(cls, module: Module, units, modules, *, world_size: int, rank: int) -> ShardedModule:
        """Keeps ``units`` (``modules[i]`` the module of ``units[i]``, None for the root) on ``module``, sharded as rank
        ``rank`` of ``world_size``: installs its ``load_state_dict`` hooks and attaches the ``UnitIndex``."""
        sharded = cls(list(units), list(modules), world_size, rank, install_load_hooks(module, units))
        module.__dict__[cls._ATTRIBUTE] = sharded
        UnitIndex(units).attach(module)
        return sharded

    @classmethod
    def detach(cls, module: Module) -> None:
        """Forgets ``module``'s shards (if any): removes the ``UnitIndex`` and the ``load_state_dict`` hooks."""
        UnitIndex.detach(module)
        sharded = module.__dict__.pop(cls._ATTRIBUTE, None)
        for handle in sharded.load_hooks if sharded is not None else ():
            handle.remove()

    def check(self, *, world_size: int, rank: int) -> None:
        """Refuses to continue from these shards as another rank or on another number of ranks.

        Raises:
            ValueError: ``(world_size, rank)`` is not what the shards were made for.
        """
        if (world_size, rank) != (self.world_size, self.rank):
            raise ValueError(
                f"the model is sharded by an earlier zero3 run as rank {self.rank} of {self.world_size}, not rank"
                f" {rank} of {world_size}; call trainer.strategy.gather_module() after that run, or resume from its"
                " checkpoint"
            )


_CONTAINERS = (ModuleList, ModuleDict, ParameterList, ParameterDict)  # have no forward to hook


def unit_modules(model: Module, unit_module_classes: Sequence[str], min_params: int = 0) -> list[Module]:
    """The modules that become units (see [Note: unit ownership]), in ``model.modules()`` order."""
    if unit_module_classes:
        found = [m for m in model.modules() if m is not model and type(m).__name__ in unit_module_classes]
        missing = set(unit_module_classes) - {type(m).__name__ for m in found}
        if missing:
            raise ValueError(f"zero.unit_module_classes names {sorted(missing)}, which the model does not contain")
    else:
        found = [c for m in model.modules() if isinstance(m, ModuleList) for c in m.children()]
    candidates = {id(c) for c in found}
    chosen: set[int] = set()

    def walk(module: Module, inside: bool) -> int:
        """Marks the outermost candidates; returns the parameters of ``module`` that no unit holds yet."""
        if id(module) in candidates and not inside:
            chosen.add(id(module))
            inside = True
        free = sum(p.numel() for p in module._parameters.values() if p is not None)
        free += sum(walk(child, inside) for child in module.children())
        if inside or id(module) in chosen:
            return 0
        # By size: the smallest modules outside any unit that hold at least min_params parameters.
        if min_params and not unit_module_classes and free >= min_params and module is not model:
            if not isinstance(module, _CONTAINERS):
                chosen.add(id(module))
                return 0
        return free

    walk(model, False)
    return [m for m in dict.fromkeys(model.modules()) if id(m) in chosen]


def _unit_chains(model: Module, units: Sequence[Module]) -> Iterator[tuple[Module, tuple[Module, ...]]]:
    """Every (module, enclosing units from outermost to innermost), once per place it is registered."""
    unit_ids = {id(u) for u in units}

    def walk(module: Module, chain: tuple[Module, ...]) -> Iterator:
        chain = chain + (module,) if id(module) in unit_ids else chain
        yield module, chain
        for child in module.children():
            yield from walk(child, chain)

    yield from walk(model, ())


def assign_units(model: Module, units: Sequence[Module]) -> list[tuple[Module | None, list[Parameter]]]:
    """Parameters grouped by owning unit (see [Note: unit ownership]); None is the root."""
    chains: dict[int, list[tuple[Module, ...]]] = {}
    for module, chain in _unit_chains(model, units):
        for p in module._parameters.values():
            if p is not None:
                chains.setdefault(id(p), []).append(chain)
    owned: dict[int, list[Parameter]] = {}
    for p in dict.fromkeys(model.parameters()):
        common = chains[id(p)][0]
        for chain in chains[id(p)][1:]:
            n = 0
            while n < min(len(common), len(chain)) and common[n] is chain[n]:
                n += 1
            common = common[:n]
        owned.setdefault(id(common[-1]) if common else id(model), []).append(p)
    assignment = [(u, owned[id(u)]) for u in units if id(u) in owned]
    if id(model) in owned:
        assignment.append((None, owned[id(model)]))
    return assignment


def build_units(
    model: Module,
    config,
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    trainable: bool,
    materialize: Callable[[list[Parameter]], None] | None = None,
    holder: Mapping[int, int] | None = None,
    group=None,
) -> tuple[list[FlatUnit], list[Module | None]]:
    """Single-bucket, parameter-sharded FlatUnits for each owning unit; meta parameters are replaced.

    ``materialize(params)`` makes a unit's parameters whole right before its flat units are built (a
    model from ``ShardedConstruction``), so no more than one unit is ever whole. ``holder`` maps
    ``id(param)`` to the optimizer that steps it: a unit's parameters of different optimizers (a GAN's
    generator and discriminator in the root unit) get flat units of their own."""
    names = {p: n for n, p in model.named_parameters(remove_duplicate=True)}
    assignment = assign_units(model, unit_modules(model, config.unit_module_classes, config.unit_min_params))
    root = sum(p.numel() for module, params in assignment if module is None for p in params)
    total = sum(p.numel() for _, params in assignment for p in params)
    if root > 0.5 * total and root >= config.unit_min_params > 0:
        rank_zero_warn(
            f"zero3: the root unit (parameters of no unit, gathered for the whole step) holds {root:,} of the"
            f" model's {total:,} parameters; name the modules to shard one by one in zero.unit_module_classes,"
            " or lower zero.unit_min_params"
        )
    signature = [[(names[p], tuple(p.shape)) for p in params] for _, params in assignment]
    for r, other in enumerate(collectives.all_gather_object(signature, group=group)):
        if other != signature:
            raise RuntimeError(f"rank {rank} and rank {r} see different models: their stage-3 units differ")
    units, modules, replaced = [], [], {}
    for module, params in assignment:
        if materialize is not None:
            materialize(params)
        # One flat unit per kind of parameter the module owns: trainable ones (master weights, gradients)
        # and frozen ones (the shard only), one per dtype; all are gathered together.
        kinds: dict[tuple[bool, torch.dtype, int], list[Parameter]] = {}
        for p in params:
            kinds.setdefault((p.requires_grad, p.dtype, (holder or {}).get(id(p), -1)), []).append(p)
        for (requires_grad, _, _), members in kinds.items():
            numels = [p.numel() for p in members]
            layout = build_layout(numels, world_size, bucket_numel=sum(numels))
            unit = FlatUnit(
                members,
                [names[p] for p in members],
                layout,
                rank,
                shard_params=True,
                trainable=trainable and requires_grad,
                device=device,
                **config.unit_options(members[0].dtype),
            )
            units.append(unit)
            modules.append(module)
            replaced.update({id(old): new for old, new in unit.replaced.items()})
    if replaced:
        for m in model.modules():
            for name, p in m._parameters.items():
                if p is not None and id(p) in replaced:
                    m._parameters[name] = replaced[id(p)]
    return units, modules


def shard_module(
    module: Module,
    config,
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    dtype: torch.dtype | None,
    construction=None,
    holder: Mapping[int, int] | None = None,
) -> ShardedModule:
    """Stage 3's first set-up of ``module``: its units built one at a time, each made whole from the
    ``construction`` (a ``ShardedConstruction``, when ``configure_model`` built it) or from the module, in
    ``dtype`` when given. Trainable when ``holder`` (see ``build_units``) is given, i.e. when fitting."""

    def materialize(params: list[Parameter]) -> None:
        if construction is not None:
            construction.materialize(params, dtype)
        elif dtype is not None:
            for p in params:
                if p.is_floating_point():
                    p.data = p.data.to(dtype)

    units, modules = build_units(
        module,
        config,
        rank=rank,
        world_size=world_size,
        device=device,
        trainable=holder is not None,
        materialize=materialize,
        holder=holder,
    )
    return ShardedModule.attach(module, units, modules, world_size=world_size, rank=rank)


def _apply_order(module: Module) -> Iterator[Module]:
    for child in module.children():
        yield from _apply_order(child)
    yield module


def default_init(module: Module, generator: torch.Generator) -> None:
    """Initializes ``module``'s own parameters by its ``reset_parameters()``, if it has one (``generator`` unused)."""
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()


def initialize_sharded(
    model: Module, units: Sequence[FlatUnit], init: InitFn, *, device: torch.device, group=None
) -> int:
    """Materializes a meta-built model as shards (see [Note: sharded initialization]).

    Returns the largest number of bytes held by temporary full-size parameters at any moment.
    """
    seed = collectives.all_gather_object(torch.initial_seed(), group=group)[0]
    generator = torch.Generator(device=device).manual_seed(seed)
    locate = {id(p): (u, i) for u in units for i, p in enumerate(u.params)}
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    real: dict[int, Parameter] = {}
    for module in model.modules():  # parameters of no unit and buffers are replicated: make them real
        for name, p in module._parameters.items():
            if p is not None and p.is_meta:
                if id(p) not in real:
                    real[id(p)] = Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                module._parameters[name] = real[id(p)]
        for name, b in module._buffers.items():
            if b is not None and b.is_meta:
                module._buffers[name] = torch.empty_like(b, device=device)
    peak = 0
    with torch.no_grad():
        for module in _apply_order(model):
            temporary: dict[str, Parameter] = {}
            for name, p in module._parameters.items():
                if p is not None and id(p) in locate:
                    unit, index = locate[id(p)]
                    full = torch.full(unit.shapes[index], float("nan"), dtype=unit.param_dtype, device=device)
                    module._parameters[name] = Parameter(full, requires_grad=p.requires_grad)
                    temporary[name] = p
            peak = max(peak, sum(module._parameters[n].nbytes for n in temporary))
            init(module, generator)
            for name, p in temporary.items():
                value: Tensor = module._parameters[name]
                if torch.isnan(value).any():
                    raise ValueError(
                        f"parameter {names[id(p)]!r} ({type(module).__name__}) was not initialized: on the meta"
                        " device every module must initialize its own parameters through reset_parameters() or"
                        " the LightningModule's init_module(module, generator)"
                    )
                unit, index = locate[id(p)]
                unit.write_owned(index, value)
                module._parameters[name] = p
    return peak


def gather_module(runtime: Stage3Runtime, device: torch.device) -> None:
    """Ends sharding: every parameter becomes a plain tensor on ``device`` with its full value, one unit
    gathered at a time (collective)."""
    for unit in runtime.units:
        with runtime.gathered(unit):
            whole = [p.data.to(device, copy=True) for p in unit.params]
        runtime.mark_whole(unit)
        for p, value in zip(unit.params, whole):
            p.data = value


def install_load_hooks(model: Module, units: Sequence[FlatUnit]) -> list:
    """Lets ``model.load_state_dict`` write the parameters of ``units``: each rank keeps its own piece of
    every value (in the master, and stage 3's shard), and a parameter that is whole gets the whole value;
    stage 3's placeholders are never written. Returns the hook handles."""
    locate = UnitIndex(units)
    handles = []
    for module in model.modules():
        if not any(locate(p) for p in dict.values(module._parameters) if p is not None):
            continue
        taken: dict[str, list] = {}

        def before(module: Module, state_dict: dict, prefix: str, *args, taken=taken) -> None:
            """Writes the sharded values and hides them (and their keys) from the default copy."""
            taken["order"] = list(dict.items(module._parameters))
            for name, p in taken["order"]:
                key = prefix + name
                value = state_dict.get(key)
                located = locate(p) if p is not None else None
                if located is None or value is None or tuple(value.shape) != tuple(p.shape):
                    continue  # torch reports what is missing or of the wrong shape
                unit, index = located
                unit.write_owned(index, value)
                if unit.gathered:
                    with torch.no_grad():
                        p.data.copy_(value)
                del state_dict[key]
                dict.__delitem__(module._parameters, name)

        def after(module: Module, incompatible_keys, taken=taken) -> None:
            dict.clear(module._parameters)
            dict.update(module._parameters, taken.pop("order", []))

        handles.append(module.register_load_state_dict_pre_hook(before))
        handles.append(module.register_load_state_dict_post_hook(after))
    return handles
