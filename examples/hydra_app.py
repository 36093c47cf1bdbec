"""Train with configs composed by Hydra (pip install 'lightning-zero[hydra]').

    python examples/hydra_app.py                                    # zero2, fp32, the small GPT, 2 CPU processes
    python examples/hydra_app.py strategy=zero3 model=tiny          # pick from the config groups
    python examples/hydra_app.py strategy.stage=3 trainer.devices=4 # or override any value
    python examples/hydra_app.py precision=16-mixed model=tiny

The config tree is configs/hydra/: model/, strategy/ and precision/ groups composed by config.yaml.
Every object is built with hydra.utils.instantiate from its _target_; a bad value (say
strategy.config.reduce_bucket_size=-1) fails with the config's message before any process starts.
"""

from __future__ import annotations

import hydra
import lightning.pytorch as pl
from hydra.utils import instantiate
from omegaconf import DictConfig

import lightning_zero  # noqa: F401  (registers the zero strategies)


@hydra.main(version_base=None, config_path="../configs/hydra", config_name="config")
def main(cfg: DictConfig) -> None:
    pl.seed_everything(cfg.seed)
    strategy = instantiate(cfg.strategy, _convert_="all")
    precision = (
        {"plugins": [instantiate(cfg.precision.plugin, _convert_="all")]}
        if cfg.precision.plugin
        else {"precision": cfg.precision.name}
    )
    trainer = instantiate(cfg.trainer, strategy=strategy, **precision, _convert_="all")
    trainer.fit(instantiate(cfg.model, _convert_="all"), instantiate(cfg.data, _convert_="all"))


if __name__ == "__main__":
    main()
