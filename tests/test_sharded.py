"""Sharded training on CPU processes over gloo: FSDP2, DeepSpeed ZeRO-2 and ZeRO-3 through the same train.py and the
shipped accelerate configs, each proven against one process. Per strategy, on 2 processes: the strategy really ran
(read off the prepared model, and the checkpoint holds one shard per process), the per-step loss equals one
process's across a SIGKILL and resume, the best model is loaded at the end and model/ reloads to its eval metric
under the same strategy, each process holds about half of the parameters (FSDP2, ZeRO-3) and of the optimiser
state, a sharded checkpoint is refused on another process count, and converted to a whole model it continues on one
process as one process trained. Then the tiny GPT-2 with padded batches and accumulation: FSDP2 wraps each block,
and FSDP2 and ZeRO-3 train as one process does and save a model that from_pretrained loads to the run's eval loss
(ZeRO-2 runs the same code there; tests/test_adapters.py trains this model under ZeRO-2 too)."""

import importlib.util
import json
import runpy
import shlex
import shutil
import sys

import pytest
import torch

from scripts.readme_commands import section_commands
from tests.conftest import (
    REPO,
    assert_ok,
    assert_processes,
    last_row,
    launch_command,
    read_metrics,
    run_main,
    run_on,
    run_ranks,
    run_train,
    run_with_hook,
    series,
    signal_at,
)
from tests.helpers import (
    PROMPTS,
    STRATEGIES,
    assert_bash_blocks_run,
    has_feature,
    lm_eval_loss,
    padded_lm,
    padded_lm_one_process,
    predict_only,
    predictions,
    readme_command,
    strategy_params,
    write_prompts,
)

# float32 (the shipped configs say bf16) so that the losses compare with one process's to 1e-5. The "best" model is
# the one with the higher eval loss (step 15's, checkpointed as a new best), so that loading it at the end shows.
RUN = ["--max_steps", "30", "--logging_steps", "1", "--save_steps", "10", "--eval_steps", "15",
       "--mixed_precision", "no", "--metric_for_best_model", "eval/loss",
       "--greater_is_better", "true", "--load_best_model_at_end", "true"]  # fmt: skip
# FSDP2's run also has a global batch of 96 = 16 per device x 6 / 3 / 2 micro-batches on 1 / 2 / 3 processes, so
# that its checkpoint of step 20 continues on 1 and on 3 (test_an_fsdp2_checkpoint_continues_on_another_process_count).
# The DeepSpeed runs keep the default batch (64 = 32 x 2 / 1): ZeRO-3 with 3 micro-batches a process drifted from
# one process by 5e-4 (2026-12-02), which is not what these runs are for.
BATCH = {"fsdp": ["--per_device_train_batch_size", "16", "--global_batch_size", "96"]}
# A learning rate at which AdamW does not amplify, within 30 steps, the last bit that another order of additions
# changes (AdamW moves a weight by about the rate whatever its gradient's size, noise included). How soon it does
# depends on the CPU's kernels: on an AVX2-only CPU (2026-12-04) ZeRO-2 and one process separated past 1e-5 from step
# 17 at 1e-3 (up to 1.8e-4) and stayed within 2.4e-7 at 3e-4, while FSDP2 stayed within 1e-5 at 1e-3 and not at 3e-4
# (2.2e-5 by step 21). Both held at 1e-3 on the CPUs of earlier runs.
LEARNING_RATE = {"deepspeed_zero2": "3e-4", "deepspeed_zero3": "3e-4"}


def run_args(config: str) -> list[str]:
    return [*RUN, "--learning_rate", LEARNING_RATE.get(config, "1e-3"), *BATCH.get(config, [])]


KILLED_AT = 17  # after the checkpoint of step 15: the resumed run repeats steps 16 and 17

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """config -> the output_dir of its run (run_args) on one plain process, trained once per set of arguments."""
    runs = {}

    def output_dir(config: str):
        args = tuple(run_args(config))
        if args not in runs:
            runs[args] = tmp_path_factory.mktemp("one") / "run"
            assert_ok(run_main(*args, "--output_dir", str(runs[args])))
        return runs[args]

    return output_dir


def killed_and_resumed(config: str, root) -> tuple:
    """(config, output_dir, the resumed start's console): killed at step 17, then the same command again."""
    out = root / "run"
    args = [*run_args(config), "--output_dir", str(out), "--resume_from_checkpoint", "latest"]
    env = {"TORCH_EXTENSIONS_DIR": str(root / "torch_extensions")}  # where DeepSpeed would build an op
    killed = run_with_hook(root, args, signal_at(KILLED_AT), processes=2, config=config, env=env)
    assert killed.returncode != 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_10", "step_15"]
    resumed = run_train(*args, processes=2, config=config, env=env)  # the README's command, launched for real
    assert_ok(resumed)
    return config, out, resumed.stdout + resumed.stderr


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    return killed_and_resumed("fsdp", tmp_path_factory.mktemp("fsdp"))


@pytest.fixture(scope="module", params=strategy_params())
def sharded(request, tmp_path_factory):
    if request.param == "fsdp":  # also continued on other process counts below
        return request.getfixturevalue("fsdp_run")
    return killed_and_resumed(request.param, tmp_path_factory.mktemp(request.param))


def test_the_strategy_really_ran_on_two_processes(sharded):
    config, out, _ = sharded
    assert_processes(out, 2)  # both starts
    starts = [row for row in read_metrics(out) if "setup/strategy" in row]
    assert [row["setup/strategy"] for row in starts] == [STRATEGIES[config]] * 2
    checkpoint = out / "checkpoints" / "step_30"
    if config == "fsdp":
        assert all(row["setup/fsdp_units"] == 1 for row in starts)  # the CNN has no blocks: the root is the unit
        assert len(list((checkpoint / "pytorch_model_fsdp_0").glob("*.distcp"))) == 2  # DCP: a shard per process
    else:
        partitions = sorted(path.name for path in (checkpoint / "pytorch_model").glob("*optim_states.pt"))
        assert partitions == [f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in (0, 1)]
        # nor did DeepSpeed compile its shared-memory all-reduce (inference only) with g++: src/features/deepspeed
        assert not (out.parent / "torch_extensions").exists()


def test_per_step_loss_equals_one_process_across_a_kill_and_resume(sharded, one_process):
    config, out, console = sharded
    reference = read_metrics(one_process(config))
    assert "checkpoints/step_15 at step 15" in console  # "resuming from ..."
    rows = read_metrics(out)
    steps = [row["step"] for row in rows if "train/loss" in row]
    assert steps == list(range(1, 31))  # the steps after the checkpoint logged once, by the resumed start
    losses, expected = series(rows, "train/loss"), series(reference, "train/loss")
    torch.testing.assert_close(torch.tensor(list(losses.values())), torch.tensor(list(expected.values())),
                               rtol=0, atol=1e-5)  # fmt: skip
    assert series(rows, "eval/accuracy") == series(reference, "eval/accuracy") and len(series(rows, "eval/loss")) == 2
    assert series(rows, "eval/loss") == pytest.approx(series(reference, "eval/loss"), abs=1e-5)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_15", "step_20", "step_30"]  # best + 2


def test_the_best_model_is_loaded_and_saved_and_reloads_to_its_metric(sharded, tmp_path):
    """--load_best_model_at_end loads step 15's sharded checkpoint; the consolidated model/model.safetensors
    (gathered from the shards) is evaluated and predicted with by `--do_train false` under the same strategy: the
    best evaluation's metrics, and a prediction per eval sample."""
    config, out, _ = sharded
    rows = read_metrics(out)
    best = {key: value[15] for key in ("eval/loss", "eval/accuracy") if (value := series(rows, key))}
    assert (
        last_row(rows, "best_model/step")["best_model/step"] == 15 and best["eval/loss"] > series(rows, "eval/loss")[30]
    )
    final = json.loads((out / "eval_results.json").read_text())  # the run's final metrics: the best model's
    assert final["eval/accuracy"] == best["eval/accuracy"] and final["eval/loss"] == pytest.approx(best["eval/loss"])
    result = run_on(2, "--do_train", "false", "--do_predict", "true", "--model_name_or_path", str(out / "model"),
                    "--output_dir", str(tmp_path / "eval"), "--mixed_precision", "no", config=config)  # fmt: skip
    assert_ok(result)
    evaluated = json.loads((tmp_path / "eval" / "eval_results.json").read_text())
    assert evaluated["eval/accuracy"] == best["eval/accuracy"] and evaluated["eval/num_samples"] == 359
    assert evaluated["eval/loss"] == pytest.approx(best["eval/loss"], abs=1e-6)
    predictions = (tmp_path / "eval" / "predictions.jsonl").read_text().splitlines()
    assert len(predictions) == 359 and set(json.loads(predictions[0])) == {"prediction", "probabilities"}


def test_each_process_holds_about_half_of_what_is_sharded(sharded, one_process):
    """memory/*: the largest process's bytes, measured on the prepared model and optimiser; one process (= what DDP
    holds on each) as the baseline."""
    config, out, _ = sharded
    full = next(row for row in read_metrics(one_process(config)) if "memory/param_bytes" in row)
    measured = [row for row in read_metrics(out) if "memory/param_bytes" in row]
    assert len(measured) == 2  # once per start
    assert full["memory/param_bytes"] == 4 * read_metrics(out)[0]["setup/parameters"]  # float32, all of them
    for row in measured:
        params = row["memory/param_bytes"] / full["memory/param_bytes"]
        state = row["memory/optimizer_state_bytes"] / full["memory/optimizer_state_bytes"]
        assert state <= 0.6, (config, state)
        if config == "deepspeed_zero2":
            assert params == 1.0  # ZeRO-2 keeps every parameter on every process
        else:
            assert params <= 0.6, (config, params)


def test_a_sharded_checkpoint_resumes_only_under_its_own_strategy(sharded, tmp_path):
    config, out, _ = sharded
    other = tmp_path / "run"
    shutil.copytree(out / "checkpoints", other / "checkpoints")
    result = run_main(*run_args(config), "--max_steps", "40", "--output_dir", str(other),
                      "--resume_from_checkpoint", "latest")  # fmt: skip
    assert result.returncode == 2
    where = "on any number of processes" if config == "fsdp" else "and --num_processes 2"  # DCP reshards
    step_30 = other / "checkpoints" / "step_30"  # each converts to a whole model (test_a_..._converts_to_a_whole...)
    where += f", or convert it: python scripts/convert_checkpoint.py {step_30} NEW_FOLDER --to DDP"
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: checkpoint {other}/checkpoints/step_30 was saved by {STRATEGIES[config]} on 2 processes and this run "
        f"is single process on 1; resume it with the accelerate config it was trained with {where}"
    )
    assert sorted(p.name for p in other.iterdir()) == ["checkpoints"]  # nothing written


def test_the_readme_launch_command_of_each_strategy_is_the_one_run_here():
    """The README's `accelerate launch --config_file accelerate_configs/<strategy>.yaml train.py` is what each
    strategy's resumed run launches (with a free port, and 2 processes as the config says; the other multi-process
    runs here fork their ranks), so tests/test_readme.py does not run it again."""
    commands = section_commands("Launch on any hardware")
    for config in STRATEGIES:
        assert readme_command(config) in commands
        launched = launch_command(2, config)
        assert launched[1:5] == [
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            f"accelerate_configs/{config}.yaml",
        ]
        assert launched[-1] == "train.py" and launched[launched.index("--num_processes") + 1] == "2"


# --- a Hugging Face model: the tiny GPT-2, padded batches, 2 micro-batches accumulated per process ---


@pytest.fixture(scope="module")
def gpt2_one_process(request, hf_assets):
    return read_metrics(padded_lm_one_process(request, hf_assets))  # shared with tests/test_hf.py


# FSDP2 and ZeRO-3, not ZeRO-2: on the template's side a ZeRO-2 run of this model takes ZeRO-3's path line for line
# (src/ branches on the stage only for eval-only, prepare_needs_optimizer, which the digits runs above check under
# each strategy). ZeRO-2 keeps its 1-vs-2 proofs: the digits run above, and the tiny GPT-2 with padded batches and
# accumulation 2 in tests/test_adapters.py (its LoRA run under ZeRO-2 trains as DDP and 1 process do).
GPT2_STRATEGIES = strategy_params(without=("deepspeed_zero2",))


@pytest.fixture(scope="module", params=GPT2_STRATEGIES)
def gpt2_sharded(request, hf_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"gpt2_{request.param}")
    out, prompts = root / "run", write_prompts(root / "prompts.jsonl")  # the sharded runs also predict (generate)
    args = padded_lm(hf_assets, 4)
    args[args.index("--data_files") + 1] = hf_assets["data"].replace("}", f", test: {prompts}}}")
    generate = ["--do_predict", "true", "--max_new_tokens", "8"]
    assert_ok(run_on(2, *args, *generate, "--output_dir", str(out), config=request.param))
    assert_processes(out, 2)
    return request.param, out


def test_language_model_trains_as_one_process_does(gpt2_sharded, gpt2_one_process, hf_assets):
    config, out = gpt2_sharded
    rows = read_metrics(out)
    assert rows[0]["setup/strategy"] == STRATEGIES[config] and rows[0]["setup/gradient_accumulation"] == 2
    if config == "fsdp":  # fully_shard per GPT2Block (the model's _no_split_modules); Accelerate adds the tied
        layers = json.loads((out / "model" / "config.json").read_text())["n_layer"]  # embedding + head, final norm
        assert rows[0]["setup/fsdp_units"] == layers + 4  # h.0, h.1, wte, ln_f, lm_head, and the root
    losses, expected = series(rows, "train/loss"), series(gpt2_one_process, "train/loss")
    assert list(losses) == list(range(1, 9))
    torch.testing.assert_close(torch.tensor(list(losses.values())), torch.tensor(list(expected.values())),
                               rtol=0, atol=1e-5)  # fmt: skip
    assert series(rows, "eval/loss")[8] == pytest.approx(last_row(gpt2_one_process)["eval/loss"], abs=1e-5)


def test_generation_under_sharding_is_one_process_s(gpt2_sharded, tmp_path):
    """`generate` in the sharded run's --do_predict (FSDP2 gathers each block's shards in its forward, ZeRO-3 each
    layer's; every process makes the same number of forward calls, or the others would wait forever): the same
    greedy text, row for row, as one process generates from the saved model."""
    _, out = gpt2_sharded
    rows = predictions(out)
    assert [row["id"] for row in rows] == [f"p{i}" for i in range(len(PROMPTS))] and any(r["generated"] for r in rows)
    assert_ok(run_main(*predict_only(out / "model", out.parent / "prompts.jsonl", tmp_path / "alone")))
    assert predictions(tmp_path / "alone") == rows


def test_saved_language_model_loads_with_from_pretrained_to_the_eval_loss(gpt2_sharded, hf_assets):
    _, out = gpt2_sharded
    assert lm_eval_loss(out / "model", hf_assets["eval"]) == pytest.approx(series(read_metrics(out), "eval/loss")[8],
                                                                           rel=1e-5)  # fmt: skip


def test_every_command_of_the_page_is_run():
    assert_bash_blocks_run("docs/sharded.md")


# --- an FSDP2 checkpoint continues on another process count: DCP reshards model and optimiser ---


@pytest.mark.parametrize("processes", [1, 3])
def test_an_fsdp2_checkpoint_continues_on_another_process_count(fsdp_run, one_process, tmp_path, processes):
    """step_15 of the FSDP2 run above (2 processes, accumulation 3), continued by FSDP2 on 1 and on 3 (accumulation
    6 and 2; Accelerate's restored micro-batch count, 45, is mid-window for both unless the resume resets it): steps
    16-30 and the evals equal one uninterrupted process's, and the start says its own world size."""
    _, trained, _ = fsdp_run
    reference = read_metrics(one_process("fsdp"))
    out = tmp_path / "run"
    shutil.copytree(trained / "checkpoints" / "step_15", out / "checkpoints" / "step_15")  # latest and best
    resume = [*run_args("fsdp"), "--output_dir", str(out), "--resume_from_checkpoint", "latest"]
    result = run_ranks(REPO / "train.py", resume, processes, config="fsdp")  # launched, even 1: FSDP2 on 1 process
    assert_ok(result)
    assert "checkpoints/step_15 at step 15" in result.stdout + result.stderr  # "resuming from ..."
    rows = read_metrics(out)
    assert [(row["setup/strategy"], row["setup/world_size"]) for row in rows if "setup/strategy" in row] == [
        ("FSDP2", processes)
    ]
    losses, expected = series(rows, "train/loss"), series(reference, "train/loss")
    assert list(losses) == list(range(16, 31))
    torch.testing.assert_close(torch.tensor(list(losses.values())), torch.tensor([expected[s] for s in losses]),
                               rtol=0, atol=1e-5)  # fmt: skip
    assert series(rows, "eval/loss")[30] == pytest.approx(series(reference, "eval/loss")[30], abs=1e-5)


def test_convert_checkpoint_refuses_what_it_cannot_convert(tmp_path, monkeypatch):
    """One line (a UsageError: exit 2 from the command line), nothing written: not a checkpoint, an output that
    exists, a checkpoint of another kind, a ZeRO checkpoint without its partitions or without the deepspeed
    feature (damaged partitions: test_a_zero_checkpoint_converts_to_a_whole_model_on_one_process)."""
    from scripts.convert_checkpoint import convert
    from src.cli import parse_config
    from src.config import save_config
    from src.errors import UsageError

    checkpoint, taken, new = tmp_path / "step_10", tmp_path / "taken", tmp_path / "new"
    taken.mkdir()
    with pytest.raises(UsageError, match=r"step_10 is not a complete checkpoint \(no trainer_state.json\); use a"):
        convert(checkpoint, new, "FSDP2")
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text(json.dumps({"strategy": "DeepSpeed ZeRO-3"}))
    save_config(parse_config([]), checkpoint / "config.yaml")  # the default run's: its model is built first
    with pytest.raises(UsageError, match="taken exists; name a new folder for the converted checkpoint"):
        convert(checkpoint, taken, "FSDP2")
    with pytest.raises(UsageError, match="ZeRO-3; --to FSDP2 converts a whole model.s .one process or DDP."):
        convert(checkpoint, new, "FSDP2")
    if has_feature("deepspeed") and importlib.util.find_spec("deepspeed"):  # its check
        with pytest.raises(UsageError, match=r"step_10 has no pytorch_model/ \(DeepSpeed's partitions\); convert a "):
            convert(checkpoint, new, "DDP")
    (checkpoint / "pytorch_model").mkdir()
    with monkeypatch.context() as patch:  # as if src/features/deepspeed/ were deleted
        patch.setitem(sys.modules, "src.features.deepspeed.convert", None)
        with pytest.raises(UsageError, match="converting DeepSpeed ZeRO-3's checkpoints needs the deepspeed feature"):
            convert(checkpoint, new, "DDP")
    (checkpoint / "trainer_state.json").write_text(json.dumps({"strategy": "DDP"}))
    with pytest.raises(UsageError, match="DDP; --to DDP converts FSDP2's and DeepSpeed ZeRO-2/3's checkpoints only"):
        convert(checkpoint, new, "DDP")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_10", "taken"]


@pytest.mark.parametrize("to", ["DDP", "FSDP2"])
def test_a_checkpoint_converts_between_a_whole_model_and_fsdp2(fsdp_run, one_process, tmp_path, monkeypatch,
                                                                capsys, fresh_accelerate_state, to):  # fmt: skip
    """scripts/convert_checkpoint.py, as the refusal above names it: the FSDP2 run's checkpoints (2 processes) -> a
    whole model, continued by one plain process; the plain run's -> FSDP2, continued on 2 processes. From step_15
    (the latest and the best, mid-window in Accelerate's restored micro-batch count as above): steps 16-30 and the
    eval equal the uninterrupted run's."""
    _, trained, _ = fsdp_run
    source = trained if to == "DDP" else one_process("fsdp")
    out = tmp_path / "run"
    latest = out / "checkpoints" / "step_15"  # also the best that --load_best_model_at_end loads
    command = ["scripts/convert_checkpoint.py", str(source / "checkpoints" / latest.name), str(latest), "--to", to]
    with monkeypatch.context() as patch:  # the command as the refusal names it, its __main__ run in this process
        patch.setattr(sys, "argv", command)
        patch.chdir(REPO)
        runpy.run_path(command[0], run_name="__main__")  # a UsageError would exit 2 (SystemExit fails the test)
    assert capsys.readouterr().out.startswith(f"{latest}: the checkpoint for {to}; resume with")
    resume = [*run_args("fsdp"), "--output_dir", str(out), "--resume_from_checkpoint", "latest"]
    assert_ok(run_on(1 if to == "DDP" else 2, *resume, config="fsdp"))
    rows, reference = read_metrics(out), read_metrics(one_process("fsdp"))
    strategy = "single process" if to == "DDP" else "FSDP2"
    assert [row["setup/strategy"] for row in rows if "setup/strategy" in row] == [strategy]
    losses, expected = series(rows, "train/loss"), series(reference, "train/loss")
    assert list(losses) == list(range(16, 31))
    torch.testing.assert_close(torch.tensor(list(losses.values())), torch.tensor([expected[s] for s in losses]),
                               rtol=0, atol=1e-5)  # fmt: skip
    assert series(rows, "eval/loss")[30] == pytest.approx(series(reference, "eval/loss")[30], abs=1e-5)


@pytest.mark.parametrize("sharded", strategy_params(without=("fsdp",)), indirect=True)
def test_a_zero_checkpoint_converts_to_a_whole_model_on_one_process(sharded, one_process, tmp_path, monkeypatch,
                                                                     capsys, fresh_accelerate_state):  # fmt: skip
    """docs/sharded.md's commands (`scripts/convert_checkpoint.py ... --to DDP`, as the refusal above names it, then
    `python train.py`) on step_15 of the ZeRO run of 2 processes (DeepSpeed's consolidation: the fp32 weights and
    each parameter's AdamW state), continued by one plain process: steps 16-30 (the schedule still warming up) and
    the evals equal the uninterrupted one process's, and the converted step 15 is the best model loaded at the end.
    A ZeRO checkpoint missing a process's partition is refused with one line."""
    config, trained, _ = sharded
    source, out = trained / "checkpoints" / "step_15", tmp_path / "run"
    target = out / "checkpoints" / "step_15"
    conversion, resumption = (  # the page's run dirs: the sharded run's, the new one
        shlex.split(command.replace("runs/sharded", str(trained)).replace("runs/whole", str(out)))
        for command in section_commands("Checkpoints and resume", page="docs/sharded.md")
    )
    assert conversion == ["python", "scripts/convert_checkpoint.py", str(source), str(target), "--to", "DDP"]
    with monkeypatch.context() as patch:  # its __main__ run in this process
        patch.setattr(sys, "argv", conversion[1:])
        patch.chdir(REPO)
        runpy.run_path(conversion[1], run_name="__main__")  # a UsageError would exit 2 (SystemExit fails the test)
    last = capsys.readouterr().out.splitlines()[-1]  # after DeepSpeed's warning that its accelerator is the CPU
    assert last.startswith(f"{target}: the checkpoint for DDP; resume with")
    assert {"model.safetensors", "optimizer.bin"} <= {p.name for p in target.iterdir()}
    assert not {"pytorch_model", "pytorch_model_fsdp_0", "optimizer_0"} & {p.name for p in target.iterdir()}
    assert resumption[:2] == ["python", "train.py"]
    assert_ok(run_main(*run_args(config), *resumption[2:]))  # with the run's flags: the same training
    rows, reference = read_metrics(out), read_metrics(one_process(config))
    assert [row["setup/strategy"] for row in rows if "setup/strategy" in row] == ["single process"]
    losses, expected = series(rows, "train/loss"), series(reference, "train/loss")
    assert list(losses) == list(range(16, 31))
    torch.testing.assert_close(torch.tensor(list(losses.values())), torch.tensor([expected[s] for s in losses]),
                               rtol=0, atol=1e-5)  # fmt: skip
    assert series(rows, "eval/accuracy") == {30: series(reference, "eval/accuracy")[30]}
    assert series(rows, "eval/loss")[30] == pytest.approx(series(reference, "eval/loss")[30], abs=1e-5)
    final = json.loads((out / "eval_results.json").read_text())  # --load_best_model_at_end: the converted step 15
    assert last_row(rows, "best_model/step")["best_model/step"] == 15
    assert final["eval/loss"] == pytest.approx(series(reference, "eval/loss")[15], abs=1e-5)
    from scripts.convert_checkpoint import convert
    from src.errors import UsageError

    damaged = tmp_path / "damaged"
    shutil.copytree(source, damaged)
    (damaged / "pytorch_model" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(UsageError, match="damaged: its partitions do not fit this model/optimiser or are damaged: Exp"):
        convert(damaged, tmp_path / "new", "DDP")
    assert not (tmp_path / "new").exists()
