"""``fp4vis.settings``: every FP4VIS_* variable is declared once, read at use, validated, and listed in
docs/configuration.md; no other module reads one from the environment itself."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from fp4vis import settings

ROOT = Path(__file__).resolve().parents[2]


def test_settings_are_read_at_use(monkeypatch):
    monkeypatch.delenv("FP4VIS_HOPPER_SHORT", raising=False)
    assert settings.setting("FP4VIS_HOPPER_SHORT") is True
    monkeypatch.setenv("FP4VIS_HOPPER_SHORT", "0")
    assert settings.setting("FP4VIS_HOPPER_SHORT") is False
    monkeypatch.setenv("FP4VIS_BLACKWELL_CUBINS", "/some/Dir")
    assert settings.setting("FP4VIS_BLACKWELL_CUBINS") == "/some/Dir"   # text: as given


def test_bad_values_name_the_variable(monkeypatch):
    monkeypatch.setenv("FP4VIS_HOPPER_SHORT", "maybe")
    with pytest.raises(ValueError, match="FP4VIS_HOPPER_SHORT"):
        settings.setting("FP4VIS_HOPPER_SHORT")
    with pytest.raises(KeyError):
        settings.setting("FP4VIS_NO_SUCH_SETTING")


def test_overridden_restores_the_environment(monkeypatch):
    monkeypatch.delenv("FP4VIS_PREPASS_F16_CODES", raising=False)
    monkeypatch.setenv("FP4VIS_HOPPER_SHORT", "1")
    with settings.overridden(FP4VIS_PREPASS_F16_CODES="0", FP4VIS_HOPPER_SHORT="0"):
        assert settings.setting("FP4VIS_PREPASS_F16_CODES") is False
        assert settings.setting("FP4VIS_HOPPER_SHORT") is False
    assert settings.setting("FP4VIS_PREPASS_F16_CODES") is True
    assert settings.setting("FP4VIS_HOPPER_SHORT") is True
    with pytest.raises(ValueError), settings.overridden(FP4VIS_HOPPER_SHORT="perhaps"):
        pass


def test_kernel_settings_are_read_once_and_again_after_overridden(monkeypatch):
    monkeypatch.delenv("FP4VIS_HOPPER_SHORT", raising=False)
    settings.refresh()
    first = settings.kernel_settings()
    assert first.hopper_short is True and settings.kernel_settings() is first   # read once
    monkeypatch.setenv("FP4VIS_HOPPER_SHORT", "0")
    assert settings.kernel_settings() is first                                  # not at every call
    with settings.overridden(FP4VIS_HOPPER_SHORT="0"):
        assert settings.kernel_settings().hopper_short is False
    assert settings.kernel_settings().hopper_short is False                     # the environment's value now
    monkeypatch.delenv("FP4VIS_HOPPER_SHORT")
    settings.refresh()
    assert settings.kernel_settings().hopper_short is True


def _env_reads(source: str) -> list[int]:
    """Lines of ``source`` that read an ``FP4VIS_*`` variable from the environment themselves:
    ``os.environ[...]``, ``os.environ.get/pop/setdefault(...)``, ``os.getenv(...)`` or ``... in os.environ``
    with a name that is a string starting with FP4VIS_, an f-string starting so, or a module-level
    constant holding one (``CUBIN_ENV = "FP4VIS_..."``)."""
    tree = ast.parse(source)
    constants = {t.id for node in tree.body if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                 and isinstance(node.value.value, str) and node.value.value.startswith("FP4VIS_")
                 for t in node.targets if isinstance(t, ast.Name)}

    def names_setting(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return isinstance(node.value, str) and node.value.startswith("FP4VIS_")
        if isinstance(node, ast.JoinedStr):
            return bool(node.values) and names_setting(node.values[0])
        return isinstance(node, ast.Name) and node.id in constants

    def is_environ(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
            isinstance(node, ast.Name) and node.id == "environ")

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and is_environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute) and (
                (node.func.attr in ("get", "pop", "setdefault") and is_environ(node.func.value))
                or node.func.attr == "getenv"):
            key = node.args[0]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Name) and node.func.id == "getenv":
            key = node.args[0]
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) and any(
                is_environ(c) for c in node.comparators):
            key = node.left
        else:
            continue
        if names_setting(key):
            lines.append(node.lineno)
    return lines


def test_env_reads_finds_every_form():
    """The check below can fail: each way of reading a setting past fp4vis.settings is found."""
    src = """import os
from os import environ, getenv
CUBIN_ENV = "FP4VIS_BLACKWELL_CUBINS"
a = os.environ.get("FP4VIS_HOPPER_SHORT", "1")
b = os.environ[CUBIN_ENV]
c = os.getenv(f"FP4VIS_{a}")
d = "FP4VIS_EXHAUSTIVE" in os.environ
e = getenv("FP4VIS_X") or environ.pop("FP4VIS_Y", None)
ok = os.environ.get("TRITON_INTERPRET"), setting("FP4VIS_HOPPER_SHORT")
os.environ["FP4VIS_HOPPER_SHORT"] = "0"
"""
    assert _env_reads(src) == [4, 5, 6, 7, 8, 8]


def test_every_setting_is_documented_and_no_module_reads_one_itself():
    table = (ROOT / "docs" / "configuration.md").read_text()
    assert settings.markdown_table() in table
    documented = set(re.findall(r"^\| `(FP4VIS_[A-Z0-9_]+)` \|", table, re.M))
    assert documented == set(settings.SETTINGS)
    readers = []
    for folder in ("fp4vis", "kernels", "pipelines", "evals", "benchmarks", "scripts", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            if path == ROOT / "fp4vis" / "settings.py":
                continue
            readers += [f"{path.relative_to(ROOT)}:{line}" for line in _env_reads(path.read_text())]
    assert readers == []
