"""``fp4vis.config``: every FP4VIS_* variable is declared once, read at use, validated, and listed in
docs/configuration.md; no other module reads one from the environment itself."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fp4vis import config

ROOT = Path(__file__).resolve().parents[2]


def test_settings_are_read_at_use(monkeypatch):
    monkeypatch.delenv("FP4VIS_HOPPER_SHORT", raising=False)
    assert config.setting("FP4VIS_HOPPER_SHORT") is True
    monkeypatch.setenv("FP4VIS_HOPPER_SHORT", "0")
    assert config.setting("FP4VIS_HOPPER_SHORT") is False
    monkeypatch.setenv("FP4VIS_HOPPER_SCHEDULE", "Serial")
    assert config.setting("FP4VIS_HOPPER_SCHEDULE") == "serial"


def test_bad_values_name_the_variable(monkeypatch):
    monkeypatch.setenv("FP4VIS_HOPPER_SHORT", "maybe")
    with pytest.raises(ValueError, match="FP4VIS_HOPPER_SHORT"):
        config.setting("FP4VIS_HOPPER_SHORT")
    monkeypatch.setenv("FP4VIS_HOPPER_SCHEDULE", "fastest")
    with pytest.raises(ValueError, match="FP4VIS_HOPPER_SCHEDULE.*pingpong"):
        config.setting("FP4VIS_HOPPER_SCHEDULE")
    with pytest.raises(KeyError):
        config.setting("FP4VIS_NO_SUCH_SETTING")


def test_overridden_restores_the_environment(monkeypatch):
    monkeypatch.delenv("FP4VIS_PREPASS_F16_CODES", raising=False)
    monkeypatch.setenv("FP4VIS_HOPPER_SHORT", "1")
    with config.overridden(FP4VIS_PREPASS_F16_CODES="0", FP4VIS_HOPPER_SHORT="0"):
        assert config.setting("FP4VIS_PREPASS_F16_CODES") is False
        assert config.setting("FP4VIS_HOPPER_SHORT") is False
    assert config.setting("FP4VIS_PREPASS_F16_CODES") is True
    assert config.setting("FP4VIS_HOPPER_SHORT") is True
    with pytest.raises(ValueError), config.overridden(FP4VIS_HOPPER_SHORT="perhaps"):
        pass


def test_every_setting_is_documented_and_no_module_reads_one_itself():
    table = (ROOT / "docs" / "configuration.md").read_text()
    assert config.markdown_table() in table
    documented = set(re.findall(r"^\| `(FP4VIS_[A-Z0-9_]+)` \|", table, re.M))
    assert documented == set(config.SETTINGS)
    readers = []
    for folder in ("fp4vis", "kernels", "pipelines", "evals", "benchmarks", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "config.py" and path.parent.name == "fp4vis" or path.name == "test_config.py":
                continue
            if re.search(r"(environ|getenv)\b[^\n]{0,8}[\"']FP4VIS_|[\"']FP4VIS_\w+[\"']\s+in\s+os\.environ",
                         path.read_text()):
                readers.append(str(path.relative_to(ROOT)))
    assert readers == []
