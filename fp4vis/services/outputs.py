"""The files the apps write: output paths checked before any work (``check_output_file``,
``check_output_dir``: a UsageError naming the option), JSON written atomically (``write_json``, through
``fp4vis.files``), and the name of a new benchmark result by benchmarks/results/README.md's scheme
(``new_result_path``)."""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import re
import string
import tempfile
from pathlib import Path
from typing import Any

from fp4vis.files import atomic_write
from fp4vis.services.usage import UsageError


def _check_writable_dir(d: Path, option: str) -> None:
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=d):
            pass
    except OSError as exc:
        raise UsageError(f"{option}: cannot write in {str(d)!r} ({exc.strerror or exc})") from None


def check_output_file(path: str | os.PathLike, option: str) -> Path:
    """Before any work: ``path`` can be written as a file (not a directory; its folder exists or can be
    made, and is writable). Raises UsageError naming the option."""
    p = Path(os.path.expanduser(str(path)))
    if p.is_dir():
        raise UsageError(f"{option}: {str(path)!r} is a directory; give a file name")
    if p.parent.exists() and not p.parent.is_dir():
        raise UsageError(f"{option}: {str(p.parent)!r} is a file, not a directory")
    _check_writable_dir(p.parent, option)
    return p


def check_output_dir(path: str | os.PathLike, option: str) -> Path:
    """Before any work: ``path`` is a writable directory, or can be made one. Raises UsageError."""
    p = Path(os.path.expanduser(str(path)))
    if p.exists() and not p.is_dir():
        raise UsageError(f"{option}: {str(path)!r} is a file, not a directory")
    _check_writable_dir(p, option)
    return p


def _jsonable(obj: Any) -> Any:
    """Convert tensors, numpy values, paths, dataclasses and non-finite floats to plain JSON."""
    import dataclasses

    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _jsonable(dataclasses.asdict(obj))
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)  # "nan", "inf" stay readable
    if hasattr(obj, "tolist"):  # torch / numpy scalars and arrays
        return _jsonable(obj.tolist())
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    return str(obj)


def write_json(path: str | os.PathLike, data: dict[str, Any]) -> Path:
    """``data`` as indented JSON (tensors, paths, non-finite floats made plain), written atomically."""
    return atomic_write(path, json.dumps(_jsonable(data), indent=2, sort_keys=False) + "\n")


RESULTS_DIR = Path("benchmarks/results")   # relative: the benchmarks run from the repository's root
_FIELD = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")   # one field of a result's name: lowercase words and hyphens


def machine_tag() -> str:
    """The results' machine token: ``h200`` / ``h100`` for those GPUs, another CUDA device's name in lowercase letters
    and digits without "NVIDIA" (``b200``, ``geforcertx4090``), ``cpu`` where there is none."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    words = [w for w in re.findall(r"[A-Za-z0-9]+", torch.cuda.get_device_name()) if w.upper() != "NVIDIA"]
    for gpu in ("H200", "H100"):
        if gpu in (w.upper() for w in words):
            return gpu.lower()
    return "".join(words[:3]).lower() or "gpu"


def new_result_path(what: str, variant: str | None = None, results_dir: str | os.PathLike = RESULTS_DIR,
                    machine: str | None = None, run: str | None = None, ext: str = "json",
                    now: dt.datetime | None = None) -> Path:
    """``<YYYYMMDD><run>_<machine>_<what>[_<variant>].<ext>`` in ``results_dir`` (benchmarks/results/README.md):
    today's UTC date; ``run``, else the first letter after every one that day's files already have (a round's
    later files pass the round's letter); ``machine_tag()`` unless given. Raises ValueError for a field that is
    not lowercase words joined by hyphens, or past run ``z``."""
    for option, field in (("what", what), ("variant", variant), ("machine", machine), ("run", run)):
        if field is not None and not (_FIELD.fullmatch(field) and (option != "run" or len(field) == 1)):
            raise ValueError(f"{option}: {field!r} is not a results name field (lowercase words joined by '-'"
                             f"{'; one letter' if option == 'run' else ''})")
    stamp = (now or dt.datetime.now(dt.UTC)).strftime("%Y%m%d")
    d = Path(results_dir)
    if run is None:
        used = {m.group(1) for f in (d.iterdir() if d.is_dir() else ())
                if (m := re.match(rf"{stamp}([a-z])_", f.name))}
        free = [c for c in string.ascii_lowercase if not used or c > max(used)]
        if not free:
            raise ValueError(f"{d}: run letters a-z of {stamp} are all taken")
        run = free[0]
    name = "_".join([f"{stamp}{run}", machine or machine_tag(), what] + ([variant] if variant else []))
    return d / f"{name}.{ext}"
