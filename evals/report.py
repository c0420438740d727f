"""Reports of the evals: JSON + short Markdown (the environment record from ``fp4vis.services.environment``),
table formatting and the 95 % interval of a mean.

Every eval writes ``<out_dir>/<name>.json`` (the raw numbers, machine readable, including the
environment) and ``<out_dir>/<name>.md`` (a short human report that states how each number was
computed). Nothing here imports a model library; it is safe to import anywhere.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from fp4vis.files import atomic_write
from fp4vis.services.environment import environment
from fp4vis.services.outputs import write_json


def write_report(out_dir: str | os.PathLike, name: str, result: dict[str, Any], markdown: str) -> dict[str, Path]:
    """Write ``<out_dir>/<name>.json`` (with ``environment`` added when missing) and ``<name>.md``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = dict(result)
    result.setdefault("environment", environment())
    json_path = write_json(out / f"{name}.json", result)
    md_path = out / f"{name}.md"
    warn = result.get("warnings") or []
    if warn:
        markdown = markdown.rstrip() + "\n\nWarnings during the run:\n" + "\n".join(f"- {w}" for w in warn)
    atomic_write(md_path, markdown.rstrip() + "\n\n" + environment_markdown(result["environment"]) + "\n"
                 + f"\nRaw output: [{json_path.name}]({json_path.name})\n")
    return {"json": json_path, "markdown": md_path}


def report_writer(out_dir: str | os.PathLike | None, name: str, result: dict[str, Any],
                  markdown: Callable[[dict[str, Any]], str]) -> Callable[[], None]:
    """The ``write()`` an eval's run loop calls after every run: ``result`` as it is then (its environment read
    again) as ``<name>.json`` and ``<name>.md`` in ``out_dir`` (nothing where None), their paths into
    ``result["files"]``."""
    def write() -> None:
        if out_dir is not None:
            result["environment"] = environment()
            files = write_report(out_dir, name, result, markdown(result))
            result["files"] = {k: str(v) for k, v in files.items()}
    return write


def environment_markdown(env: dict[str, Any]) -> str:
    gpu = env.get("gpu", {})
    devices = gpu.get("devices") or []
    gpu_txt = ", ".join(f"{d['name']} (sm_{d['capability'].replace('.', '')})" for d in devices) or "none (CPU)"
    v = env.get("versions", {})
    vers = ", ".join(f"{k} {val}" for k, val in v.items() if val)
    text = (f"Environment: GPU {gpu_txt}; Python {env.get('python')}; {vers}; "
            f"commit {env.get('git_commit') or 'unknown'}; {env.get('timestamp_utc')}.")
    library = env.get("library_warnings") or []
    if library:   # counted, not printed, while the command ran (fp4vis.services.console.WarningLog)
        text += "\n\nLibrary warnings (not printed during the run): " + "; ".join(
            f"{w['module']} {w['category']} x{w['count']}: {_first_words(w['message'])}" for w in library) + "."
    return text


def _first_words(message: str, limit: int = 100) -> str:
    line = message.splitlines()[0] if message else ""
    return line if len(line) <= limit else line[: limit - 3].rstrip() + "..."


def fmt(x: Any, digits: int = 4) -> str:
    """Compact number formatting for tables (None/NaN -> 'n/a')."""
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if not math.isfinite(x):
            return str(x)
        if x != 0 and (abs(x) >= 1e5 or abs(x) < 10 ** (-digits)):
            return f"{x:.{digits - 1}e}"
        return f"{x:.{digits}f}".rstrip("0").rstrip(".") if "." in f"{x:.{digits}f}" else f"{x}"
    return str(x)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], digits: int = 4) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(fmt(c, digits) for c in row) + " |")
    return "\n".join(lines)


_T975 = {3: 3.182446, 4: 2.776445, 5: 2.570582, 6: 2.446912, 7: 2.364624, 8: 2.306004, 9: 2.262157}


def t_quantile(p: float, df: int) -> float:
    """Quantile of Student's t distribution (two-sided intervals use p = 0.975).

    Exact for df = 1 and 2, tabulated (6 decimals) for p = 0.975 and df = 3..9, otherwise the
    Cornish-Fisher expansion around the normal quantile (absolute error below 1e-4 at p = 0.975
    for df >= 10, checked against scipy in the tests when it is installed).
    """
    if not 0 < p < 1:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    if df == 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    if p == 0.975 and df in _T975:
        return _T975[df]
    from statistics import NormalDist
    z = NormalDist().inv_cdf(p)
    n = float(df)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / n + g2 / n**2 + g3 / n**3 + g4 / n**4


def mean_ci95(values: Sequence[float]) -> dict[str, float | int | None]:
    """Mean with its 95 % Student-t confidence interval (None bounds with fewer than 2 values)."""
    vals = [float(v) for v in values]
    n = len(vals)
    if n == 0:
        return {"n": 0, "mean": None, "ci95_low": None, "ci95_high": None, "std": None}
    mean = sum(vals) / n
    if n < 2:
        return {"n": n, "mean": mean, "ci95_low": None, "ci95_high": None, "std": None}
    sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1))
    half = t_quantile(0.975, n - 1) * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "ci95_low": mean - half, "ci95_high": mean + half, "std": sd}


def wilson_ci95(successes: int, n: int) -> dict[str, float | int | None]:
    """A proportion with its 95 % Wilson score interval (sound at 0/n and n/n, where the normal
    approximation collapses to a point)."""
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, n], got {successes} of {n}")
    if n == 0:
        return {"k": 0, "n": 0, "rate": None, "ci95_low": None, "ci95_high": None}
    z = 1.959963984540054
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    low = 0.0 if successes == 0 else max(0.0, centre - half)   # exactly the end where the rate is at it
    high = 1.0 if successes == n else min(1.0, centre + half)
    return {"k": successes, "n": n, "rate": p, "ci95_low": low, "ci95_high": high}


def paired_rate_difference_ci95(gained: int, lost: int, n: int) -> dict[str, float | int | None]:
    """The difference of two success rates measured on the same n items (e.g. top-1 under a policy minus
    top-1 under BF16, image by image): ``(gained - lost) / n`` with the 95 % interval of Agresti and Min
    (2005; a Wald interval on the paired table with half a count added to each cell), which keeps a
    width where few or no items changed. ``gained``: items right only under the first, ``lost``: right
    only under the second."""
    if min(gained, lost) < 0 or gained + lost > n or n == 0:
        raise ValueError(f"gained, lost, n: need 0 <= gained + lost <= n > 0, got {gained}, {lost}, {n}")
    z = 1.959963984540054
    b, c, m = gained + 0.5, lost + 0.5, n + 2.0
    diff = (b - c) / m
    half = z * math.sqrt(max(0.0, (b + c) - (b - c) ** 2 / m)) / m
    return {"n": n, "gained": gained, "lost": lost, "mean": (gained - lost) / n,
            "ci95_low": max(-1.0, diff - half), "ci95_high": min(1.0, diff + half)}
