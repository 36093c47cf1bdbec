"""lightning_zero: DeepSpeed's ZeRO optimizations as a native PyTorch Lightning strategy.

Importing the package registers the strategy names ``zero1``, ``zero2`` and ``zero3`` in Lightning's
registries, so ``Trainer(strategy="zero2")`` and ``Fabric(strategy="zero2")`` work after ``import lightning_zero``.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGIES
from lightning.pytorch.strategies import StrategyRegistry

from lightning_zero.checkpoint.dcp_export import export_dcp
from lightning_zero.checkpoint.hugging_face import export_hugging_face
from lightning_zero.checkpoint.pretrained import load_pretrained
from lightning_zero.config import LossScaleConfig, ZeroConfig
from lightning_zero.front.fabric import ZeroFabricStrategy
from lightning_zero.front.gathered import gathered_parameters, parameter_norms
from lightning_zero.front.grad_norms import grad_norm
from lightning_zero.front.precision import ZeroPrecision
from lightning_zero.front.script import ScriptEngine, Session, init_distributed, initialize
from lightning_zero.front.strategy import ZeroStrategy
from lightning_zero.resilience.preemption import Preempted, PreemptionCheckpoint
from lightning_zero.resilience.resumable_data import ResumableSampler, resumable_loader

__all__ = [
    "LossScaleConfig",
    "Preempted",
    "PreemptionCheckpoint",
    "ResumableSampler",
    "ScriptEngine",
    "Session",
    "ZeroConfig",
    "ZeroFabricStrategy",
    "ZeroPrecision",
    "ZeroStrategy",
    "export_dcp",
    "export_hugging_face",
    "gathered_parameters",
    "grad_norm",
    "init_distributed",
    "initialize",
    "load_pretrained",
    "parameter_norms",
    "resumable_loader",
]
__version__ = "0.1.0"

if "zero1" not in StrategyRegistry:
    ZeroStrategy.register_strategies(StrategyRegistry)
if "zero1" not in FABRIC_STRATEGIES:
    ZeroFabricStrategy.register_strategies(FABRIC_STRATEGIES)
