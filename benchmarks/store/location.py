"""Where results live and how store addresses are shown (issue 15, item 7).

* :func:`results_dir`: the folder of the default stores (MLflow ``mlflow.db``, Optuna
  ``optuna.db``), which never depends on the current directory: ``$PFLBENCH_RESULTS_DIR``, else
  ``results/`` of the checkout the harness runs from, else ``~/.local/share/pflbench/results``
  (an installed, non-editable copy).
* :func:`mask_uri`: an address with its password replaced by ``***``, for everything printed,
  tagged or raised (the ``store:`` line, provenance, tracebacks).
* :func:`split_credentials`: ``http://user:pass@host`` -> ``http://host`` plus the credentials,
  which MLflow then reads from ``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD``; the
  password never reaches MLflow's own "View run ... at: URL" lines or its error messages.
* :func:`check_reachable`: one quick request to a tracking server before a sweep, so that an
  unreachable server fails in seconds with one line instead of MLflow's minutes of retries.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

RESULTS_ENV = "PFLBENCH_RESULTS_DIR"
_CHECKOUT = Path(__file__).resolve().parents[2]
_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^:/@\s]*):(?P<password>[^@/\s]*)@")


class StoreError(RuntimeError):
    """A tracking store cannot be used (unreachable, credentials refused); the message is one line
    with the address masked."""


def results_dir() -> Path:
    """The default stores' folder: ``$PFLBENCH_RESULTS_DIR``, else the checkout's ``results/``,
    else ``~/.local/share/pflbench/results`` - never relative to the current directory."""
    chosen = os.environ.get(RESULTS_ENV)
    if chosen:
        return Path(chosen).expanduser().resolve()
    if (_CHECKOUT / "pyproject.toml").is_file():
        return _CHECKOUT / "results"
    return Path.home() / ".local" / "share" / "pflbench" / "results"


def mask_uri(text: str) -> str:
    """``text`` with the password of every ``scheme://user:password@`` replaced by ``***``."""
    return _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)


def split_credentials(uri: str) -> tuple[str, str | None, str | None]:
    """(address without user and password, user, password) of an http(s) URI; other URIs (a
    database URL needs its password inside) come back unchanged with no credentials."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or parts.username is None:
        return uri, None, None
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc)), parts.username, parts.password


def use_credentials(uri: str) -> str:
    """The address MLflow should be given for ``uri``: credentials of an http(s) URI move to
    ``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD`` (MLflow's basic-auth variables)."""
    bare, user, password = split_credentials(uri)
    if user is not None:
        os.environ["MLFLOW_TRACKING_USERNAME"] = user
        os.environ["MLFLOW_TRACKING_PASSWORD"] = password or ""
    return bare


def check_reachable(uri: str, timeout: float = 5.0) -> None:
    """Raise :class:`StoreError` unless the tracking server of an http(s) ``uri`` answers within
    ``timeout`` seconds (any other kind of store is not checked here)."""
    if urlsplit(uri).scheme not in ("http", "https"):
        return
    import requests

    bare, user, password = split_credentials(uri)
    if user is None and os.environ.get("MLFLOW_TRACKING_USERNAME"):
        user, password = os.environ["MLFLOW_TRACKING_USERNAME"], os.environ.get("MLFLOW_TRACKING_PASSWORD", "")
    fix = "start the server, or point --tracking-uri / MLFLOW_TRACKING_URI at a reachable one"
    try:
        reply = requests.get(bare.rstrip("/") + "/health", timeout=timeout,
                             auth=(user, password or "") if user is not None else None)
    except requests.RequestException as err:
        reason = type(err).__name__
        raise StoreError(f"tracking server {bare} unreachable within {timeout:g}s ({reason}); {fix}") from None
    if reply.status_code in (401, 403):
        raise StoreError(f"tracking server {bare} refused the credentials (HTTP {reply.status_code}); check the "
                         f"user and password in the URI or MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD")
    if reply.status_code >= 500:
        raise StoreError(f"tracking server {bare} answered HTTP {reply.status_code} to /health; {fix}")
