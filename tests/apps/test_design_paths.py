"""docs/design.md describes the layout as it is: every module path it names (a backquoted ``dir/name.py``,
relative to the repository root) exists, so a move that forgets the page fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"


def named_module_paths(text: str) -> set[str]:
    """The module paths a page names: backquoted tokens with a folder and a .py name (a bare ``usage.py``
    is named within a folder the sentence gives, and is not checked)."""
    return set(re.findall(r"`([\w./-]+/[\w.-]+\.py)`", text))


def test_every_module_path_design_md_names_exists():
    paths = named_module_paths(DESIGN.read_text())
    assert len(paths) > 40   # the page names the layout; an empty match would pass without checking it
    missing = sorted(p for p in paths if not (ROOT / p).is_file())
    assert not missing, f"docs/design.md names modules that do not exist: {', '.join(missing)}"


def test_the_layout_of_the_apps_is_on_the_page():
    """Each module of pipelines/, evals/ and fp4vis/cli/ is named on the page (a new one is described there)."""
    text = DESIGN.read_text()
    modules = [p.relative_to(ROOT).as_posix() for folder in ("pipelines", "evals", "fp4vis/cli")
               for p in sorted((ROOT / folder).glob("*.py")) if not p.name.startswith("__")]
    unnamed = [m for m in modules if f"`{m}`" not in text]
    assert not unnamed, f"docs/design.md does not name: {', '.join(unnamed)}"
