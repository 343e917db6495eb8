"""scripts/sass_compare.py's verdicts on SASS lines: a guard or compare of the opposite polarity is the same code
(the compiler complemented a predicate), another opcode or operand is not; anonymous-namespace names compare equal
across checkouts."""
import importlib
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture
def sass_compare(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    return importlib.import_module("sass_compare")


@pytest.mark.parametrize("a, b", [
    ("@P1 FSEL R25, R25, RZ, !P3", "@!P1 FSEL R25, R25, RZ, !P3"),
    ("ISETP.GT.U32.AND P0, PT, R14, R21, PT", "ISETP.LE.U32.AND P0, PT, R14, R21, PT"),
    ("ISETP.GT.OR.EX P1, PT, R12, R219, P1, P0", "ISETP.LE.AND.EX P1, PT, R12, R219, !P1, P0"),
])
def test_opposite_polarity_is_the_same_instruction(sass_compare, a, b):
    assert a != b and sass_compare.without_polarity(a) == sass_compare.without_polarity(b)


@pytest.mark.parametrize("a, b", [
    ("FADD R1, R2, R3", "FMUL R1, R2, R3"),
    ("@P1 FSEL R25, R25, RZ, !P3", "@P2 FSEL R25, R25, RZ, !P3"),
    ("ISETP.GE.AND P4, PT, R15, 0x1, PT", "ISETP.GE.AND P4, PT, R15, 0x9, PT"),
])
def test_other_instructions_differ(sass_compare, a, b):
    assert sass_compare.without_polarity(a) != sass_compare.without_polarity(b)


def test_anonymous_namespace_hash_is_ignored(sass_compare):
    one = "_ZN2tk9attention44_GLOBAL__N__6da3c4d2_11_backward_cu_2d666a9815backward_kernelI6__halfLi64EEEv"
    two = "_ZN2tk9attention44_GLOBAL__N__8a3f7678_11_backward_cu_2d666a9815backward_kernelI6__halfLi64EEEv"
    assert sass_compare._ANONYMOUS.sub("", one) == sass_compare._ANONYMOUS.sub("", two) != one
