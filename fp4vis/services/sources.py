"""Model sources from the user: a Hub id or a local path (``check_model_source``), as reports show it
(``display_source``: no absolute path of this machine), and a failed Hub load turned into an error that says
what to do (``is_network_error``, ``hub_error``)."""

from __future__ import annotations

import os
from pathlib import Path

from fp4vis.services.usage import UsageError


def is_local_path(source: str) -> bool:
    """True when ``source`` names a local path rather than a Hub id (``org/name``)."""
    if os.path.exists(source):
        return True
    if source.startswith(("/", "./", "../", "~", ".\\")) or os.path.isabs(source):
        return True
    return source.count("/") > 1 or "\\" in source


def display_source(source: str) -> str:
    """A model source as reports show it: a shipped name (``fp4vis:digits-wan``) or a Hub id as given, a
    local folder relative to the working directory, or by its name where it lies outside it (no
    absolute path of this machine in a report)."""
    if not isinstance(source, str) or source.startswith("fp4vis:") or not is_local_path(source):
        return source
    path = Path(os.path.expanduser(source)).resolve()
    try:
        return str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        return path.name


def check_model_source(source: str, what: str = "model") -> tuple[str, bool]:
    """Validate a hub id or local path; returns (source, is_local). A missing local path raises."""
    if not source:
        raise UsageError(f"{what}: give a Hugging Face Hub id (org/name) or a local directory")
    expanded = os.path.expanduser(source)
    if is_local_path(source):
        if not os.path.exists(expanded):
            raise UsageError(f"{what}: local path {source!r} does not exist (weights are never downloaded "
                             "implicitly for a path; pass an existing directory or a Hub id such as org/name)")
        return expanded, True
    return source, False


_NETWORK_ERRORS = ("LocalEntryNotFoundError", "OfflineModeIsEnabled", "RepositoryNotFoundError",
                   "HfHubHTTPError", "HTTPError", "ConnectionError", "ConnectError", "Timeout", "GatedRepoError")


def is_network_error(err: BaseException) -> bool:
    """True when a load failed because the Hub could not be reached or the repo is unknown."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if any(t.__name__ in _NETWORK_ERRORS for t in type(e).__mro__):
            return True
        msg = str(e)
        if "huggingface.co" in msg or "offline mode" in msg.lower() or "Hub" in msg:
            return True
        e = e.__cause__ or e.__context__
    return False


def hub_error(source: str, err: Exception) -> UsageError:
    """Turn a failed Hub load into an error that says what to do."""
    return UsageError(f"could not load {source!r} from the Hugging Face Hub ({type(err).__name__}: "
                      f"{str(err).splitlines()[0] if str(err) else ''}). Without network access, download "
                      "the weights elsewhere and pass the local directory instead.")
