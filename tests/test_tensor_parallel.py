"""FSDP2 x tensor parallel (the tensor_parallel feature): docs/tensor_parallel.md's command on 4 CPU processes, a
2 x 2 mesh of data-parallel x tensor-parallel ranks, trains, evaluates and predicts with the GPT as one process does,
each process holding about a quarter of it."""

from pathlib import Path

import pytest

from scripts.readme_commands import section_commands
from tests.conftest import assert_ok, assert_processes, read_metrics, run_command, run_main, series
from tests.helpers import as_written, assert_bash_blocks_run

pytestmark = pytest.mark.usefixtures("stdlib_text")  # data/stdlib, built where missing (tests/conftest.py)

# A small GPT (433,664 parameters) for 6 steps of a global batch of 16 (2 data-parallel ranks x 2 micro-batches of 4
# on 4 processes; 4 accumulated micro-batches on one), float32, a short warm-up so that the steps move the weights.
# Then one eval of 121 blocks (an uneven last batch over the 2 data-parallel ranks) and 11 greedy predictions.
SMALL = ["--n_layer", "2", "--n_embd", "128", "--block_size", "32", "--max_train_tokens", "20000",
         "--max_steps", "6", "--logging_steps", "1", "--warmup_steps", "2", "--mixed_precision", "no",
         "--global_batch_size", "16", "--per_device_train_batch_size", "4",
         "--max_eval_tokens", "4000", "--eval_steps", "6", "--per_device_eval_batch_size", "16",
         "--do_predict", "true", "--max_new_tokens", "4", "--max_predict_samples", "11"]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, Path]:
    """The page's command on 4 processes, and the same flags on one process (in this process): their output dirs."""
    (command,) = section_commands("Run it", page="docs/tensor_parallel.md")
    assert "fsdp_tp.yaml" in command
    out = {n: tmp_path_factory.mktemp(f"tp_p{n}") / "run" for n in (1, 4)}
    words = as_written(command)
    assert_ok(run_command([*words, *SMALL, "--output_dir", str(out[4])], timeout=600))
    assert_ok(run_main(*words[words.index("train.py") + 1 :], *SMALL, "--output_dir", str(out[1])))
    assert_processes(out[4], 4)
    return out


@pytest.mark.slow
def test_fsdp2_tp_trains_as_one_process_does(runs):
    rows = {n: read_metrics(runs[n]) for n in runs}
    one, four = (series(rows[n], "train/loss") for n in (1, 4))
    assert list(one) == list(range(1, 7)) and list(four) == list(one)
    assert max(abs(four[step] - one[step]) for step in one) < 1e-5, (one, four)
    assert one[6] < one[1]  # the steps trained
    setup = {n: rows[n][0] for n in rows}
    assert setup[4]["setup/strategy"] == "FSDP2+TP" and setup[1]["setup/strategy"] == "single process"
    # the global batch counts the 2 data-parallel ranks, not the 4 processes: 16 = 4 x 2 ranks x 2 micro-batches
    assert (setup[4]["setup/global_batch"], setup[4]["setup/gradient_accumulation"]) == (16, 2)
    assert (setup[1]["setup/global_batch"], setup[1]["setup/gradient_accumulation"]) == (16, 4)


@pytest.mark.slow
def test_each_process_holds_about_a_quarter_of_the_parameters(runs):
    """FSDP2 halves every parameter over the data-parallel ranks; the plan halves the blocks' linears again over the
    tensor-parallel ranks (the embeddings and LayerNorms are replicated there): 0.27 of one process's bytes."""
    param_bytes = {n: series(read_metrics(runs[n]), "memory/param_bytes")[1] for n in runs}
    assert param_bytes[4] <= 0.3 * param_bytes[1], param_bytes


@pytest.mark.slow
def test_eval_counts_each_sample_once_and_predictions_are_one_process_s(runs):
    """The tensor-parallel ranks of a group give the same outputs: gathered once per data-parallel group."""
    one, four = (series(read_metrics(runs[n]), "eval/loss") for n in (1, 4))
    assert list(four) == list(one) == [6] and abs(four[6] - one[6]) < 1e-5, (one, four)
    samples = {n: series(read_metrics(runs[n]), "eval/num_samples")[6] for n in runs}
    assert samples == {1: 4000 // 33, 4: 4000 // 33}
    predictions = {n: (runs[n] / "predictions.jsonl").read_text() for n in runs}
    assert predictions[4] == predictions[1] and len(predictions[1].splitlines()) == 11


@pytest.mark.parametrize(
    ("flags", "world_size", "refused"),
    [
        (["--task", "digits"], "4", "a plan for --task causal_lm's GPT only, not digits"),
        (["--config", "configs/lm.yaml"], "2", "asks for 4 processes .* but 2 were launched"),
    ],
)
def test_what_it_cannot_do_is_one_line_before_any_group_forms(flags, world_size, refused, monkeypatch):
    """The launch's checks (every process, before the group forms), as `accelerate launch` of fsdp_tp.yaml sets it."""
    from src.cli import parse_config
    from src.errors import LaunchError
    from src.features.tensor_parallel import FEATURE

    launched = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
                "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2", "PARALLELISM_CONFIG_TP_SIZE": "2",
                "WORLD_SIZE": world_size}  # fmt: skip
    for name, value in launched.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(LaunchError, match=refused):
        FEATURE.check_launch(True, parse_config(flags))


def test_the_page_s_commands_are_run():
    assert_bash_blocks_run("docs/tensor_parallel.md")
