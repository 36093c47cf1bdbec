"""Bad input to every `lightning-zero` command, table-driven: configs (YAML values), CLI arguments, DeepSpeed
JSON and estimate arguments (damaged or crafted checkpoints: test_bad_input_checkpoints.py). Each case answers
with exactly one line, ``lightning-zero <command>: error: ...`` naming the bad value, exit code 2, and writes
or deletes nothing (the case's directory is compared file by file, contents included) and starts no process
group.

The cases call ``lightning_zero.cli.main.main`` in-process (the console script's start-up costs seconds); a
few run the real console script to show it answers the same.
"""

from __future__ import annotations

import json

import pytest

from lightning_zero import ZeroStrategy
from lightning_zero.cli.main import DEBUG_ENV, InputError, main
from tests.support.bad_input import GPT, Case, capture_runs, check_case, fit_args


def _yaml(name: str, text: str, message: str) -> Case:
    return Case(f"yaml_{name}", fit_args("--config", "{tmp}/bad.yaml"), message, {"bad.yaml": text})


def _deepspeed(name: str, config: object, message: str) -> Case:
    text = config if isinstance(config, str) else json.dumps(config)
    return Case(f"deepspeed_{name}", fit_args("--deepspeed_config", "{tmp}/ds.json"), message, {"ds.json": text})


STAGE_HINT = "(the stage is chosen with --trainer.strategy zero1|zero2|zero3)"
FIT_CASES = [
    _yaml(
        "reduce_bucket_size_negative",
        "zero:\n  reduce_bucket_size: -1\n",
        "zero.reduce_bucket_size must be an integer > 0 (elements), got -1",
    ),
    _yaml("timeout_zero", "zero:\n  timeout: 0\n", "zero.timeout must be a number of seconds > 0, got 0.0"),
    _yaml("stage_in_zero_section", "zero:\n  stage: 4\n", f"does not accept option 'zero.stage' {STAGE_HINT}"),
    _yaml(
        "strategy_zero4",
        "trainer:\n  strategy: zero4\n",
        "trainer.strategy must be one of zero1, zero2, zero3 for ZeRO (or a Lightning strategy such as ddp),"
        " got 'zero4'",
    ),
    _yaml(
        "reduce_dtype_int8",
        "zero:\n  reduce_dtype: int8\n",
        "zero.reduce_dtype must be null or one of float32, bfloat16, float16, got 'int8'",
    ),
    _yaml("unknown_zero_option", "zero:\n  bucket: 3\n", "does not accept option 'zero.bucket'"),
    _yaml(
        "activation_checkpointing_full",
        "zero:\n  activation_checkpointing: full\n",
        "zero.activation_checkpointing must be none, units or selective, got 'full'",
    ),
    Case(
        "cli_sequence_parallel_size",
        fit_args("--zero.sequence_parallel_size", "3"),
        "zero.sequence_parallel_size must divide the 2 ranks (trainer.devices x trainer.num_nodes), got 3",
    ),
    Case(
        "cli_sequence_parallel_size_devices_on_the_command_line",
        fit_args("--trainer.devices", "2", "--zero.sequence_parallel_size", "4"),
        "zero.sequence_parallel_size must divide the 2 ranks (trainer.devices x trainer.num_nodes), got 4",
    ),
    _yaml(
        "offload_activations_without_checkpointing",
        "zero:\n  offload_activations: cpu\n",
        "zero.offload_activations must be none unless zero.activation_checkpointing is units or selective, got 'cpu'",
    ),
    _yaml("malformed", "trainer: [\n", "Problems parsing config"),
    _yaml("max_steps_negative", "trainer:\n  max_steps: -5\n", "`max_steps` must be a non-negative integer or -1"),
    Case("yaml_missing_file", fit_args("--config", "{tmp}/absent.yaml"), "File does not exist"),
    Case("cli_zero_stage", fit_args("--zero.stage", "4"), f"unrecognized arguments: --zero.stage 4 {STAGE_HINT}"),
    Case(
        "cli_strategy_zero4",
        fit_args("--trainer.strategy", "zero4"),
        "trainer.strategy must be one of zero1, zero2, zero3",
    ),
    Case(
        "cli_strategy_zero",
        fit_args("--trainer.strategy", "zero"),
        "trainer.strategy must be one of zero1, zero2, zero3",
    ),
    Case(
        "cli_bucket_not_integer",
        fit_args("--zero.reduce_bucket_size", "abc"),
        "\"zero.reduce_bucket_size\": Expected a <class 'int'>. Got value: abc",
    ),
    Case(
        "cli_max_live_parameters_zero",
        fit_args("--zero.max_live_parameters", "0"),
        "zero.max_live_parameters must be an integer > 0 (elements), got 0",
    ),
    Case(
        "cli_gather_dtype",
        fit_args("--zero.gather_dtype", "fp8"),
        "zero.gather_dtype must be compute or float32, got 'fp8'",
    ),
    Case("cli_unknown_option", fit_args("--nonsense", "3"), "unrecognized arguments: --nonsense 3"),
    Case(
        "cli_devices_not_a_number",
        fit_args("--trainer.devices", "abc"),
        "`devices` selected with `CPUAccelerator` should be an int > 0",
    ),
    Case(  # (a model built when the CLI makes it; one built in configure_model is refused on every rank alike)
        "cli_checkpointing_without_blocks",
        fit_args(
            "--model",
            "tests.support.helpers.EquivalenceModule",
            "--model.kind",
            "toy",
            "--zero.activation_checkpointing",
            "units",
        ),
        "zero.activation_checkpointing is 'units', but the model has no blocks to checkpoint (no nn.ModuleList)",
    ),  # fmt: skip
    Case(
        "cli_unknown_subcommand",
        ["fitt", "--config", GPT],
        "lightning-zero: error: argument subcommand: invalid choice: 'fitt'",
    ),
    Case(
        "cli_validate_timeout",
        ["validate", "--config", GPT, "--zero.timeout", "-1"],
        "lightning-zero validate: error: zero.timeout must be a number of seconds > 0, got -1.0",
    ),
    Case(
        "cli_predict_param_persistence",
        ["predict", "--config", GPT, "--zero.param_persistence_threshold", "-1"],
        "lightning-zero predict: error: zero.param_persistence_threshold must be an integer >= 0",
    ),
    Case(
        "deepspeed_missing_file",
        fit_args("--deepspeed_config", "{tmp}/absent.json"),
        "DeepSpeed config {tmp}/absent.json: no such file",
    ),
    _deepspeed(
        "malformed_json",
        '{"zero_optimization": {"stage": 2,}}',
        "ds.json: not valid JSON (Expecting property name enclosed in double quotes: line 1 column 35",
    ),
    _deepspeed("not_an_object", [1, 2], "ds.json: must be a JSON object of settings, got a list"),
    _deepspeed(
        "unknown_keys",
        {"flops_profiler": {}, "optimizer": {"type": "Adam"}},
        "these keys are not supported: flops_profiler, optimizer",
    ),
    _deepspeed(
        "cpu_checkpointing",
        {"activation_checkpointing": {"cpu_checkpointing": "yes"}},
        "DeepSpeed config: activation_checkpointing.cpu_checkpointing must be true or false, got 'yes'",
    ),
    _deepspeed(
        "offload_device",
        {"zero_optimization": {"offload_param": {"device": "disk", "nvme_path": "/local_nvme"}}},
        "these keys are not supported: zero_optimization.offload_param.device 'disk' (one of 'none', 'cpu', 'nvme'"
        " here)",
    ),
    _deepspeed(
        "stage_0",
        {"zero_optimization": {"stage": 0}},
        "zero_optimization.stage 0 is plain data parallelism: use strategy='ddp'",
    ),
    _deepspeed("stage_4", {"zero_optimization": {"stage": 4}}, "zero.stage must be one of 1, 2, 3, got 4"),
    _deepspeed(
        "bucket_not_integer",
        {"zero_optimization": {"reduce_bucket_size": 2.5}},
        "zero_optimization.reduce_bucket_size must be an integer, got 2.5",
    ),
    _deepspeed(
        "fp16_and_bf16",
        {"fp16": {"enabled": True}, "bf16": {"enabled": True}},
        "fp16.enabled and bf16.enabled are both true; choose one",
    ),
    _deepspeed(
        "loss_scale_without_fp16",
        {"fp16": {"hysteresis": 2}},
        "fp16 loss-scale keys ['hysteresis'] need fp16.enabled: true",
    ),
    _deepspeed(
        "hysteresis_zero",
        {"fp16": {"enabled": True, "hysteresis": 0}},
        "fp16.hysteresis must be an integer >= 1, got 0",
    ),
    _deepspeed(
        "communication_dtype",
        {"communication_data_type": "int8"},
        "communication_data_type must be one of fp32, fp16, bf16, got 'int8'",
    ),
]


def _estimate(*args: str) -> list[str]:
    return ["estimate", *args]


PARAMS = "argument --params: must be a number of parameters >= 1, e.g. 1.3e9, got"
ESTIMATE_CASES = [
    Case("estimate_params_negative", _estimate("--params", "-5"), f"{PARAMS} '-5'"),
    Case("estimate_params_zero", _estimate("--params", "0"), f"{PARAMS} '0'"),
    Case("estimate_params_below_one", _estimate("--params", "0.5"), f"{PARAMS} '0.5'"),
    Case("estimate_params_nan", _estimate("--params", "nan"), f"{PARAMS} 'nan'"),
    Case("estimate_params_inf", _estimate("--params", "inf"), f"{PARAMS} 'inf'"),
    Case("estimate_params_not_a_number", _estimate("--params", "many"), f"{PARAMS} 'many'"),
    Case(
        "estimate_devices_zero",
        _estimate("--params", "1e6", "--devices", "0"),
        "argument --devices: must be an integer >= 1, got '0'",
    ),
    Case(
        "estimate_nodes_zero",
        _estimate("--params", "1e6", "--nodes", "0"),
        "argument --nodes: must be an integer >= 1, got '0'",
    ),
    Case(
        "estimate_nodes_negative",
        _estimate("--params", "1e6", "--nodes", "-2"),
        "argument --nodes: must be an integer >= 1, got '-2'",
    ),
    Case(
        "estimate_too_many_ranks",
        _estimate("--params", "1e6", "--devices", "100000", "--nodes", "100000"),
        "--devices x --nodes must be at most 131,072 ranks, got 10,000,000,000",
    ),
    Case(
        "estimate_device_memory",
        _estimate("--params", "1e6", "--device-memory", "lots"),
        "argument --device-memory: device memory must look like 80GB, 80GiB or 1e9 (bytes), got 'lots'",
    ),
    Case(
        "estimate_precision",
        _estimate("--params", "1e6", "--precision", "fp8"),
        "argument --precision: invalid choice: 'fp8'",
    ),
    Case("estimate_no_model", _estimate(), "one of the arguments --params --model is required"),
    Case(
        "estimate_model_missing",
        _estimate("--model", "{tmp}/absent.yaml"),
        "argument --model: {tmp}/absent.yaml: No such file or directory",
    ),
    Case(
        "estimate_model_not_yaml",
        _estimate("--model", "{tmp}/notes.md"),
        "argument --model: {tmp}/notes.md: not a lightning-zero YAML config (",
        {"notes.md": "# Notes\nsee: this: file\n"},
    ),
    Case(
        "estimate_model_binary",
        _estimate("--model", "{tmp}/weights.bin"),
        "weights.bin: not a lightning-zero YAML config ('utf-8' codec can't decode",
        {"weights.bin": "\udcff\udcfe"},
    ),
    Case(
        "estimate_model_no_model_section",
        _estimate("--model", "{tmp}/c.yaml"),
        "c.yaml: not a lightning-zero config: no model section",
        {"c.yaml": "trainer:\n  devices: 2\n"},
    ),
    Case(
        "estimate_seq_len_without_model",
        _estimate("--params", "1e6", "--seq-len", "2048"),
        "argument --seq-len: needs --model (a config whose model takes token ids [batch, seq])",
    ),
    Case("estimate_seq_len_zero", _estimate("--params", "1e6", "--seq-len", "0"), "argument --seq-len: must be an"),
    Case(
        "estimate_seq_len_model_without_blocks",
        _estimate("--model", "{tmp}/c.yaml", "--seq-len", "64"),
        "argument --seq-len: the model has no blocks to count activations by (no nn.ModuleList",
        {"c.yaml": "model:\n  class_path: tests.support.helpers.EquivalenceModule\n  init_args:\n    kind: toy\n"},
    ),
    Case("estimate_sp_zero", _estimate("--params", "1e6", "--sp", "0"), "argument --sp: must be an integer >= 1"),
    Case("estimate_sp_without_seq_len", _estimate("--model", GPT, "--sp", "2"), "argument --sp: needs --seq-len"),
    Case(
        "estimate_sp_not_dividing_the_world",
        _estimate("--model", GPT, "--devices", "3", "--seq-len", "60", "--sp", "2"),
        "argument --sp: must divide the 3 ranks (--devices x --nodes), 3, got 2",
    ),
    Case(
        "estimate_sp_not_dividing_the_heads",
        _estimate("--model", GPT, "--devices", "3", "--seq-len", "60", "--sp", "3"),
        "argument --sp: sequence_parallel_size 3 must divide the attention heads, 4",
    ),
    Case(
        "estimate_model_bad_class",
        _estimate("--model", "{tmp}/c.yaml"),
        "c.yaml: model: ",
        {"c.yaml": "model:\n  class_path: no.such.Module\n"},
    ),
]


@pytest.fixture
def ran(monkeypatch) -> list:
    """The CLIs whose subcommand would have run (training, validating, ...): the bad cases must stop before."""
    return capture_runs(monkeypatch)


@pytest.mark.parametrize("case", FIT_CASES + ESTIMATE_CASES, ids=str)
def test_bad_config_argument_or_deepspeed_config(case, tmp_path, capsys, ran):
    check_case(case, tmp_path, None, capsys, ran)


def test_disabled_fp16_and_bf16_sections_are_accepted(tmp_path, capsys, ran):
    """Loss-scale keys under "fp16": {"enabled": false}, as many shipped configs have, change nothing."""
    fp16 = {"enabled": False, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2}
    (tmp_path / "ds.json").write_text(json.dumps({"fp16": fp16, "bf16": {"enabled": False, "x": 1}}))
    main([arg.format(tmp=tmp_path) for arg in fit_args("--deepspeed_config={tmp}/ds.json")])
    (cli,) = ran
    assert isinstance(cli.trainer.strategy, ZeroStrategy) and cli.trainer.strategy.config.stage == 2
    assert cli.trainer.precision == "32-true"
    assert capsys.readouterr().err == ""


def test_debug_shows_the_traceback(monkeypatch, ran):
    with pytest.raises(InputError, match="got '-5'"):
        main(["--debug", "estimate", "--params", "-5"])
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(InputError, match="zero.timeout must be a number of seconds > 0") as info:
        main(["fit", "--config", GPT, "--zero.timeout", "0"])
    assert isinstance(info.value.__cause__, ValueError)  # the original, with its traceback


def test_a_bug_keeps_its_traceback(monkeypatch, ran):
    def broken(*args, **kwargs):
        raise ValueError("a bug, not bad input")

    monkeypatch.setattr("lightning_zero.cli.estimate.estimate", broken)
    with pytest.raises(ValueError, match="a bug, not bad input"):
        main(["estimate", "--params", "1e6"])
