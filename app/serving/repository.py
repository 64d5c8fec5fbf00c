"""A model repository on disk: which models exist, their versions, and each version's settings.

```
DIR/<name>/config.toml       that model's settings (the model keys of the settings, lower case)
DIR/<name>/<version>/        1, 2, ...: that version's files; an optional config.toml there
                             overrides the model's keys for this version
```

Besides the model keys, a model's config.toml may say which versions serve: ``version_policy``
is ``"latest"`` (the ``latest_versions`` highest, default 1), ``"all"``, or a list of version
numbers. Relative paths (``labels``, ``calibration_dir``, and ``weights`` when it names a file)
resolve against the folder of the file that names them; a version folder holding ``model.pt``
(or ``model.pth``) serves those weights unless its config names others. Every problem is one
line naming the file and the key.

Without a repository, the model of the process's settings is the only model, version 1.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from app.errors import BadRequestError
from app.model_config import MODEL_KEYS, ModelConfig
from app.settings import MODEL_NAME_PATTERN, Settings, error_lines

CONFIG = "config.toml"
WEIGHT_FILES = ("model.pt", "model.pth")
POLICY_KEYS = frozenset({"version_policy", "latest_versions"})
_PATH_KEYS = ("labels", "calibration_dir")


class RepositoryError(ValueError):
    """The repository, a model's config or a version's config is not usable: one line per
    problem, naming the file."""


@dataclass(frozen=True)
class VersionSpec:
    """One version of a model, and the configuration it is built with."""

    model: str
    version: int
    config: ModelConfig


@dataclass(frozen=True)
class ModelSpec:
    """A model and the versions its policy serves (highest first)."""

    name: str
    versions: tuple[VersionSpec, ...]

    @property
    def latest(self) -> int:
        return self.versions[0].version


def single_model(settings: Settings) -> ModelSpec:
    """Without a repository: the model of the settings, version 1."""
    return ModelSpec(settings.served_name,
                     (VersionSpec(settings.served_name, 1, settings.own_model()),))  # fmt: skip


def model_names(root: Path) -> list[str]:
    """The models in the repository: folders holding a config.toml, in name order."""
    return sorted(path.name for path in root.iterdir() if (path / CONFIG).is_file())


def read_model(root: Path, name: str, base: Settings) -> ModelSpec:
    """Read ``root/name``: its config, its versions and their settings (the process part of
    ``base`` with the model's keys), or ``RepositoryError``."""
    folder = root / name
    config_path = folder / CONFIG
    if not re.fullmatch(MODEL_NAME_PATTERN, name) or not config_path.is_file():
        raise RepositoryError(f"no model {name!r} in {root} (no {name}/{CONFIG})")
    document = _read_toml(config_path)
    problems: list[str] = []
    policy = _policy(document, config_path, problems)
    values = _model_values(document, config_path, problems, POLICY_KEYS)
    found = sorted(
        (int(path.name) for path in folder.iterdir() if path.is_dir() and path.name.isdigit()),
        reverse=True,
    )
    if not found:
        problems.append(f"{folder}: no version folders (1, 2, ...)")
    chosen = _choose(found, policy, config_path, problems)
    versions = []
    for version in chosen:
        version_folder = folder / str(version)
        override_path = version_folder / CONFIG
        overrides: dict[str, Any] = {}
        if override_path.is_file():
            overrides = _model_values(_read_toml(override_path), override_path, problems)
        if "weights" not in overrides:
            for candidate in WEIGHT_FILES:
                if (version_folder / candidate).is_file():
                    overrides["weights"] = str(version_folder / candidate)
                    break
        where = override_path if override_path.is_file() else config_path
        try:
            config = base.for_model({**values, **overrides}, name)
        except ValidationError as exc:
            lines = error_lines(exc, lambda key: key or "config")
            problems += [f"{where}: {line}" for line in lines]
            continue
        versions.append(VersionSpec(name, version, config))
    if problems:
        raise RepositoryError("\n".join(problems))
    return ModelSpec(name, tuple(versions))


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as stream:
            return tomllib.load(stream)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise RepositoryError(f"{path}: not readable TOML ({exc})") from None


def _model_values(
    config: dict[str, Any], path: Path, problems: list[str], allowed: frozenset[str] = frozenset()
) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key, value in config.items():
        if key in allowed:
            continue
        if key not in MODEL_KEYS:
            problems.append(f"{path}: unknown key {key!r} (a model's keys: "
                            f"{', '.join(sorted(MODEL_KEYS))})")  # fmt: skip
            continue
        values[key] = _resolved(key, value, path.parent)
    return values


def _resolved(key: str, value: Any, folder: Path) -> Any:
    if not isinstance(value, str) or not value or Path(value).is_absolute():
        return value
    if key in _PATH_KEYS or (key == "weights" and (folder / value).exists()):
        return str(folder / value)
    return value


def _policy(config: dict[str, Any], path: Path, problems: list[str]) -> Any:
    policy = config.get("version_policy", "latest")
    latest = config.get("latest_versions", 1)
    if isinstance(policy, list):
        if not policy or not all(isinstance(v, int) and v >= 1 for v in policy):
            problems.append(f"{path}: version_policy: a list of version numbers (1, 2, ...)")
        return sorted(set(policy), reverse=True)
    if policy not in ("latest", "all"):
        problems.append(f"{path}: version_policy: \"latest\", \"all\" or a list of versions "
                        f"(got {policy!r})")  # fmt: skip
    if not isinstance(latest, int) or isinstance(latest, bool) or latest < 1:
        problems.append(f"{path}: latest_versions: a whole number from 1 (got {latest!r})")
        latest = 1
    return ("latest", latest) if policy == "latest" else policy


def _choose(found: list[int], policy: Any, path: Path, problems: list[str]) -> list[int]:
    if policy == "all":
        return found
    if isinstance(policy, tuple):
        return found[: policy[1]]
    if isinstance(policy, list):
        missing = [v for v in policy if v not in found]
        if missing:
            problems.append(f"{path}: version_policy names versions with no folder: {missing}")
        return [v for v in policy if v in found]
    return []


class ModelControlDisabledError(BadRequestError):
    code = "model_control_disabled"


def refuse_without_control(settings: Settings) -> None:
    """``ModelControlDisabledError`` unless ``MODEL_CONTROL=explicit``: loading and unloading
    through the repository API (over any transport) need it."""
    if settings.model_control != "explicit":
        raise ModelControlDisabledError(
            "model control is disabled (MODEL_CONTROL=none): the server loads every model "
            "at start; set MODEL_CONTROL=explicit to load and unload models"
        )
