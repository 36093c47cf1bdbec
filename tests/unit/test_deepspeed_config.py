"""DeepSpeed JSON configs read into our config and the Trainer's arguments, table-driven, with configs
shaped like those popular projects ship for ZeRO-2 and ZeRO-3."""

from __future__ import annotations

import json
import warnings

import lightning.pytorch as pl
import pytest

from lightning_zero import LossScaleConfig, ZeroConfig, ZeroPrecision, ZeroStrategy
from lightning_zero.deepspeed_config import read_deepspeed_config

# In the style of the ZeRO-2 config Hugging Face's trainer documentation ships
ZERO2 = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto"}},
    "zero_optimization": {
        "stage": 2,
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
# ZeRO-3 in bf16 with explicit values, in the style of large-model fine-tuning repositories
ZERO3 = {
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "none"},
        "offload_param": {"device": "none"},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": 1e4,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "train_micro_batch_size_per_gpu": 8,
}
FP16_STATIC = {"fp16": {"enabled": True, "loss_scale": 128}, "zero_optimization": {"stage": 1}}


@pytest.mark.parametrize(
    "config,ignore,expected",
    [
        (
            ZERO2,
            ("optimizer", "scheduler"),
            dict(
                zero=ZeroConfig(stage=2, reduce_bucket_size=200_000_000),
                precision=None,
                gradient_clip_val=None,
                accumulate_grad_batches=None,
                micro_batch_size=None,
            ),
        ),
        (
            ZERO3,
            (),
            dict(
                zero=ZeroConfig(
                    stage=3,
                    max_live_parameters=1_000_000_000,
                    param_persistence_threshold=10_000,
                    save_consolidated=True,  # stage3_gather_16bit_weights_on_model_save (the weights in fp32)
                ),
                precision="bf16-mixed",
                gradient_clip_val=1.0,
                accumulate_grad_batches=4,
                micro_batch_size=8,
            ),
        ),
        (
            {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 5e7}},
            (),
            dict(zero=ZeroConfig(stage=3, prefetch_bucket_size=50_000_000), precision=None),
        ),
        (
            FP16_STATIC,
            (),
            dict(zero=ZeroConfig(stage=1), precision="16-mixed", loss_scale=LossScaleConfig(static_loss_scale=128.0)),
        ),
        (
            {
                "fp16": {
                    "enabled": True,
                    "initial_scale_power": 12,
                    "loss_scale_window": 500,
                    "hysteresis": 1,
                    "min_loss_scale": 0.5,
                },
                "zero_optimization": {"stage": 2, "overlap_comm": False},
            },
            (),
            dict(
                zero=ZeroConfig(stage=2, overlap_comm=False),
                precision="16-mixed",
                loss_scale=LossScaleConfig(initial_scale_power=12, scale_window=500, hysteresis=1, min_loss_scale=0.5),
            ),
        ),
        ({"fp16": {"enabled": False}, "gradient_clipping": 0.0}, (), dict(precision="32-true", gradient_clip_val=None)),
        (
            {"bf16": {"enabled": True}, "communication_data_type": "bf16", "zero_optimization": {"stage": 3}},
            (),
            dict(zero=ZeroConfig(stage=3, reduce_dtype="bfloat16"), precision="bf16-mixed"),
        ),
    ],
)
def test_mapping(config, ignore, expected, tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    if any(k in json.dumps(config) for k in ("allgather", "contiguous", "steps_per_print")):
        with pytest.warns(UserWarning, match="accepted with no effect"):
            settings = read_deepspeed_config(path, ignore=ignore)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a config with no inert keys must not warn at all
            settings = read_deepspeed_config(path, ignore=ignore)
    for key, value in expected.items():
        assert getattr(settings, key) == value, key


@pytest.mark.parametrize(
    "config,precision",
    [
        # as shipped in many configs: fp16 switched off, its loss-scale settings left in place
        (
            {
                "fp16": {
                    "enabled": False,
                    "loss_scale": 0,
                    "loss_scale_window": 1000,
                    "initial_scale_power": 16,
                    "hysteresis": 2,
                    "min_loss_scale": 1,
                },
                "bf16": {"enabled": True},
            },
            "bf16-mixed",
        ),
        ({"fp16": {"enabled": False, "hysteresis": 0, "unknown": 1}}, "32-true"),  # not even checked
        ({"bf16": {"enabled": False, "immediate_grad_update": True, "unknown": 1}}, None),
        ({"bf16": {"enabled": False}, "fp16": {"enabled": True, "loss_scale": 64}}, "16-mixed"),
    ],
)
def test_keys_of_a_disabled_section_are_inert(config, precision):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # accepted without a warning: they change nothing, as in DeepSpeed
        settings = read_deepspeed_config({**config, "zero_optimization": {"stage": 2}})
    assert settings.precision == precision and settings.no_effect == []
    expected = LossScaleConfig(static_loss_scale=64.0) if precision == "16-mixed" else None
    assert settings.loss_scale == expected


def test_no_effect_keys_are_reported_with_reasons():
    with pytest.warns(UserWarning) as record:
        settings = read_deepspeed_config(ZERO2, ignore=("optimizer", "scheduler"))
    message = str(record[0].message)
    assert "zero_optimization.allgather_bucket_size (parameters are all-gathered in the reduce buckets)" in message
    assert "steps_per_print" in message and len(settings.no_effect) == 6


def test_unsupported_keys_are_listed_in_one_error():
    config = {
        **ZERO3,
        "zero_optimization": {**ZERO3["zero_optimization"], "zero_quantized_nontrainable_weights": True},
        "flops_profiler": {"enabled": True},
        "optimizer": {"type": "Adam"},
    }
    with pytest.raises(ValueError) as info:
        read_deepspeed_config(config)
    assert str(info.value).startswith(
        "DeepSpeed config: these keys are not supported: flops_profiler, optimizer,"
        " zero_optimization.zero_quantized_nontrainable_weights."
    )
    # unsupported values (NVMe, partial offload) are named in the same error as unsupported keys
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "ratio": 0.5}
    config["zero_optimization"]["offload_param"] = {"device": "disk", "nvme_path": "/local"}
    with pytest.raises(ValueError) as info:
        read_deepspeed_config(config)
    assert str(info.value).startswith(
        "DeepSpeed config: these keys are not supported: flops_profiler, optimizer,"
        " zero_optimization.offload_optimizer.ratio 0.5 (partial offload; remove it to offload all of it),"
        " zero_optimization.offload_param.device 'disk' (one of 'none', 'cpu', 'nvme' here),"
        " zero_optimization.zero_quantized_nontrainable_weights."
    ), str(info.value)


def test_sequence_parallel_size_is_mapped():
    assert read_deepspeed_config({**ZERO3, "sequence_parallel_size": 2}).zero.sequence_parallel_size == 2
    with pytest.raises(ValueError, match="zero.sequence_parallel_size must be an integer >= 1 that divides the world"):
        read_deepspeed_config({**ZERO3, "sequence_parallel_size": 0})


def test_the_activation_checkpointing_section_maps_cpu_checkpointing_and_names_the_rest():
    """DeepSpeed's (and Lightning DeepSpeedStrategy's) names: the section configures the checkpoint function the
    model's code calls and turns nothing on by itself; cpu_checkpointing asks for offloaded checkpoints (units), the
    rest is named in the warning with why it changes nothing, an unknown key in the error."""
    section = {"partition_activations": True, "cpu_checkpointing": True, "contiguous_memory_optimization": True}
    with pytest.warns(UserWarning) as record:
        settings = read_deepspeed_config({**ZERO3, "activation_checkpointing": section})
    assert (settings.zero.activation_checkpointing, settings.zero.offload_activations) == ("units", "cpu")
    assert "activation_checkpointing.partition_activations (with data parallelism alone" in str(record[0].message)
    assert "activation_checkpointing.contiguous_memory_optimization (offloaded" in str(record[0].message)
    lightning_default = dict.fromkeys(("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                                       "synchronize_checkpoint_boundary"), False)  # fmt: skip
    for alone in ({"partition_activations": True}, lightning_default):
        with pytest.warns(UserWarning, match="activation_checkpointing.partition_activations"):
            zero = read_deepspeed_config({**ZERO3, "activation_checkpointing": alone}).zero
        assert (zero.activation_checkpointing, zero.offload_activations) == ("none", "none")
    with pytest.raises(ValueError, match="not supported: activation_checkpointing.checkpoint_in_cpu"):
        read_deepspeed_config({**ZERO3, "activation_checkpointing": {"checkpoint_in_cpu": True}})


@pytest.mark.parametrize(
    "config,message",
    [
        ({"zero_optimization": {"stage": 0}}, "stage 0 is plain data parallelism"),
        ({"zero_optimization": {"stage": 4}}, "zero.stage must be one of 1, 2, 3, got 4"),
        ({"zero_optimization": {"reduce_bucket_size": 2.5}}, "zero_optimization.reduce_bucket_size must be an integer"),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both true; choose one"),
        ({"fp16": {"hysteresis": 2}}, "need fp16.enabled: true"),
        ({"fp16": {"enabled": True, "hysteresis": 0}}, "fp16.hysteresis must be an integer >= 1, got 0"),
        ({"communication_data_type": "int8"}, "communication_data_type must be one of fp32, fp16, bf16, got 'int8'"),
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}},
            r"not supported: zero_optimization.offload_optimizer.ratio 0.3 \(partial offload; remove it",
        ),
        (
            {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
            "zero.offload_param must be none unless zero.stage is 3 and zero.offload_optimizer is cpu or nvme,"
            " got 'cpu'",
        ),
        (
            {
                "zero_optimization": {
                    "stage": 3,
                    "offload_optimizer": {"device": "cpu"},
                    "offload_param": {"device": "nvme"},
                }
            },
            "zero.offload_param must be cpu or none unless zero.offload_optimizer is nvme, got 'nvme'",
        ),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "cpu", "foo": 1}}},
            "not supported: zero_optimization.offload_optimizer.foo",
        ),
    ],
)
def test_bad_deepspeed_values(config, message):
    with pytest.raises(ValueError, match=message):
        read_deepspeed_config(config)


def test_strategy_and_trainer_from_a_deepspeed_config(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ZERO3))
    with pytest.warns(UserWarning):
        strategy = ZeroStrategy.from_deepspeed_config(path)
    assert strategy.config.stage == 3 and strategy.precision_plugin.precision == "bf16-mixed"
    kwargs = ZeroStrategy.trainer_kwargs_from_deepspeed(FP16_STATIC | {"gradient_clipping": 0.5})
    trainer = pl.Trainer(accelerator="cpu", devices=2, logger=False, **kwargs)
    assert isinstance(trainer.strategy, ZeroStrategy) and trainer.strategy.config.stage == 1
    assert isinstance(trainer.precision_plugin, ZeroPrecision) and trainer.precision_plugin.scaler.scale == 128.0
    assert trainer.gradient_clip_val == 0.5


def test_offload_sections_map():
    config = {
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": 1.0},
            "offload_param": {"device": "cpu", "pin_memory": True, "buffer_count": 5},
        }
    }
    with pytest.warns(UserWarning, match=r"offload_param.buffer_count \(not offloaded to NVMe\)"):
        zero = read_deepspeed_config(config).zero
    assert (zero.offload_optimizer, zero.offload_param, zero.offload_pin_memory) == ("cpu", "cpu", True)
    older = read_deepspeed_config({"zero_optimization": {"stage": 2, "cpu_offload": True}}).zero
    assert (older.offload_optimizer, older.offload_param) == ("cpu", "none")
    unpinned = {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "pin_memory": False}}}
    assert read_deepspeed_config(unpinned).zero.offload_pin_memory is False


def test_mics_maps_to_hybrid_sharding_and_zero_plus_plus_to_its_fields():
    mics = {"zero_optimization": {"stage": 3, "mics_shard_size": 8, "mics_hierarchical_params_gather": True}}
    with pytest.warns(UserWarning, match=r"mics_hierarchical_params_gather \(parameters are gathered inside"):
        assert read_deepspeed_config(mics).zero.shard_group_size == 8
    assert read_deepspeed_config({"zero_optimization": {"mics_shard_size": -1}}).zero.shard_group_size is None
    with pytest.warns(UserWarning, match=r"zero_hpz_partition_size \(1: no secondary partition\)"):
        read_deepspeed_config({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 1}})
    plus = {"stage": 3, "zero_hpz_partition_size": 8, "zero_quantized_weights": True, "zero_quantized_gradients": True}
    zero = read_deepspeed_config({"zero_optimization": plus}).zero
    assert (zero.secondary_partition, zero.node_size, zero.quantized_weights, zero.quantized_gradients) == (
        True,
        8,
        True,
        True,
    )
    with pytest.raises(ValueError, match="zero.shard_group_size must be null"):
        read_deepspeed_config({"zero_optimization": {"mics_shard_size": 0}})


def test_zero_infinity_sections_map():
    """DeepSpeed's ZeRO-Infinity config (optimizer state on NVMe, its ``aio`` section): the settings with an effect
    here map to their fields; the rest is named in the warning with why it changes nothing; conflicting paths are
    refused."""
    config = {
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 5, "fast_init": False},
            "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True, "max_in_cpu": 1e9},
        },
        "aio": {"block_size": 262144, "queue_depth": 16, "thread_count": 2, "single_submit": False},
    }
    with pytest.warns(UserWarning) as record:
        zero = read_deepspeed_config(config).zero
    assert (zero.offload_optimizer, zero.offload_param, zero.nvme_path) == ("nvme", "nvme", "/local_nvme")
    assert (zero.nvme_buffer_count, zero.aio_block_size, zero.aio_queue_depth) == (5, 262144, 16)
    message = str(record[0].message)
    assert (
        "offload_optimizer.fast_init (state chunks are always read ahead" in message and "aio.thread_count (" in message
    )
    assert "offload_param.max_in_cpu (" in message
    other_path = {"device": "nvme", "nvme_path": "/elsewhere"}
    with pytest.raises(ValueError, match="the offload sections' nvme_path differ"):
        read_deepspeed_config(
            {**config, "zero_optimization": {**config["zero_optimization"], "offload_param": other_path}}
        )
    with pytest.raises(ValueError, match="not supported: aio.foo"):
        read_deepspeed_config({**config, "aio": {"foo": 1}})
    with pytest.raises(ValueError, match="zero.aio_block_size must be a positive multiple of 4096"):
        read_deepspeed_config({**config, "aio": {"block_size": 1000}})
    with pytest.raises(ValueError, match="zero.nvme_path must be a directory on an NVMe drive"):
        read_deepspeed_config({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}})
