"""Building a model under stage 3 without ever holding it whole, with exactly the values its constructor
gives (``configure_model`` runs inside ``ShardedConstruction``).

[Note: sharded construction]
The constructor runs for real, on every rank, from rank 0's RNG state (broadcast first), so every
rank computes the values an unsharded construction computes, bitwise, whatever the constructor does:
``reset_parameters``, custom initializers, buffers such as RoPE's ``inv_freq``, a Hugging Face
``post_init`` that re-initializes every module, weight tying. What is bounded is how much of it is
whole at once. A global parameter-registration hook adopts every new parameter, and the registering
module's ``_parameters`` becomes a dict that makes a parameter whole before anyone reads it (attribute
access, ``parameters()``, ``state_dict()``). Making a parameter of one module whole first evicts the
least recently used parameters of other modules until the whole ones fit in ``max_whole_numel``
elements (``ZeroConfig.max_live_parameters``): each rank keeps only its slice of an evicted parameter
(1/N of its elements) and its ``.data`` becomes a NaN placeholder; reading it again all-gathers the
slices of the module's evicted parameters in one collective (every rank runs the same code, so the same
reads in the same order). So at most ``max_whole_numel`` elements, or one module's own parameters if
that is more, are whole at a time (``peak_bytes``); a model within the bound is built as it would be
unsharded, with no collective. After the context the stage-3 set-up builds each unit from its
parameters made whole one unit at a time (``materialize``: those still whole as they are, the others
gathered) and keeps the pieces the unit's layout gives this rank.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor
from torch.nn import Module, Parameter
from torch.nn.modules.module import register_module_parameter_registration_hook

from lightning_zero.sharding import collectives


class _Managed:
    """One adopted parameter: this rank's slice while evicted, and the modules that register it."""

    __slots__ = ("param", "owners", "slice", "numel", "nbytes")

    def __init__(self, param: Parameter) -> None:
        self.param = param
        self.owners: set[int] = set()
        self.slice: Tensor | None = None
        self.numel = param.numel()
        self.nbytes = self.numel * param.element_size()


class _MaterializingParameters(dict):
    """A module's ``_parameters`` during construction: every read hands out a whole parameter."""

    def __init__(self, construction: ShardedConstruction, module: Module, params: dict) -> None:
        super().__init__(params)
        self.construction = construction
        self.module = module

    def __getitem__(self, name: str):
        param = super().__getitem__(name)
        self.construction.touch(self.module, param)
        return param

    def get(self, name: str, default=None):
        return self[name] if name in self else default

    def items(self) -> Iterator:  # type: ignore[override]
        for name in list(self.keys()):
            yield name, self[name]

    def values(self) -> Iterator:  # type: ignore[override]
        for name in list(self.keys()):
            yield self[name]


class ShardedConstruction:
    """The context in which a model is built with at most ``max_whole_numel`` of its elements whole (see the
    Note above); afterwards it holds the evicted parameters' slices until ``materialize`` takes them.

    Args:
        rank: this rank's index in ``group``: which slice of an evicted parameter it keeps.
        world_size: the number of ranks of ``group``, into which each evicted parameter is sliced.
        device: where the model is built (the context makes it the default device).
        max_whole_numel: elements that may be whole at once (0: only the module in use).
        group (ProcessGroup | None): the group the slices are gathered over (None: the default group).
    """

    active: ShardedConstruction | None = None  # the one whose context is open (load_pretrained writes into it)

    def __init__(
        self, *, rank: int, world_size: int, device: torch.device, max_whole_numel: int = 0, group=None
    ) -> None:
        self.max_whole_numel = max_whole_numel
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.group = group
        self.managed: dict[int, _Managed] = {}
        self._whole: dict[int, _Managed] = {}  # the parameters that are whole now, least recently used first
        self._whole_numel = self._whole_bytes = 0
        self._modules: list[tuple[Module, dict]] = []  # (module, its own _parameters) to restore
        self.peak_bytes = 0
        self._hook = None

    # --- the context ------------------------------------------------------------------------------
    def __enter__(self) -> ShardedConstruction:
        # on the world: every rank (every replica, with hybrid sharding) constructs what rank 0 constructs
        states = collectives.all_gather_object(_rng_states(self.device))
        _set_rng_states(states[0], self.device)
        self._device_context = torch.device(self.device)
        self._device_context.__enter__()
        self._hook = register_module_parameter_registration_hook(self._registered)
        ShardedConstruction.active = self
        return self

    def __exit__(self, *exc) -> None:
        ShardedConstruction.active = None
        self._hook.remove()
        self._device_context.__exit__(*exc)
        for module, _ in self._modules:
            if isinstance(module._parameters, _MaterializingParameters):
                module._parameters = dict(dict.items(module._parameters))

    # --- adopting, evicting, making whole -------------------------------------------------------------
    def _registered(self, module: Module, name: str, param: Parameter | None) -> None:
        if param is None:
            return
        if not isinstance(module._parameters, _MaterializingParameters):
            module._parameters = _MaterializingParameters(self, module, dict(module._parameters))
            self._modules.append((module, module._parameters))
        managed = self.managed.get(id(param))
        if managed is None:
            managed = self.managed[id(param)] = _Managed(param)
            self._whole[id(param)] = managed
            self._whole_numel += managed.numel
            self._whole_bytes += managed.nbytes
        managed.owners.add(id(module))
        self.touch(module, param)

    def touch(self, module: Module, param: Parameter | None) -> None:
        """``param`` of ``module`` is about to be used: evict other modules' parameters, make it whole."""
        managed = self.managed.get(id(param)) if param is not None else None
        if managed is None:
            return
        to_gather: list[_Managed] = []
        if id(param) in self._whole:
            self._whole[id(param)] = self._whole.pop(id(param))  # most recently used
        else:  # with the module's other evicted parameters: one collective
            own = (self.managed.get(id(p)) for p in dict.values(module._parameters) if p is not None)
            to_gather = [managed, *(m for m in own if m is not None and m is not managed and m.slice is not None)]
        incoming = sum(m.numel for m in to_gather)
        for other in list(self._whole.values()):  # least recently used first
            if self._whole_numel + incoming <= self.max_whole_numel:
                break
            if id(module) not in other.owners:
                self._evict(other)
        if to_gather:
            self._make_whole(to_gather)
        self.peak_bytes = max(self.peak_bytes, self._whole_bytes)

    def _chunk(self, numel: int) -> int:
        return -(-numel // self.world_size)

    def _evict(self, managed: _Managed) -> None:
        param = managed.param
        chunk = self._chunk(managed.numel)
        flat = param.data.reshape(-1)
        own = torch.zeros(chunk, dtype=flat.dtype, device=flat.device)
        lo, hi = self.rank * chunk, min((self.rank + 1) * chunk, managed.numel)
        if lo < hi:
            own[: hi - lo].copy_(flat[lo:hi])
        managed.slice = own
        param.data = torch.full((1,), float("nan"), dtype=flat.dtype, device=flat.device).expand(param.shape)
        del self._whole[id(param)]
        self._whole_numel -= managed.numel
        self._whole_bytes -= managed.nbytes

    def _make_whole(self, evicted: list[_Managed]) -> None:
        """Gives evicted parameters their whole values back: every rank's slices, one all-gather per dtype."""
        by_dtype: dict[torch.dtype, list[_Managed]] = {}
        for managed in evicted:
            by_dtype.setdefault(managed.slice.dtype, []).append(managed)
        for same in by_dtype.values():
            packed = torch.cat([m.slice for m in same])  # this rank's slices, back to back
            rows = packed.new_empty(self.world_size * packed.numel())
            collectives.all_gather(rows, packed, async_op=False, group=self.group)
            rows, column = rows.view(self.world_size, -1), 0
            for managed in same:
                chunk = managed.slice.numel()
                whole = rows[:, column : column + chunk].reshape(-1)[: managed.numel]
                managed.param.data = whole.view(managed.param.shape)
                managed.slice = None
                self._whole[id(managed.param)] = managed
                self._whole_numel += managed.numel
                self._whole_bytes += managed.nbytes
                column += chunk

    # --- after construction ------------------------------------------------------------------------
    def materialize(self, params: list[Parameter], dtype: torch.dtype | None = None) -> None:
        """Makes ``params`` whole (collective; the stage-3 set-up calls it for one unit at a time),
        optionally cast to ``dtype``; they are no longer managed afterwards."""
        self._make_whole(
            [m for m in (self.managed.get(id(p)) for p in params) if m is not None and m.slice is not None]
        )
        for param in params:
            managed = self.managed.pop(id(param), None)
            if managed is not None and self._whole.pop(id(param), None) is not None:
                self._whole_numel -= managed.numel
                self._whole_bytes -= managed.nbytes
            if dtype is not None and param.is_floating_point():
                param.data = param.data.to(dtype)

    def owns(self, param: Parameter) -> bool:
        """Whether ``param`` was adopted during construction and is still managed (not yet materialized)."""
        return id(param) in self.managed

    def write(self, param: Parameter, read) -> None:
        """Sets ``param``'s value from ``read(lo, hi)`` (its flat elements [lo, hi)), reading only this
        rank's slice when the parameter is evicted."""
        managed = self.managed[id(param)]
        if id(param) in self._whole:
            self._evict(managed)  # its value is replaced: keep (and read) only this rank's slice
        chunk = self._chunk(managed.numel)
        lo, hi = self.rank * chunk, min((self.rank + 1) * chunk, managed.numel)
        if lo < hi:
            managed.slice[: hi - lo].copy_(read(lo, hi))


def _rng_states(device: torch.device) -> dict:
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def _set_rng_states(states: dict, device: torch.device) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)
