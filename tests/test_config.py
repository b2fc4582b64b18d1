import dataclasses

import pytest
import yaml

from src.cli import parse_config, resolve
from src.config import LAUNCH_ONLY, TrainConfig, resolve_global_batch, save_config
from src.errors import UsageError
from src.features import option_classes
from src.tasks.digits import Digits
from tests.conftest import REPO, assert_ok, last_row, read_metrics, run_main


def test_yaml_then_command_line_override(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 0.5\nnorm: batch\nreport_to: [wandb, tensorboard]\n")
    config = parse_config(["--config", str(path), "--norm", "none", "--max_steps", "7"])
    assert (config.learning_rate, config.task_args["norm"], config.max_steps) == (0.5, "none", 7)
    assert config.report_to == ["wandb", "tensorboard"]


def test_flags_beat_config_files_wherever_they_stand(tmp_path):
    """A flag before a --config file still wins over the file's value, as the pre-read of --do_train or --task
    (src/cli.py) takes it: jsonargparse alone applies each in its place."""
    path = tmp_path / "c.yaml"
    path.write_text("max_steps: 3\nnorm: batch\ndo_train: true\n")
    config = parse_config(["--max_steps", "2", "--config", str(path), "--do_train", "false", f"--config={path}"])
    assert (config.max_steps, config.task_args["norm"], config.do_train) == (2, "batch", False)
    with pytest.raises(UsageError, match="^argument --config: expected one argument"):  # a last one without a file
        parse_config(["--max_steps", "2", "--config"])


@pytest.mark.parametrize(
    "yaml_text, flags, message",
    [
        ("bogus_key: 1\n", [], "bogus_key"),
        ("learning_rate: fast\n", [], r"--learning_rate must be a number \(got fast\)"),
        (
            "",
            ["--per_device_train_batch_size", "1.5"],
            r"--per_device_train_batch_size must be a whole number \(got 1.5\)",
        ),
        ("", ["--no_such_flag", "1"], "no_such_flag"),
        ("", ["--norm", "layer"], r"^--norm must be one of batch, group, none \(got layer\); see `python train.py"),
        (
            "",
            ["--mixed_precision", "fp8"],  # no "did you mean": the flag exists
            r"^--mixed_precision must be one of no, fp16, bf16 or null \(got fp8\); see `python train.py",
        ),
        ("", ["--global_batch_size", "x"], r"^--global_batch_size must be a whole number or null \(got x\); see"),
        ("", ["--run_tags", "a,b"], r"^--run_tags must be a list, written \[a, b\] \(got a,b\); see"),
        ("", ["--metrics", "x"], r"^--metrics must be a list, written \[a, b\] or null \(got x\); see"),
        ("", ["--learning_rate", "0"], "--learning_rate must be > 0"),
        ("", ["--max_steps", "-5"], "--max_steps must be > 0"),
        ("", ["--report_to", "mlfow"], "unknown --report_to mlfow; did you mean mlflow?"),
        ("key: [unclosed\n", [], "config"),
        ("", ["--project_name", ".."], r"^--project_name '\.\.' must be a plain name"),  # its folder in output_dir
        ("", ["--seed", "-1"], r"^--seed must be >= 0 and < 2\*\*32 \(got -1\)"),
        ("", ["--adam_beta1", "1.5"], r"^--adam_beta1 must be >= 0 and < 1 \(got 1\.5\)"),
        ("output_dir: 5\ndo_train: false\n", [], r"^--output_dir must be text \(in YAML, quoted\) or null \(got 5\)"),
        ("# nothing but a comment\n", [], r"c\.yaml holds nothing, not options: write one `name: value` a line$"),
        ("- learning_rate: 1\n", [], r"c\.yaml holds a list, not options"),
        (
            "compute_environment: LOCAL_MACHINE\n",
            [],
            r"c\.yaml is an accelerate config: `accelerate launch --config_fi",
        ),
        (
            "",
            ["--data_files", "{train:a.parquet, eval:b.parquet}"],
            "is not a mapping of splits to files; write it as a YAML mapping with a space after each colon",
        ),
    ],
)
def test_bad_config_is_a_usage_error(tmp_path, yaml_text, flags, message):
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    config_flags = ["--config", str(path)] if yaml_text else []
    with pytest.raises(UsageError, match=message) as info:
        parse_config([*config_flags, *flags])
    assert "\n" not in str(info.value)


def test_global_batch_sets_accumulation_per_world_size():
    config = TrainConfig(global_batch_size=64, per_device_train_batch_size=16)
    assert [resolve_global_batch(config, n) for n in (1, 2, 4)] == [4, 2, 1]
    assert resolve_global_batch(TrainConfig(global_batch_size=None, gradient_accumulation_steps=3), 8) == 3


def test_accumulation_given_beside_a_global_batch_that_sets_another_is_refused():
    config = TrainConfig(global_batch_size=64, per_device_train_batch_size=16, gradient_accumulation_steps=4)
    assert resolve_global_batch(config, 1) == 4  # what the global batch makes anyway
    fix = r"it \(2 here, .*set --global_batch_size 128 instead, or --global_batch_size null"
    with pytest.raises(
        UsageError, match=r"--gradient_accumulation_steps 4 does not apply: --global_batch_size 64 sets " + fix
    ):
        resolve_global_batch(config, 2)


def test_global_batch_not_divisible_names_the_fix():
    config = TrainConfig(global_batch_size=64, per_device_train_batch_size=24)
    with pytest.raises(UsageError, match="not divisible.*24 x 2 processes = 48"):
        resolve_global_batch(config, 2)


def test_report_to_forms():
    assert TrainConfig(report_to="none").report_to == []
    assert {"wandb", "tensorboard"} <= set(TrainConfig(report_to="all").report_to)  # all: every installed tracker
    assert TrainConfig(report_to="wandb,tensorboard").report_to == ["wandb", "tensorboard"]


def test_default_yaml_matches_dataclass_defaults():
    """`python train.py` and `--config configs/default.yaml` must train the same thing."""
    from_yaml = parse_config(["--config", str(REPO / "configs/default.yaml")])
    assert dataclasses.asdict(from_yaml) == dataclasses.asdict(resolve(TrainConfig()))


def test_every_yaml_file_parses():
    """Each config (the debug overlays on top of the default) parses: no unknown key, every value of its type."""
    for path in (REPO / "configs").rglob("*.yaml"):
        if path.parent.name == "sweep":
            continue  # search spaces: tests/test_sweep.py
        base = [] if "task" in yaml.safe_load(path.read_text()) else ["--config", str(REPO / "configs/default.yaml")]
        parse_config([*base, "--config", str(path)])


def test_a_short_run_trains_and_saves_the_options_there_are_and_no_other(tmp_path):
    """`python train.py` for 4 steps (train.py's main, in this process): it trains and evaluates, and its config.yaml
    holds the run's fields (but how this launch treated its folder), the digits task's options and the installed
    features' options, nothing else. (In a copy without a feature, scripts/remove_feature.py --check runs this as its
    short run.)"""
    out = tmp_path / "run"
    short = ["--max_steps", "4", "--logging_steps", "2", "--eval_steps", "4", "--max_eval_samples", "64"]
    assert_ok(run_main(*short, "--output_dir", str(out)))
    final = last_row(read_metrics(out))
    assert final["step"] == 4 and final["eval/num_samples"] == 64
    saved = set(yaml.safe_load((out / "config.yaml").read_text()))
    run_fields = {field.name for field in dataclasses.fields(TrainConfig)} - {"task_args", "feature_args", *LAUNCH_ONLY}
    features = {field.name for options in option_classes() for field in dataclasses.fields(options)}
    assert saved == run_fields | {field.name for field in dataclasses.fields(Digits.Options)} | features


def test_config_yaml_leaves_out_how_one_launch_treated_its_folder(tmp_path):
    """`--config <run>/config.yaml --output_dir elsewhere` runs the run again: it neither replaces (a saved
    overwrite_output_dir) nor continues (a saved resume_from_checkpoint) whatever is there, unasked."""
    path = tmp_path / "config.yaml"
    save_config(TrainConfig(overwrite_output_dir=True, resume_from_checkpoint="latest", learning_rate=0.5), path)
    again = parse_config(["--config", str(path), "--output_dir", str(tmp_path / "y")])
    assert (again.overwrite_output_dir, again.resume_from_checkpoint, again.learning_rate) == (False, None, 0.5)


def test_a_compile_mode_compiles():
    """--torch_compile_mode alone compiles, as in transformers; it was dropped without a word."""
    assert TrainConfig(torch_compile_mode="max-autotune").torch_compile
    assert not TrainConfig().torch_compile
