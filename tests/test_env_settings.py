"""env_settings: the one check behind tk's word-valued THUNDER_TK_* settings, and their list."""

import pytest

from thunder_tk import env_settings
from thunder_tk.env_settings import env_choice


def test_requested_then_environment_then_default(monkeypatch):
    monkeypatch.delenv("THUNDER_TK_TEST_CHOICE", raising=False)
    assert env_choice("THUNDER_TK_TEST_CHOICE", ("a", "b"), "a") == "a"
    monkeypatch.setenv("THUNDER_TK_TEST_CHOICE", "  B ")  # stripped, lower case
    assert env_choice("THUNDER_TK_TEST_CHOICE", ("a", "b"), "a") == "b"
    assert env_choice("THUNDER_TK_TEST_CHOICE", ("a", "b"), "a", requested="a") == "a"
    monkeypatch.setenv("THUNDER_TK_TEST_CHOICE", "")
    assert env_choice("THUNDER_TK_TEST_CHOICE", ("a", "b"), "a") == "a"


def test_a_bad_value_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv("THUNDER_TK_TEST_CHOICE", "c")
    with pytest.raises(ValueError, match=r"THUNDER_TK_TEST_CHOICE='c': expected a or b$"):
        env_choice("THUNDER_TK_TEST_CHOICE", ("a", "b"), "a")
    with pytest.raises(ValueError, match=r"THUNDER_TK_TEST_CHOICE='d': expected one of a, b, c$"):
        env_choice("THUNDER_TK_TEST_CHOICE", ("a", "b", "c"), "a", requested="d")  # a bad argument too


def test_every_setting_defaults_to_one_of_its_choices_and_reads_through_the_check(monkeypatch):
    names = [s.name for s in env_settings.SETTINGS]
    assert len(set(names)) == len(names) and all(n.startswith("THUNDER_TK_") for n in names)
    for setting in env_settings.SETTINGS:
        monkeypatch.delenv(setting.name, raising=False)
        assert setting.default in setting.choices and setting.read() == setting.default
        monkeypatch.setenv(setting.name, "no-such-value")
        with pytest.raises(ValueError, match=setting.name):
            setting.read()
