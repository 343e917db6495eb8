"""Channel settings: defaults, environment knobs and named errors (no GPU needed: checked when the config is made)."""

import pytest

from thunder_tk import collectives
from thunder_tk.collectives import ChannelConfig


def test_defaults_give_reduce_scatter_more_receiving_warps():
    cfg = ChannelConfig(blocks=128, buffer_bytes=64 << 20, timeout_s=600)
    assert (cfg.slots, cfg.ag_sender_warps, cfg.rs_sender_warps, cfg.pairs) == (4, 8, 4, True)
    assert cfg.min_chunk_bytes == collectives.MIN_CHUNK_BYTES


@pytest.mark.parametrize("field, value, words", [
    ("blocks", 0, "blocks must be >= 1"),
    ("timeout_s", 0.0, "timeout_s must be positive"),
    ("slots", 1, "slots must be >= 2"),
    ("ag_sender_warps", 16, "ag_sender_warps must be 1..15"),
    ("rs_sender_warps", 0, "rs_sender_warps must be 1..15"),
    ("min_chunk_bytes", 8200, "min_chunk_bytes must be a positive multiple of 16"),
    ("units_per_block", 0, "units_per_block must be >= 1"),
    ("engine", "nvlink", "engine must be one of sm, copy, auto"),
    ("copy_slots", 1, "copy_slots must be >= 2"),
    ("copy_buffer_bytes", 4096, "copy_buffer_bytes must be at least 1 MiB"),
    ("copy_reduce_blocks", 0, "copy_reduce_blocks must be >= 1"),
    ("copy_signal", "flag", "copy_signal must be write or copy"),
])
def test_a_bad_setting_is_named(field, value, words):
    kwargs = dict(blocks=128, buffer_bytes=64 << 20, timeout_s=600.0)
    kwargs[field] = value
    with pytest.raises(ValueError, match=words):
        ChannelConfig(**kwargs)


def test_environment_knobs(monkeypatch):
    monkeypatch.setenv("THUNDER_TK_COLLECTIVE_BLOCKS", "32")
    monkeypatch.setenv("THUNDER_TK_COLLECTIVE_BUFFER_MB", "16")
    monkeypatch.setenv("THUNDER_TK_COLLECTIVE_SLOTS", "4")
    cfg = ChannelConfig.from_env()
    assert (cfg.blocks, cfg.buffer_bytes, cfg.slots) == (32, 16 << 20, 4)
    assert cfg.pairs
    monkeypatch.setenv("THUNDER_TK_COLLECTIVE_PAIRS", "0")
    assert not ChannelConfig.from_env().pairs
    assert ChannelConfig.from_env().units_per_block == collectives.UNITS_PER_BLOCK
    monkeypatch.setenv("THUNDER_TK_COLLECTIVE_UNITS", "8")
    assert ChannelConfig.from_env().units_per_block == 8
    monkeypatch.setenv("THUNDER_TK_COLLECTIVE_SLOTS", "1")
    with pytest.raises(ValueError, match="slots must be >= 2"):
        ChannelConfig.from_env()


@pytest.mark.parametrize("units, total_mib, want", [
    # 4 ranks, 42 lanes of paired blocks, 128 KiB cells: a 16 MiB message is 4 MiB per rank.
    (4, 16, 24976),        # 4 MiB / (42 x 4), up to a multiple of 16
    (8, 16, 12496),        # twice the units, half the bytes each
    (4, 1, 8192),          # below the smallest unit: the smallest unit
    (4, 1024, 128 << 10),  # above a cell: a cell
])
def test_units_per_block_sets_the_unit_size(units, total_mib, want):
    cfg = ChannelConfig(blocks=128, buffer_bytes=64 << 20, timeout_s=600, units_per_block=units)
    per_rank = (total_mib << 20) // 4
    got = collectives.chunk_bytes(per_rank, 42, cfg, 128 << 10)
    assert got == want and got % 16 == 0
    if cfg.min_chunk_bytes < got < 128 << 10:
        assert -(-per_rank // got) <= 42 * units  # every lane gets at most `units` of them


def test_the_engine_knobs_choose_per_message(monkeypatch):
    assert ChannelConfig.from_env().engine == "sm"
    assert not ChannelConfig.from_env().uses_copy_engine(1 << 30)
    monkeypatch.setenv("THUNDER_TK_COLLECTIVE_ENGINE", "Copy")
    cfg = ChannelConfig.from_env()
    assert cfg.engine == "copy" and cfg.uses_copy_engine(16) and cfg.uses_copy_engine(1 << 30)
    monkeypatch.setenv("THUNDER_TK_COLLECTIVE_ENGINE", "auto")
    monkeypatch.setenv("THUNDER_TK_COLLECTIVE_CE_MIN_MB", "0.5")
    monkeypatch.setenv("THUNDER_TK_COLLECTIVE_CE_BUFFER_MB", "32")
    monkeypatch.setenv("THUNDER_TK_COLLECTIVE_CE_SLOTS", "3")
    monkeypatch.setenv("THUNDER_TK_COLLECTIVE_CE_REDUCE_BLOCKS", "8")
    monkeypatch.setenv("THUNDER_TK_COLLECTIVE_CE_SIGNAL", "copy")
    cfg = ChannelConfig.from_env()
    assert cfg.copy_signal == "copy"
    assert (cfg.copy_min_bytes, cfg.copy_buffer_bytes, cfg.copy_slots, cfg.copy_reduce_blocks) == (
        512 << 10, 32 << 20, 3, 8)
    assert not cfg.uses_copy_engine((512 << 10) - 1) and cfg.uses_copy_engine(512 << 10)
    monkeypatch.setenv("THUNDER_TK_COLLECTIVE_ENGINE", "dma")
    with pytest.raises(ValueError, match="engine must be one of"):
        ChannelConfig.from_env()


def test_ranks_whose_settings_differ_fail_alike_and_name_the_variable(tmp_path):
    """Two gloo ranks, checked as `thunder-tk pretrain` does before it builds the model: a shared collective setting
    that differs, one rank's invalid setting, or THUNDER_TK_DISABLE turning collectives (or their schedule) off on
    one rank only, raises the same error on both ranks, naming the variable and which rank holds what; the per-rank
    settings (timeout, the copy engines' summing blocks and signalling) and local kernels' switches may differ."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    cases = [
        {"name": "same", "env": [{"THUNDER_TK_COLLECTIVE_BLOCKS": "32"}, {"THUNDER_TK_COLLECTIVE_BLOCKS": "32"}]},
        {"name": "blocks", "env": [{}, {"THUNDER_TK_COLLECTIVE_BLOCKS": "32"}]},
        {"name": "engine and slots", "env": [{"THUNDER_TK_COLLECTIVE_ENGINE": "auto"},
                                             {"THUNDER_TK_COLLECTIVE_CE_SLOTS": "8"}]},
        {"name": "per rank", "env": [{"THUNDER_TK_COLLECTIVE_TIMEOUT_S": "30",
                                      "THUNDER_TK_COLLECTIVE_CE_REDUCE_BLOCKS": "8"},
                                     {"THUNDER_TK_COLLECTIVE_CE_SIGNAL": "copy"}]},
        {"name": "invalid on one", "env": [{}, {"THUNDER_TK_COLLECTIVE_SLOTS": "1"}]},
        {"name": "collectives off on one", "env": [{"THUNDER_TK_DISABLE": "gemm,collective"}, {}]},
        {"name": "schedule off on one", "env": [{}, {"THUNDER_TK_DISABLE": "collective_schedule"}]},
        {"name": "two off on one", "env": [{"THUNDER_TK_DISABLE": "collective_schedule,collective"}, {}]},
        {"name": "gemm off on one", "env": [{"THUNDER_TK_DISABLE": "gemm"}, {}]},
    ]
    worker = Path(__file__).with_name("collective_settings_worker.py")
    out = tmp_path / "outcome"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(worker),
           json.dumps(cases), str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]
    assert got[0] == got[1]  # both ranks fail (or pass) alike
    o = got[0]
    assert o["same"] == "ok" and o["per rank"] == "ok" and o["gemm off on one"] == "ok"
    assert "THUNDER_TK_COLLECTIVE_BLOCKS (blocks): 128 on rank 0, 32 on rank 1" in o["blocks"], o["blocks"]
    assert "THUNDER_TK_COLLECTIVE_ENGINE (engine): 'auto' on rank 0, 'sm' on rank 1" in o["engine and slots"]
    assert "THUNDER_TK_COLLECTIVE_CE_SLOTS (copy_slots): 4 on rank 0, 8 on rank 1" in o["engine and slots"]
    assert "BLOCKS" not in o["engine and slots"]
    assert "tk collectives' settings are invalid on rank 1: " in o["invalid on one"], o["invalid on one"]
    assert "THUNDER_TK_COLLECTIVE_SLOTS='1'" in o["invalid on one"], o["invalid on one"]
    assert "THUNDER_TK_DISABLE turns off different collective rules on different ranks (collective on rank 0, " \
        "none on rank 1)" in o["collectives off on one"], o["collectives off on one"]
    assert "(none on rank 0, collective_schedule on rank 1)" in o["schedule off on one"], o["schedule off on one"]
    assert "(collective+collective_schedule on rank 0, none on rank 1)" in o["two off on one"], o["two off on one"]


def test_settings_problem_names_the_ranks_and_fields():
    base = collectives.shared_settings(ChannelConfig(blocks=128, buffer_bytes=64 << 20, timeout_s=600))
    assert "timeout_s" not in base  # acts on one rank only
    assert collectives.settings_problem([base, dict(base), dict(base)]) is None
    other = {**base, "slots": 8}
    assert collectives.settings_problem([base, other, base]) == (
        "tk collectives' settings differ between the ranks of a group, which must share them: "
        "THUNDER_TK_COLLECTIVE_SLOTS (slots): 4 on ranks 0, 2, 8 on rank 1")
    bad = collectives.shared_settings(ValueError("ChannelConfig: slots must be >= 2"))
    assert collectives.settings_problem([base, other, bad]) == (
        "tk collectives' settings are invalid on rank 2: ChannelConfig: slots must be >= 2")
    assert collectives.ranks_holding(["a", "b", "a"]) == "a on ranks 0, 2, b on rank 1"
