"""The optimiser and schedule (src/optim.py): warmup + cosine/linear/constant values, one scheduler step per optimiser
step, no weight decay on biases and normalisation weights."""

import math

import pytest
import torch

from src.config import TrainConfig
from src.models.digits_cnn import DigitsCNN
from src.optim import build_optimizer, build_scheduler, follow_config, lr_factor
from tests.conftest import assert_ok, read_metrics, run_main, series


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_warmup_then_decay_at_known_steps(kind):
    total, warmup = 100, 20
    assert lr_factor(0, total, warmup, kind) == 1 / 21  # the first step already trains, at 1/(warmup + 1)
    assert lr_factor(10, total, warmup, kind) == 11 / 21
    assert lr_factor(19, total, warmup, kind) == 20 / 21
    assert lr_factor(20, total, warmup, kind) == 1.0  # warmup done: the peak
    assert lr_factor(60, total, warmup, kind) == pytest.approx(0.5, abs=1e-12)  # halfway through the decay
    assert lr_factor(100, total, warmup, kind) == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(150, total, warmup, kind) == pytest.approx(0.0, abs=1e-12)  # past the end: stays at 0


def test_cosine_and_linear_differ_between_the_known_points():
    assert lr_factor(40, 100, 20, "linear") == pytest.approx(0.75)  # a quarter of the decay
    assert lr_factor(40, 100, 20, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))  # 0.854


def scheduler_lrs(kind: str, steps: int, total: int = 10, warmup: int = 4) -> list[float]:
    """The LR after each of `steps` scheduler steps, through build_scheduler as train.py uses it."""
    config = TrainConfig(learning_rate=1e-3, lr_scheduler_type=kind, warmup_steps=warmup)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=config.learning_rate)
    scheduler = build_scheduler(optimizer, config, total)
    lrs = [scheduler.get_last_lr()[0]]  # before the first step
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    return lrs


def test_build_scheduler_follows_lr_factor():
    for kind in ("cosine", "linear", "constant_with_warmup"):
        expected = [1e-3 * lr_factor(step, 10, 4, kind) for step in range(11)]
        assert scheduler_lrs(kind, 10) == pytest.approx(expected, rel=1e-12)
    assert scheduler_lrs("constant_with_warmup", 10)[:5] == pytest.approx([1e-3 * s / 5 for s in range(1, 6)])
    assert scheduler_lrs("constant", 10) == [1e-3] * 11  # constant: no warmup at all


@pytest.mark.parametrize("norm", ["group", "batch", "none"])
def test_no_weight_decay_on_biases_and_norm_weights(norm):
    model = DigitsCNN(norm=norm)
    decay, no_decay = build_optimizer(model, TrainConfig(weight_decay=0.1)).param_groups
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    in_decay, in_no_decay = {id(p) for p in decay["params"]}, {id(p) for p in no_decay["params"]}
    for name, parameter in model.named_parameters():
        assert id(parameter) in (in_decay if parameter.ndim >= 2 else in_no_decay), name
    assert len(in_decay) + len(in_no_decay) == len(list(model.parameters()))  # each parameter in exactly one group
    norms = (torch.nn.GroupNorm, torch.nn.BatchNorm2d)
    norm_weights = {f"{m}.weight" for m, module in model.named_modules() if isinstance(module, norms)}
    biases = {name for name, _ in model.named_parameters() if name.endswith(".bias")}
    assert {name for name, p in model.named_parameters() if p.ndim == 1} == norm_weights | biases


def test_weight_decay_shrinks_only_the_decayed_parameters():
    """A step with zero gradients leaves Adam's update at 0: only the decoupled decay moves a parameter."""
    model = DigitsCNN(norm="group")
    optimizer = build_optimizer(model, TrainConfig(weight_decay=0.1, learning_rate=0.5))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    for name, parameter in model.named_parameters():
        factor = 1 - 0.5 * 0.1 if parameter.ndim >= 2 else 1.0
        torch.testing.assert_close(parameter.detach(), before[name] * factor, rtol=0, atol=1e-7, msg=name)


@pytest.mark.slow
def test_one_scheduler_step_per_optimiser_step(out):
    """With 2 micro-batches per optimiser step the logged LR after step s is the schedule's value at s, not at 2s."""
    result = run_main("--max_steps", "10", "--warmup_steps", "4", "--logging_steps", "1", "--eval_steps", "1000",
                      "--per_device_train_batch_size", "32", "--global_batch_size", "64",
                      "--output_dir", str(out))  # fmt: skip
    assert_ok(result)
    rows = read_metrics(out)
    assert rows[0]["setup/gradient_accumulation"] == 2
    logged = series(rows, "train/lr")
    assert list(logged) == list(range(1, 11))
    expected = {step: 3e-3 * lr_factor(step, 10, 4, "cosine") for step in logged}
    assert logged == pytest.approx(expected, rel=1e-9)


def test_adamw_is_fused_and_updates_as_the_default_kernel_does():
    """One fused kernel on the CPU too (Trainer's default): the update torch's default AdamW makes, to round-off."""
    torch.manual_seed(0)
    models = [DigitsCNN(norm="group") for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    config = TrainConfig(weight_decay=0.1, learning_rate=1e-2)
    fused = build_optimizer(models[0], config)
    assert all(group["fused"] for group in fused.param_groups)
    params = list(models[1].parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]  # fmt: skip
    default = torch.optim.AdamW(groups, lr=1e-2)  # torch's default on the CPU: a loop over the parameters
    assert not default.defaults["fused"]
    batch = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    for _ in range(5):
        for model, optimizer in zip(models, (fused, default), strict=True):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
            optimizer.step()
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


def test_a_run_shorter_than_its_warmup_or_twice_it_is_warned_about(caplog):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    build_scheduler(optimizer, TrainConfig(warmup_steps=20), total_steps=41)
    assert "warmup_steps" not in caplog.text
    build_scheduler(optimizer, TrainConfig(warmup_steps=20), total_steps=30)
    assert "--warmup_steps 20 is 66% of this run's 30 steps: the learning rate peaks late; lower --warmup_steps " \
        "(a tenth of the run: 3)" in caplog.text  # fmt: skip
    build_scheduler(optimizer, TrainConfig(warmup_steps=20), total_steps=20)
    assert "--warmup_steps 20 covers all 20 steps of this run: the learning rate only rises" in caplog.text


def test_a_resume_takes_the_configs_rates_not_the_checkpoints():
    """The optimiser and schedule state of a run with one learning rate, betas and weight decay, loaded into one built
    from another config (as a resume does): the new config's, at the checkpoint's point of the schedule."""
    model = DigitsCNN()
    before = TrainConfig(learning_rate=1e-2, adam_beta1=0.8, weight_decay=0.1, warmup_steps=2)
    optimizer, total = build_optimizer(model, before), 10
    scheduler = build_scheduler(optimizer, before, total)
    for _ in range(5):
        optimizer.step()
        scheduler.step()
    after = TrainConfig(learning_rate=1e-3, adam_beta1=0.9, weight_decay=0.0, warmup_steps=2)
    resumed_optimizer = build_optimizer(model, after)
    resumed = build_scheduler(resumed_optimizer, after, total)
    resumed_optimizer.load_state_dict(optimizer.state_dict())
    resumed.load_state_dict(scheduler.state_dict())
    follow_config(resumed_optimizer, resumed, after)
    expected = 1e-3 * lr_factor(5, total, 2, "cosine")
    assert resumed.get_last_lr() == pytest.approx([expected, expected])
    assert [group["lr"] for group in resumed_optimizer.param_groups] == pytest.approx([expected, expected])
    assert {group["betas"] for group in resumed_optimizer.param_groups} == {(0.9, 0.999)}
    assert [group["weight_decay"] for group in resumed_optimizer.param_groups] == [0.0, 0.0]
    optimizer.step()  # and the schedule goes on from there
    resumed.step()
    assert resumed.get_last_lr()[0] == pytest.approx(1e-3 * lr_factor(6, total, 2, "cosine"))


@pytest.mark.parametrize("groups", [1, 2])
def test_an_optimiser_and_schedule_of_ones_own_resume_as_saved(groups):
    """A forker's SGD (one group, or two at their own rates) and schedule in place of build_optimizer's and
    build_scheduler's: a resume leaves their rates, momentum and weight decay as the checkpoint saved them (it set
    the config's on every group, or failed on one group)."""
    model = DigitsCNN()
    params = list(model.parameters())
    parts = [{"params": params}] if groups == 1 else [{"params": params[:-2]}, {"params": params[-2:], "lr": 0.05}]
    optimizer = torch.optim.SGD(parts, lr=0.005, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    optimizer.step()
    scheduler.step()
    saved = [dict(group, params=None) for group in optimizer.param_groups]
    follow_config(optimizer, scheduler, TrainConfig(learning_rate=1e-3, weight_decay=0.01))
    assert [dict(group, params=None) for group in optimizer.param_groups] == saved
    assert scheduler.get_last_lr() == pytest.approx([group["lr"] for group in saved])


@pytest.mark.slow
def test_a_resumed_run_trains_at_its_new_learning_rate(tmp_path):
    args = ["--max_steps", "4", "--logging_steps", "1", "--save_steps", "2", "--eval_steps", "100",
            "--lr_scheduler_type", "constant", "--warmup_steps", "0"]  # fmt: skip
    assert_ok(run_main(*args, "--output_dir", str(tmp_path / "first")))
    step_2 = str(tmp_path / "first" / "checkpoints" / "step_2")
    assert_ok(run_main(*args, "--learning_rate", "1e-4", "--resume_from_checkpoint", step_2,
                       "--output_dir", str(tmp_path / "resumed")))  # fmt: skip
    assert series(read_metrics(tmp_path / "resumed"), "train/lr") == {3: 1e-4, 4: 1e-4}
