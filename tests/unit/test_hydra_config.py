"""The Hydra example refuses a bad value with the config's own message before any process group exists."""

from __future__ import annotations

import pytest
import torch

from tests.support.helpers import hydra_app_config


def test_bad_value_fails_before_any_process_starts():
    config, app = hydra_app_config("model=tiny", "strategy.config.reduce_bucket_size=-1")
    with pytest.raises(Exception, match="zero.reduce_bucket_size must be an integer > 0 \\(elements\\), got -1"):
        app(config)
    assert not torch.distributed.is_initialized()
