"""The causal_lm recipe: a byte-level GPT trained from scratch on the Python stdlib's source, through train.py."""

import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from scripts.readme_commands import section_commands
from src.cli import resolve
from src.config import TrainConfig
from src.errors import UsageError
from src.features.gpt import causal_lm
from src.tasks import build_task
from tests.conftest import (
    REPO,
    assert_ok,
    assert_processes,
    last_row,
    logged_losses,
    read_metrics,
    run_command,
    run_main,
    run_on,
    run_python,
    series,
)
from tests.helpers import as_written, assert_bash_blocks_run, assert_gathers_as_collated, workspace

LM = ["--config", "configs/lm.yaml"]
STDLIB = REPO / "data" / "stdlib"


pytestmark = pytest.mark.usefixtures("stdlib_text")  # data/stdlib, built where missing (tests/conftest.py)


# --- end to end through train.py ---


@pytest.mark.slow
def test_lm_yaml_loss_falls_by_30_percent_in_50_steps(out):
    """configs/lm.yaml, its schedule shortened to 50 steps (warm-up 20, then the cosine) and its two evals to 16 KiB
    of text: in this process, one thread. docs/lm.md's figures are of the full 200."""
    args = [*LM, "--max_steps", "50", "--eval_steps", "25", "--max_eval_tokens", "16384", "--output_dir", str(out)]
    assert_ok(run_main(*args))
    rows = read_metrics(out)
    losses = series(rows, "train/loss")
    assert list(losses)[0] == 10 and list(losses)[-1] == 50
    first, last = losses[10], losses[50]
    assert last <= 0.7 * first, losses
    assert rows[0]["setup/parameters"] == lm_task().count_parameters(non_embedding=False)
    assert list(series(rows, "eval/perplexity")) == [25, 50]
    assert series(rows, "eval/loss")[50] < 0.6 * math.log(256)  # well below a uniform guess over the bytes


# 30 steps of configs/lm.yaml, evaluated on 127 blocks at the end; lm.yaml's model (the CausalLM.Options defaults)
SAME_RUN = ["--max_steps", "30", "--logging_steps", "1", "--eval_steps", "1000", "--max_eval_tokens", "16384"]


@pytest.fixture(scope="module")
def one_and_two_processes(tmp_path_factory):
    runs = {}
    for processes in (1, 2):
        output_dir = tmp_path_factory.mktemp(f"lm_p{processes}") / "run"
        assert_ok(run_on(processes, *LM, *SAME_RUN, "--output_dir", str(output_dir)))
        assert_processes(output_dir, processes)
        runs[processes] = read_metrics(output_dir)
    return runs


@pytest.mark.slow
def test_1_and_2_processes_train_the_same(one_and_two_processes):
    """Bit for bit: 2 micro-batches accumulated on one process and the 2-process all-reduce of the same 2 gradients
    add the same two numbers and halve them, and a halving is exact in floating point."""
    for rows in one_and_two_processes.values():
        assert (rows[0]["setup/global_batch"], rows[0]["setup/per_device_batch"]) == (32, 16)
    one, two = (series(one_and_two_processes[n], "train/loss") for n in (1, 2))
    assert list(one) == list(range(1, 31)) and list(two) == list(one)
    assert two == one  # every step's loss, exactly
    eval_one, eval_two = (last_row(one_and_two_processes[n]) for n in (1, 2))
    assert eval_one["eval/num_samples"] == eval_two["eval/num_samples"] == 16384 // 129
    assert eval_two["eval/loss"] == eval_one["eval/loss"]


@pytest.mark.slow
def test_perplexity_is_exp_of_eval_loss(one_and_two_processes):
    for rows in one_and_two_processes.values():
        final = last_row(rows)
        assert final["eval/perplexity"] == pytest.approx(math.exp(final["eval/loss"]), rel=1e-9)
        assert 1 < final["eval/perplexity"] < 256


SMALL_LM = ["--n_layer", "2", "--n_embd", "64", "--block_size", "64", "--max_train_tokens", "20000",
            "--max_eval_tokens", "5000", "--max_steps", "5", "--logging_steps", "1"]  # fmt: skip


@pytest.mark.slow
def test_gradient_checkpointing_recomputes_and_trains_the_same(tmp_path, monkeypatch):
    """--gradient_checkpointing true: every block's forward goes through torch.utils.checkpoint (2 blocks x 2
    micro-batches x 5 steps) and the per-step losses are the plain run's. Both runs in this process, the model's
    checkpoint function counted."""
    import src.features.gpt.model as gpt

    calls = []
    checkpoint = gpt.checkpoint

    def counting(*args, **kwargs):
        calls.append(1)
        return checkpoint(*args, **kwargs)

    monkeypatch.setattr(gpt, "checkpoint", counting)
    losses = {}
    for flag in ("false", "true"):
        out = tmp_path / f"checkpointing_{flag}"
        calls.clear()
        assert_ok(run_main(*LM, *SMALL_LM, "--gradient_checkpointing", flag, "--output_dir", str(out)))
        assert len(calls) == (2 * 2 * 5 if flag == "true" else 0)
        losses[flag] = series(read_metrics(out), "train/loss")
    assert list(losses["true"]) == list(losses["false"]) == [1, 2, 3, 4, 5]
    assert losses["true"] == pytest.approx(losses["false"], abs=1e-5)


@pytest.mark.slow
def test_fsdp2_shards_each_block_on_its_own(tmp_path):
    """accelerate_configs/fsdp.yaml wraps by transformer block: the GPT's 2 blocks, the final norm (Accelerate's tail
    unit) and the root are the units (without `_no_split_modules`: the last two only)."""
    out = tmp_path / "fsdp"
    args = [*LM, *SMALL_LM, "--max_steps", "2", "--logging_steps", "1", "--do_eval", "false", "--output_dir", str(out)]
    assert_ok(run_on(2, *args, config="fsdp"))
    assert read_metrics(out)[0]["setup/strategy"] == "FSDP2" and read_metrics(out)[0]["setup/fsdp_units"] == 4


@pytest.mark.slow
def test_a_checkpoint_of_the_tied_gpt_converts_to_fsdp2_and_back(tmp_path):
    """The head shares the token embedding's weight (saved once, as Accelerate saves it): scripts/convert_checkpoint.py
    moves a 1-process checkpoint to FSDP2 on 2 processes, which continues as the 1-process run did, and back."""
    args = [*LM, *SMALL_LM, "--max_steps", "6", "--save_steps", "3", "--eval_steps", "1000", "--mixed_precision", "no"]
    saved = run_main(*args, "--output_dir", str(tmp_path / "one"))
    assert_ok(saved)
    assert "Removed shared tensor" not in saved.stderr  # Accelerate's warning to check the reload: it is checked here
    convert = [str(REPO / "scripts" / "convert_checkpoint.py")]
    step = "checkpoints/step_3"
    assert_ok(run_python(*convert, str(tmp_path / "one" / step), str(tmp_path / "sharded" / step), "--to", "FSDP2"))
    resume = ["--resume_from_checkpoint", "latest"]
    assert_ok(run_on(2, *args, *resume, "--output_dir", str(tmp_path / "sharded"), config="fsdp"))
    one, sharded = logged_losses(tmp_path / "one"), logged_losses(tmp_path / "sharded")
    assert sorted(sharded) == [4, 5, 6] and all(abs(sharded[s] - one[s]) < 1e-5 for s in sharded), (one, sharded)
    step = "checkpoints/step_6"
    assert_ok(run_python(*convert, str(tmp_path / "sharded" / step), str(tmp_path / "whole" / step), "--to", "DDP"))
    assert_ok(run_main(*args, *resume, "--max_steps", "7", "--output_dir", str(tmp_path / "whole")))
    assert sorted(logged_losses(tmp_path / "whole")) == [7]


@pytest.mark.slow
def test_unknown_task_arg_is_one_error_line(out):
    result = run_main(*LM, "--output_dir", str(out), "--n_layers", "2")
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and "n_layers" in last and "did you mean --n_layer?" in last, last
    assert not out.exists()


# --- the pieces, in this process ---


def lm_task(data_files: dict | None = None, **options) -> causal_lm.CausalLM:
    """The task as train.py builds it: its options parsed and checked from a dict, defaults filled in."""
    files = data_files or {"train": str(STDLIB / "train.parquet"), "eval": str(STDLIB / "eval.parquet")}
    return build_task(resolve(TrainConfig(task="causal_lm", data_files=files, task_args=options)))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"n_layers": 2}, "'n_layers' is not accepted; did you mean n_layer"),
        ({"n_layer": "two"}, "n_layer.*Expected a <class 'int'>"),  # parsed like every config field ("2" is 2)
        ({"n_layer": True}, "n_layer.*Expected a <class 'int'>"),
        ({"n_embd": 100, "n_head": 3}, "n_embd 100 must be divisible by n_head 3"),
        ({"dropout": 1.0}, r"dropout must lie in \[0, 1\)"),
        ({"max_train_tokens": 100}, "max_train_tokens must be > block_size"),
    ],
)
def test_bad_options_raise_usage_errors(options, message):
    with pytest.raises(UsageError, match=message) as info:
        lm_task(**options)
    assert "\n" not in str(info.value)


def test_missing_text_names_the_prepare_script(tmp_path):
    """The prepared files missing: the script that makes them; another name there (a typo): the file, not the script."""
    missing = {split: str(tmp_path / "data" / "stdlib" / f"{split}.parquet") for split in ("train", "eval")}
    with pytest.raises(UsageError, match=r"python scripts/prepare_text\.py"):
        lm_task(missing).build_datasets()
    typo = {"train": "data/stdlib/trian.parquet", "eval": "data/stdlib/eval.parquet"}
    with pytest.raises(UsageError, match=r"data file for split 'train' not found: data/stdlib/trian\.parquet"):
        lm_task(typo).build_datasets()
    digits_files = {"train": "data/digits/train.parquet", "eval": "data/digits/eval.parquet"}
    with pytest.raises(UsageError, match="no column text .*--text_column"):  # not text: names the option
        lm_task(digits_files).build_datasets()


def test_texts_become_shifted_byte_blocks(tmp_path):
    texts = ["abcdefg", "é€x", "hijklmnop"]  # 7 + 1 + 6 + 1 + 9 = 24 bytes: 4 blocks of 5, 4 left over
    for split in ("train", "eval"):
        pq.write_table(pa.table({"path": ["a", "b", "c"], "text": texts}), tmp_path / f"{split}.parquet")
    data_files = {split: str(tmp_path / f"{split}.parquet") for split in ("train", "eval")}
    train, evaluation = lm_task(data_files, block_size=4, max_train_tokens=12).build_datasets()
    stream = "\0".join(texts).encode()
    assert len(evaluation) == len(stream) // 5 == 4 and len(train) == 12 // 5 == 2  # remainders dropped
    for index, (inputs, targets) in enumerate(evaluation):
        block = torch.tensor(list(stream[5 * index : 5 * index + 5]))
        assert inputs.dtype == targets.dtype == torch.long
        assert torch.equal(inputs, block[:-1]) and torch.equal(targets, block[1:])


def test_model_shape_parameters_and_flops():
    task = lm_task()
    model = task.build_model()
    assert model.lm_head.weight is model.tok_emb.weight  # tied: counted once
    assert sum(p.numel() for p in model.parameters()) == task.count_parameters(non_embedding=False)
    non_embedding = task.count_parameters()
    assert non_embedding == task.count_parameters(non_embedding=False) - 128 * 128
    assert task.flops_per_token() == 6 * non_embedding + 12 * 4 * 4 * 32 * 128
    assert task.tokens_per_sample() == 128  # a sample: one block of block_size tokens
    logits = model(torch.randint(0, 256, (2, 128)))
    assert logits.shape == (2, 128, 256)


def test_attention_is_causal():
    torch.manual_seed(0)
    model = lm_task(block_size=16, n_layer=2, n_embd=32).build_model().eval()
    tokens = torch.randint(0, 256, (1, 16))
    changed = tokens.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 256
    with torch.no_grad():
        torch.testing.assert_close(model(changed)[:, :10], model(tokens)[:, :10])
        assert not torch.allclose(model(changed)[:, 10:], model(tokens)[:, 10:])


def test_eval_outputs_sum_token_losses():
    task = lm_task(block_size=8, n_layer=1)
    model = task.build_model()
    inputs, targets = torch.randint(0, 256, (3, 8)), torch.randint(0, 256, (3, 8))
    outputs = task.eval_outputs(model, (inputs, targets))
    assert torch.equal(outputs["weight"], torch.full((3,), 8.0))
    mean = task.loss(model, (inputs, targets))
    torch.testing.assert_close(outputs["loss"].sum() / outputs["weight"].sum(), mean)
    assert set(outputs) == {"loss", "weight"} and task.metrics == []
    assert task.derived_metrics({"eval/loss": 2.0}) == {"eval/perplexity": math.exp(2.0)}


def test_prepared_text_splits_by_file(tmp_path):
    """scripts/prepare_text.py run into a fresh folder (not data/stdlib, which may be stale: it is git-ignored)."""
    from scripts.prepare_text import is_eval

    assert_ok(run_python("scripts/prepare_text.py", "--out", str(tmp_path)))
    train, evaluation = (pq.read_table(tmp_path / f"{split}.parquet").to_pydict() for split in ("train", "eval"))
    assert set(train) == set(evaluation) == {"path", "text"}
    assert not set(train["path"]) & set(evaluation["path"])
    assert train["path"] == sorted(train["path"]) and all(map(is_eval, evaluation["path"]))
    assert not any(is_eval(path) for path in train["path"])
    assert not any(part in ("test", "tests", "site-packages") for p in train["path"] for part in p.split("/")[:-1])
    assert 0.02 < len(evaluation["path"]) / (len(train["path"]) + len(evaluation["path"])) < 0.1
    total = sum(len(text.encode()) for split in (train, evaluation) for text in split["text"])
    assert 2**20 < total <= 8 * 2**20  # the default --max_mb 8 cap, and megabytes of real text


# --- docs/lm.md ---


def test_every_command_of_the_page_is_run():
    assert_bash_blocks_run("docs/lm.md")


@pytest.mark.slow
def test_gpt_recipe_commands(tmp_path):
    """docs/lm.md: prepare the stdlib text, train configs/lm.yaml (shortened, in this process); the GPU command where
    a GPU exists."""
    commands = section_commands("A GPT on real text", page="docs/lm.md")
    assert [c.split()[1] for c in commands] == ["scripts/prepare_text.py", "train.py", "launch"]
    cwd = workspace(tmp_path)
    for i, command in enumerate(commands):
        if "single_gpu" in command and not torch.cuda.is_available():
            continue
        shorten = ["--max_steps", "4", "--logging_steps", "2", "--max_eval_tokens", "8192", "--output_dir", f"r{i}"]
        if command.startswith("python train.py"):  # one process: run_main, from the same folder
            assert_ok(run_main(*as_written(command)[2:], *shorten, cwd=cwd))
            continue
        assert_ok(run_command(as_written(command) + (shorten if "train.py" in command else []), cwd=cwd, timeout=600))
    assert (cwd / "data" / "stdlib" / "train.parquet").is_file()
    assert [row["step"] for row in read_metrics(cwd / "r1") if "train/loss" in row] == [2, 4]


def test_token_blocks_gather_what_default_collate_stacks():
    assert_gathers_as_collated(causal_lm.TokenBlocks(torch.randint(0, 256, (40, 9), dtype=torch.uint8)))
