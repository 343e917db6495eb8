"""Settings that tk reads from the environment (THUNDER_TK_*) as one word out of a fixed set. Each is checked, so a
misspelt value is an error that names the variable and its choices, never a silent default."""

from __future__ import annotations

import os


def env_choice(name: str, choices: tuple[str, ...], default: str, requested: str | None = None) -> str:
    """`requested` where given, else the variable `name` (stripped, lower case; unset or blank: `default`), checked
    against `choices`; the error names the variable whichever way the value came."""
    value = requested if requested is not None else (os.environ.get(name, "").strip().lower() or default)
    if value not in choices:
        listed = " or ".join(choices) if len(choices) == 2 else "one of " + ", ".join(choices)
        raise ValueError(f"{name}={value!r}: expected {listed}")
    return value
