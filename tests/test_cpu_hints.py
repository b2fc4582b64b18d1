"""The cpu_hints feature (src/features/cpu_hints/): a CPU run that trains slower than it could says why and the fix,
once per node."""

from src.config import TrainConfig
from src.features.cpu_hints import FEATURE


def hints(monkeypatch, capsys, config, use_cpu=True, **env) -> list[str]:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    FEATURE.check_launch(use_cpu, config)
    return capsys.readouterr().err.splitlines()


def test_more_processes_than_cores_and_emulated_bf16_are_warned_once_per_node(monkeypatch, capsys):
    monkeypatch.setattr("src.features.cpu_hints.usable_cores", lambda: 2)
    monkeypatch.setattr("src.features.cpu_hints.cpu_has_bf16", lambda: False)  # as on an AMD EPYC: emulated, slow
    bf16 = TrainConfig(mixed_precision="bf16")
    assert hints(monkeypatch, capsys, bf16, LOCAL_WORLD_SIZE="3", LOCAL_RANK="0") == [
        "warning: 3 processes on 2 CPU cores: they take turns, so this trains slower than 2 processes would; launch "
        "with --num_processes 2 (the global batch stays the same)",
        "warning: bf16 mixed precision on a CPU without bf16 instructions (AVX512-BF16, AMX): emulated, many times "
        "slower than float32 (docs/sharded.md); --mixed_precision no trains in float32",
    ]
    assert hints(monkeypatch, capsys, bf16, LOCAL_WORLD_SIZE="3", LOCAL_RANK="1") == []  # the node's first says it
    assert hints(monkeypatch, capsys, bf16, use_cpu=False, LOCAL_RANK="0") == []  # on GPUs neither applies
    assert hints(monkeypatch, capsys, None, LOCAL_WORLD_SIZE="3", LOCAL_RANK="0") == []  # scripts/launch.py's check
    evaluating = TrainConfig(mixed_precision="bf16", do_train=False)  # nothing trains slower
    assert hints(monkeypatch, capsys, evaluating, LOCAL_WORLD_SIZE="3", LOCAL_RANK="0") == []
    assert hints(monkeypatch, capsys, TrainConfig(), LOCAL_WORLD_SIZE="2", LOCAL_RANK="0") == []


def test_bf16_instructions_are_read_off_the_cpus_flags(tmp_path):
    from src.features.cpu_hints import cpu_has_bf16

    (tmp_path / "x86").write_text("flags\t\t: fpu sse2 avx2 avx512f\n")
    (tmp_path / "sapphire").write_text("flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16\n")
    (tmp_path / "graviton3").write_text("Features\t: fp asimd sve bf16 i8mm\n")
    has = {name: cpu_has_bf16(tmp_path / name) for name in ("x86", "sapphire", "graviton3", "no_such_file")}
    assert has == {"x86": False, "sapphire": True, "graviton3": True, "no_such_file": True}
