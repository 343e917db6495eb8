"""scripts/ncu_source_top.py on a small CSV shaped like ncu's source page (the kernel's name on a line of its own,
then the header): the lines with the most stall samples first, shares of the total, samples per opcode."""
import importlib
from pathlib import Path

CSV = '''"Kernel Name","void kernel<float>(int)",
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","# Samples"
"0x10","HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ","60","50","60"
"0x20","@!P0  BRA 0x10","30","25","30"
"0x30","MUFU.EX2 R1, R1","1,0","5","10"
'''


SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def test_lines_ranked_by_stall_samples(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    report = tmp_path / "rep.csv"
    report.write_text(CSV)
    assert importlib.import_module("ncu_source_top").main([str(report), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "100 in all over 3 lines" in out
    assert "HGMMA.64x64x16.F32.BF16 60.0%" in out and "BRA 30.0%" in out and "MUFU.EX2 10.0%" in out
    ranked = [line for line in out.splitlines() if line.lstrip().startswith("0x")]
    assert len(ranked) == 2
    assert ranked[0].split()[:2] == ["0x10", "60.0%"] and ranked[1].split()[:2] == ["0x20", "30.0%"]
    assert "Not-issued Samples=50" in ranked[0]


WAVEFRONTS = '''"Kernel Name","void kernel<float>(int)",
"Address","Source","Warp Stall Sampling (All Samples)","L1 Wavefronts Shared Excessive","L1 Wavefronts Shared","L1 Wavefronts Shared Ideal"
"0x10","LD.E.64 R2, desc[UR4][R4.64]","5","200","300","100"
"0x20","STSM.16.M88.4 [R7], R8","9","0","100","100"
"0x30","FFMA R1, R1, R2, R3","20","0","0","0"
'''


def test_lines_ranked_by_another_column_with_its_relatives(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    report = tmp_path / "rep.csv"
    report.write_text(WAVEFRONTS)
    module = importlib.import_module("ncu_source_top")
    assert module.main([str(report), "--by", "l1 wavefronts shared", "--top", "2"]) == 0  # the exact name
    out = capsys.readouterr().out
    assert "L1 Wavefronts Shared: 400 in all over 3 lines" in out
    ranked = [line for line in out.splitlines() if line.lstrip().startswith("0x")]
    assert [line.split()[:2] for line in ranked] == [["0x10", "75.0%"], ["0x20", "25.0%"]]
    assert "L1 Wavefronts Shared Ideal=100" in ranked[0] and "L1 Wavefronts Shared Excessive=200" in ranked[0]
    assert module.main([str(report), "--by", "excessive", "--top", "1"]) == 0  # else the first containing it
    assert "L1 Wavefronts Shared Excessive: 200 in all" in capsys.readouterr().out
    import pytest

    with pytest.raises(SystemExit, match="no column contains"):
        module.main([str(report), "--by", "bank conflicts"])
