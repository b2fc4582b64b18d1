"""FSDP2 x tensor parallel (the tensor_parallel feature): docs/tensor_parallel.md's command on 4 CPU processes, a
2 x 2 mesh of data-parallel x tensor-parallel ranks, trains, evaluates and predicts with the GPT as one process does,
each process holding about a quarter of it; its sharded checkpoint resumes exactly on the same mesh (and is refused
on another). The same for a tiny transformers Llama (`--task language_modeling`), split by its own plan. And HSDP (2
replicas x 2 shards) trains the digits as one process does.

The runs compared with one process start their 4 ranks from the fork server (conftest.run_ranks: accelerate's own launch
code gives each its environment); the resumed run is the page's command launched as written."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from scripts.readme_commands import section_commands
from tests.conftest import (
    REPO,
    assert_ok,
    assert_processes,
    logged_losses,
    read_metrics,
    run_command,
    run_main,
    run_ranks,
    series,
)
from tests.helpers import as_written, assert_bash_blocks_run, needs

pytestmark = pytest.mark.usefixtures("stdlib_text")  # data/stdlib, built where missing (tests/conftest.py)

# A small GPT (433,664 parameters) for 6 steps of a global batch of 16 (2 data-parallel ranks x 2 micro-batches of 4
# on 4 processes; 4 accumulated micro-batches on one), float32, a short warm-up so that the steps move the weights.
# Then one eval of 121 blocks (an uneven last batch over the 2 data-parallel ranks) and 11 greedy predictions.
SMALL = ["--n_layer", "2", "--n_embd", "128", "--block_size", "32", "--max_train_tokens", "20000",
         "--max_steps", "6", "--logging_steps", "1", "--warmup_steps", "2", "--mixed_precision", "no",
         "--global_batch_size", "16", "--per_device_train_batch_size", "4",
         "--max_eval_tokens", "4000", "--eval_steps", "6", "--per_device_eval_batch_size", "16",
         "--do_predict", "true", "--max_new_tokens", "4", "--max_predict_samples", "11"]  # fmt: skip


def page_command() -> list[str]:
    (command,) = section_commands("Run it", page="docs/tensor_parallel.md")
    assert "fsdp_tp.yaml" in command
    return as_written(command)


def forked(command: list[str], *args: str) -> subprocess.CompletedProcess:
    """A page's `accelerate launch --config_file accelerate_configs/<config>.yaml train.py ...` (as_written's words)
    with `args` added, its 4 ranks started from the fork server (conftest.run_ranks)."""
    config = Path(command[command.index("--config_file") + 1])
    assert config.parent.as_posix() == "accelerate_configs" and "num_processes: 4" in (REPO / config).read_text()
    train_args = command[command.index("train.py") + 1 :]
    return run_ranks(REPO / "train.py", [*train_args, *args], 4, config=config.stem, timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, Path]:
    """The page's command on 4 forked processes (also checkpointing at step 3), and the same flags on one process (in
    this process): their output dirs."""
    out = {n: tmp_path_factory.mktemp(f"tp_p{n}") / "run" for n in (1, 4)}
    words = page_command()
    assert_ok(forked(words, *SMALL, "--save_steps", "3", "--output_dir", str(out[4])))
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


# --- the checkpoint: resumed exactly on the same mesh, refused on another ---


@pytest.mark.slow
def test_a_checkpoint_resumes_on_the_same_mesh_as_if_never_stopped(runs, tmp_path):
    """step_3 of the 4-process run (model and optimiser sharded over dp and tp by torch.distributed.checkpoint),
    continued on the same 2 x 2 mesh by the page's command, launched as written: steps 4-6, the eval and the
    predictions equal the uninterrupted run's."""
    out = tmp_path / "run"
    shutil.copytree(runs[4] / "checkpoints" / "step_3", out / "checkpoints" / "step_3")
    result = run_command([*page_command(), *SMALL, "--output_dir", str(out), "--resume_from_checkpoint", "latest"])
    assert_ok(result)
    assert "checkpoints/step_3 at step 3" in result.stdout + result.stderr  # "resuming from ..."
    saved = json.loads((runs[4] / "checkpoints" / "step_3" / "trainer_state.json").read_text())
    assert (saved["strategy"], saved["world_size"]) == ("FSDP2+TP", 4)  # what the refusal (the next test) reads
    rows, uninterrupted = read_metrics(out), read_metrics(runs[4])
    assert [(row["setup/strategy"], row["setup/world_size"]) for row in rows if "setup/strategy" in row] == [
        ("FSDP2+TP", 4)
    ]
    losses, expected = logged_losses(out), series(uninterrupted, "train/loss")
    assert list(losses) == [4, 5, 6]
    assert max(abs(losses[step] - expected[step]) for step in losses) <= 1e-5, (losses, expected)
    assert abs(series(rows, "eval/loss")[6] - series(uninterrupted, "eval/loss")[6]) <= 1e-5
    assert (out / "predictions.jsonl").read_text() == (runs[4] / "predictions.jsonl").read_text()


def test_a_checkpoint_on_another_process_count_or_strategy_is_refused_in_one_line(tmp_path):
    """A checkpoint whose state says FSDP2+TP on 4 processes (as the run above saves it): another count (another
    mesh: dp x tp = the processes) or a strategy without tp can't read its shards, and `resume` says so in one line
    before loading anything; the same mesh reads it."""
    from src.checkpoint import TrainerState, check_sharding
    from src.errors import UsageError

    saved = TrainerState(step=3, global_batch=16, world_size=4, strategy="FSDP2+TP")
    check_sharding(tmp_path, saved, TrainerState(world_size=4, strategy="FSDP2+TP"))
    for strategy, processes in [("FSDP2+TP", 8), ("FSDP2+TP", 2), ("FSDP2", 4), ("DDP", 4), ("single process", 1)]:
        with pytest.raises(UsageError, match=r"saved by FSDP2\+TP on 4 processes .* it was trained with and "
                                             r"--num_processes 4$"):  # fmt: skip
            check_sharding(tmp_path, saved, TrainerState(world_size=processes, strategy=strategy))


# --- a transformers Llama, split by its own plan ---

# A tiny Llama (from a config: rotary attention with 4 heads and 2 key/value heads, a gated MLP, RMSNorm, an untied
# head; 330,048 parameters, most of them the 2,000-token vocabulary's embedding and head) on the tiny GPT-2's
# tokenizer, fine-tuned 4 steps of a global batch of 16 packed 32-token blocks, float32, no dropout. Then one eval of
# 37 blocks (an uneven last batch over the 2 data-parallel ranks) and 7 greedy predictions (left-padded prompts).
LLAMA = ["--task", "language_modeling", "--dropout", "0", "--block_size", "32", "--max_steps", "4",
         "--logging_steps", "1", "--warmup_steps", "1", "--learning_rate", "5e-3", "--mixed_precision", "no",
         "--global_batch_size", "16", "--per_device_train_batch_size", "4",
         "--max_eval_samples", "37", "--eval_steps", "4", "--per_device_eval_batch_size", "8",
         "--do_predict", "true", "--max_new_tokens", "4", "--max_predict_samples", "7"]  # fmt: skip


@pytest.fixture(scope="module")
def llama_runs(tmp_path_factory, hf_assets) -> dict[int, Path]:
    """The tiny Llama trained by the page's launch on 4 forked processes and by one process (in this process)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    model_dir = tmp_path_factory.mktemp("tp_llama") / "llama"
    tokenizer = AutoTokenizer.from_pretrained(hf_assets["gpt2"])  # the tiny GPT-2's byte-level BPE
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    args = [*LLAMA, "--model_name_or_path", str(model_dir), "--data_files", hf_assets["data"]]
    out = {n: tmp_path_factory.mktemp(f"tp_llama_p{n}") / "run" for n in (1, 4)}
    words = page_command()
    launcher = words[: words.index("train.py") + 1]  # the page's launch, without configs/lm.yaml (the GPT's)
    assert_ok(forked(launcher, *args, "--output_dir", str(out[4])))
    assert_ok(run_main(*args, "--output_dir", str(out[1])))
    assert_processes(out[4], 4)
    return out


@needs("hf")
@pytest.mark.slow
def test_a_transformers_llama_trains_evaluates_and_predicts_as_one_process_does(llama_runs):
    """Its plan (the model's config.base_model_tp_plan: q/k/v, gate and up column-wise, o and down row-wise; the
    embedding and head split by vocabulary) and FSDP2: each process holds a quarter of the parameters, and the
    losses, the eval (each block counted once) and the predictions are one process's."""
    rows = {n: read_metrics(llama_runs[n]) for n in llama_runs}
    one, four = (series(rows[n], "train/loss") for n in (1, 4))
    assert list(one) == list(range(1, 5)) and list(four) == list(one)
    assert max(abs(four[step] - one[step]) for step in one) < 1e-5, (one, four)
    assert one[4] < one[1]  # the steps trained
    assert [rows[n][0]["setup/strategy"] for n in (1, 4)] == ["single process", "FSDP2+TP"]
    param_bytes = {n: series(rows[n], "memory/param_bytes")[1] for n in rows}
    assert param_bytes[4] <= 0.3 * param_bytes[1], param_bytes
    evals = {n: series(rows[n], "eval/loss") for n in rows}
    assert list(evals[4]) == list(evals[1]) == [4] and abs(evals[4][4] - evals[1][4]) < 1e-5, evals
    assert {n: series(rows[n], "eval/num_samples")[4] for n in rows} == {1: 37, 4: 37}
    predictions = {n: (llama_runs[n] / "predictions.jsonl").read_text() for n in llama_runs}
    assert predictions[4] == predictions[1] and len(predictions[1].splitlines()) == 7


# --- HSDP: 2 replicas x 2 shards ---

# the default digits task, 8 steps of a global batch of 64 (4 data-parallel ranks x 16; 4 micro-batches on one
# process), float32, at the learning rate where 1 and N processes agree to float rounding (tests/test_distributed.py)
HSDP_RUN = ["--max_steps", "8", "--logging_steps", "1", "--learning_rate", "1e-3", "--mixed_precision", "no",
            "--global_batch_size", "64", "--per_device_train_batch_size", "16", "--eval_steps", "8"]  # fmt: skip


@pytest.mark.slow
def test_hsdp_trains_as_one_process_does(tmp_path):
    """The page's HSDP command on 4 forked processes: the per-step losses and the eval of one process (every sample
    counted once), each process holding half the parameters (sharded over the 2 processes of a replica, whole in each
    of the 2 replicas), `setup/strategy` HSDP: read off the model, whose parameters live on a mesh with a "dp_replicate"
    dimension (not FSDP2 over all 4, not DDP)."""
    (command,) = section_commands("HSDP", page="docs/tensor_parallel.md")
    out = {n: tmp_path / f"p{n}" for n in (1, 4)}
    assert_ok(forked(as_written(command), *HSDP_RUN, "--output_dir", str(out[4])))
    assert_ok(run_main(*HSDP_RUN, "--output_dir", str(out[1])))
    assert_processes(out[4], 4)
    rows = {n: read_metrics(out[n]) for n in out}
    one, four = (series(rows[n], "train/loss") for n in (1, 4))
    assert list(one) == list(four) == list(range(1, 9))
    assert max(abs(four[step] - one[step]) for step in one) < 1e-5, (one, four)
    setup = {n: rows[n][0] for n in rows}
    assert [setup[n]["setup/strategy"] for n in (1, 4)] == ["single process", "HSDP"]
    assert (setup[4]["setup/global_batch"], setup[4]["setup/gradient_accumulation"]) == (64, 1)
    param_bytes = {n: series(rows[n], "memory/param_bytes")[1] for n in rows}
    assert 0.45 <= param_bytes[4] / param_bytes[1] <= 0.55, param_bytes
    evals = {n: series(rows[n], "eval/loss") for n in rows}
    assert list(evals[4]) == [8] and abs(evals[4][8] - evals[1][8]) < 1e-5, evals
    assert series(rows[4], "eval/num_samples")[8] == series(rows[1], "eval/num_samples")[8]


# --- the memory planner's rows against what the runs hold ---


def planned_rows(run: Path) -> dict[str, dict]:
    """scripts/plan_memory.py (the memory_planner feature) for a run's own config.yaml on its 4 devices, in this
    process (its Accelerator(cpu=True) is process-wide state: the tests reset it, `fresh_accelerate_state`): its rows
    without activation checkpointing, by strategy."""
    import contextlib
    import io

    from scripts import plan_memory

    with contextlib.redirect_stdout(io.StringIO()):
        plan = plan_memory.main(["--config", str(run / "config.yaml"), "--devices", "4", "--device_memory", "1GiB"])
    return {row["strategy"]: row for row in plan["strategies"] if not row["activation_checkpointing"]}


def assert_planned_as_held(runs: dict[int, Path]) -> None:
    """The planner's per-device parameter and optimiser-state bytes within 10% of what each run logged: DDP's of one
    process's, FSDP2+TP's of a process of the 4 (it counts every parameter split 4 ways; the GPT's replicated
    embeddings and LayerNorms make that 8% low)."""
    rows = planned_rows(runs[1])
    for strategy, processes in (("DDP", 1), ("FSDP2+TP", 4)):
        (logged,) = [row for row in read_metrics(runs[processes]) if "memory/param_bytes" in row]
        for key in ("param_bytes", "optimizer_state_bytes"):
            assert rows[strategy][key] == pytest.approx(logged[f"memory/{key}"], rel=0.10), (strategy, key)


@needs("memory_planner")
@pytest.mark.slow
def test_the_memory_planner_s_bytes_are_what_the_gpt_runs_hold(runs, fresh_accelerate_state):
    assert_planned_as_held(runs)


@needs("memory_planner", "hf")
@pytest.mark.slow
def test_the_memory_planner_s_bytes_are_what_the_llama_runs_hold(llama_runs, fresh_accelerate_state):
    assert_planned_as_held(llama_runs)


# --- what it refuses ---


@pytest.mark.parametrize(
    ("flags", "world_size", "oldest_torch", "refused"),
    [
        (["--task", "digits"], "4", None, "plans for --task causal_lm's GPT and --task language_modeling's .* digits"),
        (["--config", "configs/lm.yaml"], "2", None, "asks for 4 processes .* but 2 were launched"),
        (["--config", "configs/lm.yaml"], "4", "99.0", r"on CPU processes needs torch >= 99.0 \(this is .*fsdp.yaml"),
    ],
)
def test_what_it_cannot_do_is_one_line_before_any_group_forms(flags, world_size, oldest_torch, refused, monkeypatch):
    """The launch's checks (every process, before the group forms), as `accelerate launch` of fsdp_tp.yaml sets it;
    `oldest_torch`: the torch tensor parallel needs on CPU processes, made newer than this one."""
    from src.cli import parse_config
    from src.errors import LaunchError
    from src.features import tensor_parallel

    launched = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
                "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2", "PARALLELISM_CONFIG_TP_SIZE": "2",
                "WORLD_SIZE": world_size}  # fmt: skip
    for name, value in launched.items():
        monkeypatch.setenv(name, value)
    if oldest_torch:
        monkeypatch.setattr(tensor_parallel, "CPU_TP_TORCH", oldest_torch)
        tensor_parallel.FEATURE.check_launch(False, parse_config(flags))  # on GPUs: Accelerate's own, any torch
    with pytest.raises(LaunchError, match=refused):
        tensor_parallel.FEATURE.check_launch(True, parse_config(flags))


@needs("hf")
def test_a_model_without_a_plan_it_can_apply_is_refused_in_one_line():
    """The model's own plan must name only linears split column- or row-wise, with nothing beside them, and heads
    divisible by the tensor-parallel size; a model of no known kind has no plan (train.py says each as one line)."""
    import torch
    import transformers
    from torch import nn

    from src.errors import LaunchError
    from src.features.tensor_parallel import plan_for
    from src.features.tensor_parallel.transformers_plan import check_plan

    def model(kind: str, **sizes):
        config = getattr(transformers, f"{kind}Config")(vocab_size=32, hidden_size=16, intermediate_size=32,
                                                        num_hidden_layers=1, **sizes)  # fmt: skip
        return getattr(transformers, f"{kind}ForCausalLM")(config)

    assert check_plan(model("Llama", num_attention_heads=4, num_key_value_heads=2), 2) is None
    refusals = {
        "the model's num_attention_heads 2 is not divisible by the tensor-parallel size 4": (
            model("Llama", num_attention_heads=2, num_key_value_heads=2), 4),
        "the model's num_key_value_heads 1 is not divisible by the tensor-parallel size 2": (
            model("Llama", num_attention_heads=4, num_key_value_heads=1), 2),
        "Qwen3ForCausalLM's tensor-parallel plan uses replicated_with_grad_allreduce; this feature applies colwise "
        "and rowwise only": (model("Qwen3", num_attention_heads=2, num_key_value_heads=2), 2),
        "GPT2LMHeadModel has no tensor-parallel plan (its config's base_model_tp_plan); use "
        "accelerate_configs/fsdp.yaml": (transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8,
                                         n_head=2, vocab_size=32)), 2),
    }  # fmt: skip
    beside = model("Llama", num_attention_heads=4, num_key_value_heads=2)
    beside.model.layers[0].self_attn.register_parameter("sinks", nn.Parameter(torch.zeros(4)))  # one per head
    refusals["LlamaForCausalLM's layers.0.self_attn.sinks sits between the split linears but the plan does not "
             "split it"] = (beside, 2)  # fmt: skip
    assert {check_plan(*refused): refusal for refusal, refused in refusals.items()} == {r: r for r in refusals}
    with pytest.raises(LaunchError, match="plans for the causal_lm GPT and transformers models only, not Linear"):
        plan_for(nn.Linear(2, 2))


@needs("hf")
@pytest.mark.parametrize("tied", [False, True])
def test_the_llama_s_plan_splits_by_its_own_names_and_keeps_a_tied_head(tied):
    """The plan on a mesh of one rank (a group of this process alone): each linear split as its config names it, the
    embedding and head by vocabulary rows, a tied head still the embedding's parameter (FSDP2 then shards it once),
    the norms replicated; the logits unchanged."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from transformers import LlamaConfig, LlamaForCausalLM

    from src.features.tensor_parallel.transformers_plan import check_plan, parallelize_transformers_model

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)  # fmt: skip
    model = LlamaForCausalLM(config)
    tokens = torch.randint(0, 32, (2, 5))
    expected = model(tokens).logits
    assert check_plan(model, 1) is None
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallelize_transformers_model(model, init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)))
        placements = {name: p.placements for name, p in model.named_parameters() if isinstance(p, DTensor)}
        logits = model(tokens).logits
    finally:
        dist.destroy_process_group()
    layer = "model.layers.0."
    assert len(placements) == len(dict(model.named_parameters())) == 12 - tied  # every parameter, each once
    assert {name: placements[layer + name] for name in ("self_attn.k_proj.weight", "self_attn.o_proj.weight",
            "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight")} == {
        "self_attn.k_proj.weight": (Shard(0),), "self_attn.o_proj.weight": (Shard(1),),
        "mlp.up_proj.weight": (Shard(0),), "mlp.down_proj.weight": (Shard(1),),
        "input_layernorm.weight": (Replicate(),)}  # fmt: skip
    assert placements["model.embed_tokens.weight"] == (Shard(0),)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert model.lm_head.weight.placements == (Shard(0),)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)


def test_the_page_s_commands_are_run():
    assert_bash_blocks_run("docs/tensor_parallel.md")
