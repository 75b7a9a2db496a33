"""Loading a kubeconfig file for every command that talks to a cluster (`gpupool scheduler`, `extender`,
`status` and `gpupool-deviceplugin`), so that a bad file is one line naming it and the problem, never a
traceback from inside the `kubernetes` client (issue 22, item 2).

The `kubernetes` client catches only its own ConfigException: garbage YAML gives yaml.ScannerError, a
file holding a bare string or a list a TypeError, a binary one a UnicodeDecodeError, a `clusters:` that
is not a list an AttributeError. `load_kubeconfig` reads and checks the file first, then lets the client
load it and turns whatever it still raises into a KubeconfigError.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from gpupool_common.clihelp import decode_utf8

__all__ = ["KubeconfigError", "load_kubeconfig", "read_kubeconfig"]

# top-level keys that hold lists of named entries, and the key of each entry's body
SECTIONS = {"clusters": "cluster", "contexts": "context", "users": "user"}
MAX_BYTES = 16 * 1024 * 1024  # kubeconfigs are kilobytes; a huge file is a wrong path


class KubeconfigError(ValueError):
    """A kubeconfig that cannot be used; the message is one line naming the file."""


def _yaml_problem(exc: yaml.YAMLError) -> str:
    problem = getattr(exc, "problem", None) or getattr(exc, "reason", None) or str(exc).splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    if mark is not None:
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    position = getattr(exc, "position", None)  # ReaderError: a character YAML does not allow
    return f"{problem} (at character {position})" if position is not None else str(problem)


def _kind(value: object) -> str:
    if value is None:
        return "empty"
    names = {str: "a string", list: "a list", int: "a number", float: "a number", bool: "a boolean"}
    return names.get(type(value), f"a {type(value).__name__}")


def read_kubeconfig(path: str | Path) -> dict[str, Any]:
    """The kubeconfig's document, checked as far as the client needs it to not crash; every problem is a
    KubeconfigError whose message starts with ``kubeconfig PATH``."""
    where = f"kubeconfig {path}"
    p = Path(path)
    try:
        if p.is_dir():
            raise KubeconfigError(f"{where} is a directory, not a kubeconfig file")
        if not p.exists():
            raise KubeconfigError(f"{where} does not exist")
        if p.stat().st_size > MAX_BYTES:
            raise KubeconfigError(f"{where} is {p.stat().st_size:,} bytes, not a kubeconfig (at most "
                                  f"{MAX_BYTES // 1024 // 1024} MiB)")
        raw = p.read_bytes()
    except OSError as exc:
        raise KubeconfigError(f"{where} cannot be read: {exc.strerror or exc}") from None
    text, bad = decode_utf8(raw)
    if text is None:
        raise KubeconfigError(f"{where} is not UTF-8 text at {bad} (a binary file?)")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise KubeconfigError(f"{where} is not valid YAML: {_yaml_problem(exc)}") from None
    except RecursionError:
        raise KubeconfigError(f"{where} is not valid YAML: nested too deeply") from None
    if not isinstance(data, dict):
        raise KubeconfigError(f"{where} is {_kind(data)}, not a kubeconfig (a mapping with clusters, contexts, "
                              "users and current-context)")
    for section, body in SECTIONS.items():
        entries = data.get(section)
        if entries is None:
            continue
        if not isinstance(entries, list):
            raise KubeconfigError(f"{where}: {section} is {_kind(entries)}, not a list")
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                raise KubeconfigError(f"{where}: {section}[{i}] is not a mapping with a name")
            if entry.get(body) is not None and not isinstance(entry.get(body), dict):
                raise KubeconfigError(f"{where}: {section}[{i}].{body} is {_kind(entry.get(body))}, not a mapping")
    current = data.get("current-context")
    if current is not None and not isinstance(current, str):
        raise KubeconfigError(f"{where}: current-context is {_kind(current)}, not a context name")
    return data


def load_kubeconfig(path: str | Path, client_configuration: Any = None) -> None:
    """``kubernetes.config.load_kube_config`` for one file, checked first (read_kubeconfig); whatever the
    client still raises becomes one KubeconfigError line. Without ``client_configuration`` the client's
    default configuration is set, as load_kube_config does."""
    read_kubeconfig(path)
    from kubernetes import config
    from kubernetes.config.config_exception import ConfigException

    try:
        config.load_kube_config(config_file=str(path), client_configuration=client_configuration)
    except ConfigException as exc:
        raise KubeconfigError(f"cannot use kubeconfig {path}: {_one_line(exc)}") from None
    except (TypeError, AttributeError, KeyError, ValueError, IndexError, yaml.YAMLError, OSError) as exc:
        raise KubeconfigError(f"cannot use kubeconfig {path}: {type(exc).__name__}: {_one_line(exc)}") from None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__
