"""How a ZeroOptimizer shows the user's param groups, and the hook registries torch's Optimizer keeps."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from torch.nn import Parameter


class ParamGroupView(MutableMapping):
    """One of the user's param groups as ``ZeroOptimizer.param_groups`` shows it.

    [Note: param group views]
    It lists the model's own parameters (as the optimizer built in ``configure_optimizers`` had them),
    so LR schedulers, LearningRateMonitor and fine-tuning callbacks see what they expect, while every
    other key (lr, weight_decay, ...) is the wrapped optimizer's own group, which steps this rank's
    pieces: a new lr written here, or by a scheduler bound to the unwrapped optimizer, is the one used.
    """

    def __init__(self, inner: dict[str, Any], params: list[Parameter]) -> None:
        self.inner = inner
        self.params = params

    def __getitem__(self, key: str) -> Any:
        return self.params if key == "params" else self.inner[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "params":
            raise ValueError("a sharded param group's parameters cannot be replaced; use add_param_group")
        self.inner[key] = value

    def __delitem__(self, key: str) -> None:
        del self.inner[key]

    def __iter__(self):
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)

    def __repr__(self) -> str:
        return repr({k: (f"<{len(self.params)} parameters>" if k == "params" else v) for k, v in self.items()})


# what Optimizer.__init__ makes for its hook registrations (zero_optimizer.py: [Note: an Optimizer to whoever asks])
HOOKS = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)
