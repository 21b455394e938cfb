"""Daemon configuration: pydantic models loaded from a TOML file plus environment overrides.

Sources, lowest to highest precedence:

1. the model defaults below;
2. the TOML file (``--config PATH``), whose tables mirror the models (``[udp]``, ``[control]``, ...);
3. environment variables ``PFEC_SENDER__<SECTION>__<KEY>`` / ``PFEC_RECEIVER__<SECTION>__<KEY>``
   (case-insensitive, ``__`` separates levels), e.g. ``PFEC_RECEIVER__UDP__PORT=7500`` or
   ``PFEC_SENDER__LOG_LEVEL=debug``. Values are strings that pydantic converts (``"7500"`` -> 7500,
   ``"true"`` -> True); an empty string sets an optional field to ``None``.

systemd integration: when ``security.psk_file`` is not set and ``$CREDENTIALS_DIRECTORY`` is, the key is
``$CREDENTIALS_DIRECTORY/psk`` (``LoadCredential=psk:/etc/pfec/psk``); likewise the control token
defaults to ``$CREDENTIALS_DIRECTORY/control-token`` and the model cache to ``$CACHE_DIRECTORY``.

Loading never opens the key or token files (the example configs validate anywhere); the daemon calls
``read_psk`` / ``read_token`` (``common/node/keys.py``) at start-up, which report exactly what is wrong
with the file.
Every error names the field, the bad value and the fix (``format_validation_error``).

The models themselves (one per TOML table) are :mod:`.config_models`'s; every name is importable from here.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, Literal, TypeVar, overload

from pydantic import BaseModel, ValidationError

from pfec.common.node.config_models import (
    ControlConfig,
    LimitsConfig,
    LinkConfig,
    MetricsConfig,
    ModelConfig,
    ProfilesConfig,
    ReceiverDaemonConfig,
    SecurityConfig,
    SenderDaemonConfig,
    SenderFecConfig,
    SenderLimitsConfig,
    UdpConfig,
    _DaemonConfig,
    parse_host_port,
)

__all__ = [
    "ENV_PREFIX",
    "ConfigError",
    "ControlConfig",
    "LimitsConfig",
    "LinkConfig",
    "MetricsConfig",
    "ModelConfig",
    "ProfilesConfig",
    "ReceiverDaemonConfig",
    "SecurityConfig",
    "SenderDaemonConfig",
    "SenderFecConfig",
    "SenderLimitsConfig",
    "UdpConfig",
    "format_validation_error",
    "load_config",
    "load_daemon_config",
    "parse_host_port",
]

Kind = Literal["sender", "receiver"]
ENV_PREFIX: Final[dict[str, str]] = {"sender": "PFEC_SENDER__", "receiver": "PFEC_RECEIVER__"}


class ConfigError(ValueError):
    """The configuration (file, environment or a referenced key/token file) is unusable.

    ``str(exc)`` is ready to print: one line per problem, each naming the field, the value and the fix.
    """


DaemonConfig = SenderDaemonConfig | ReceiverDaemonConfig
_MODELS: Final[dict[str, type[_DaemonConfig]]] = {
    "sender": SenderDaemonConfig,
    "receiver": ReceiverDaemonConfig,
}
_SECTION_DEFAULTS: Final[dict[str, dict[str, dict[str, Any]]]] = {
    # Per-kind defaults of shared sections, merged under the file/env values (a partial [udp] table in
    # the sender's file must not reset the port to the receiver's 7400).
    "sender": {"udp": {"port": 0}, "control": {"socket": "/run/pfec/sender.sock"}, "metrics": {"port": 9401}},
    "receiver": {
        "udp": {"port": 7400},
        "control": {"socket": "/run/pfec/receiver.sock"},
        "metrics": {"port": 9400},
    },
}


# --------------------------------------------------------------------------- loading


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def _env_overrides(prefix: str, env: Mapping[str, str]) -> tuple[dict[str, Any], dict[tuple[str, ...], str]]:
    tree: dict[str, Any] = {}
    sources: dict[tuple[str, ...], str] = {}
    for name, value in env.items():
        if not name.upper().startswith(prefix):
            continue
        parts = tuple(p.lower() for p in name[len(prefix) :].split("__"))
        if not all(parts):
            raise ConfigError(
                f"{name}: bad variable name — use {prefix}SECTION__KEY (e.g. {prefix}UDP__PORT)"
            )
        node = tree
        for p in parts[:-1]:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{name}: conflicts with another {prefix}{p.upper()} variable — remove one")
            node = child
        if isinstance(node.get(parts[-1]), dict):
            raise ConfigError(f"{name}: {'.'.join(parts)} is a section, not a value — set one of its keys")
        node[parts[-1]] = None if value == "" else value
        sources[parts] = name
    return tree, sources


def _systemd_defaults(data: dict[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    creds = env.get("CREDENTIALS_DIRECTORY")
    cache = env.get("CACHE_DIRECTORY")
    out = dict(data)
    if creds:
        sec = dict(out.get("security") or {})
        sec.setdefault("psk_file", str(Path(creds) / "psk"))
        out["security"] = sec
        ctl = out.get("control")
        if isinstance(ctl, dict) and ctl.get("tcp") and not ctl.get("token_file"):
            out["control"] = {**ctl, "token_file": str(Path(creds) / "control-token")}
    if cache:
        model = dict(out.get("model") or {})
        # systemd may list several directories separated by ':'; the first one is ours.
        model.setdefault("cache_dir", cache.split(":")[0])
        out["model"] = model
    return out


@overload
def load_config(kind: Literal["sender"], path: Path | None, env: Mapping[str, str]) -> SenderDaemonConfig: ...
@overload
def load_config(
    kind: Literal["receiver"], path: Path | None, env: Mapping[str, str]
) -> ReceiverDaemonConfig: ...
def load_config(kind: Kind, path: Path | None, env: Mapping[str, str]) -> DaemonConfig:
    """Defaults < TOML file ``path`` < ``PFEC_<KIND>__...`` variables of ``env`` -> a validated config.

    Raises ``ConfigError`` (print ``str(exc)``) for an unreadable file, bad TOML or invalid values.
    """
    if kind not in _MODELS:
        raise ConfigError(f"kind: bad value {kind!r} — use 'sender' or 'receiver'")
    return load_daemon_config(  # type: ignore[return-value]
        _MODELS[kind], kind, ENV_PREFIX[kind], _SECTION_DEFAULTS[kind], path, env)


C = TypeVar("C", bound=_DaemonConfig)


def load_daemon_config(model: type[C], kind: str, prefix: str, defaults: Mapping[str, Any], path: Path | None,
                       env: Mapping[str, str]) -> C:
    """``load_config`` for any daemon's model (the node's too, ``pfec.node``): ``defaults`` < the file <
    the ``prefix`` variables; errors say ``invalid <kind> configuration``."""
    file_data: dict[str, Any] = {}
    if path is not None:
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(
                f"config file {str(path)!r}: cannot read ({exc.strerror}) — check the path"
            ) from None
        try:
            file_data = tomllib.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise ConfigError(f"config file {str(path)!r}: not UTF-8 — save it as UTF-8 TOML") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {str(path)!r}: invalid TOML: {exc} — fix the syntax") from None
    env_data, sources = _env_overrides(prefix, env)
    data = _merge(_merge(dict(defaults), file_data), env_data)
    data = _systemd_defaults(data, env)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        where = f" in {path}" if path is not None else ""
        raise ConfigError(
            f"invalid {kind} configuration{where}:\n" + format_validation_error(exc, sources, model)
        ) from None


# --------------------------------------------------------------------------- error formatting


def _fix_for(err: Mapping[str, Any], loc: tuple[str, ...], model: type[BaseModel] | None) -> str:
    typ = err["type"]
    ctx = err.get("ctx") or {}
    if typ == "value_error":
        return str(err["msg"]).removeprefix("Value error, ")
    if typ == "extra_forbidden":
        valid = _valid_keys(model, loc[:-1])
        return (
            f"unknown setting; valid keys here: {', '.join(valid)}" if valid else "unknown setting; remove it"
        )
    if typ == "missing":
        return "required; set it in the file or the environment"
    bounds = {
        "greater_than": "must be > {gt}",
        "greater_than_equal": "must be >= {ge}",
        "less_than": "must be < {lt}",
        "less_than_equal": "must be <= {le}",
        "string_too_short": "must not be empty",
    }
    if typ in bounds:
        return bounds[typ].format(**ctx)
    if typ == "literal_error":
        return f"expected {ctx.get('expected', 'one of the listed values')}"
    kinds = {
        "int_parsing": "must be an integer",
        "int_type": "must be an integer",
        "int_from_float": "must be a whole number",
        "float_parsing": "must be a number",
        "float_type": "must be a number",
        "bool_parsing": "must be true or false",
        "bool_type": "must be true or false",
        "string_type": "must be a string",
        "path_type": "must be a path string",
        "model_type": "must be a table ([section])",
        "dict_type": "must be a table ([section])",
        "tuple_type": "must be a list",
        "list_type": "must be a list",
    }
    return kinds.get(typ, str(err["msg"]))


def _valid_keys(model: type[BaseModel] | None, loc: tuple[str, ...]) -> list[str]:
    node: Any = model
    for part in loc:
        if node is None or not (isinstance(node, type) and issubclass(node, BaseModel)):
            return []
        info = node.model_fields.get(part)
        node = info.annotation if info is not None else None
    if isinstance(node, type) and issubclass(node, BaseModel):
        return list(node.model_fields)
    return []


def format_validation_error(
    exc: ValidationError, sources: Mapping[tuple[str, ...], str] | None = None,
    model: type[BaseModel] | None = None,
) -> str:
    """One line per bad field: ``section.key: bad value 'x' — <fix>`` (``(from VAR)`` for env values);
    ``model`` (by default the daemon model the error's title names) lists the valid keys of a table."""
    if model is None:
        model = {m.__name__: m for m in _MODELS.values()}.get(exc.title)
    lines = []
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        field = ".".join(loc) or "(config)"
        fix = _fix_for(err, loc, model)
        src = (sources or {}).get(loc)
        origin = f" (from {src})" if src else ""
        if err["type"] == "missing" or isinstance(err.get("input"), dict):
            # Missing key, or a model-level validator whose message names the fields itself.
            lines.append(f"{field}: {fix}{origin}")
        else:
            value = err.get("input")
            shown = repr(str(value)) if isinstance(value, Path) else repr(value)
            lines.append(f"{field}: bad value {shown}{origin} — {fix}")
    return "\n".join(lines)
