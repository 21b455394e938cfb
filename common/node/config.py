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
"""

from __future__ import annotations

import ipaddress
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Final, Literal, overload

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pfec.common.plan.deadline import DEFAULT_RATE_MBPS, DEFAULT_REPAIR_BUDGET
from pfec.common.plan.utility import DEFAULT_PROFILE_DIR, MAX_PROFILE_BYTES
from pfec.common.sched.policies import SCHEMES

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
    "parse_host_port",
]

Kind = Literal["sender", "receiver"]
ENV_PREFIX: Final[dict[str, str]] = {"sender": "PFEC_SENDER__", "receiver": "PFEC_RECEIVER__"}
MIB: Final = 1 << 20
_HOSTNAME = re.compile(
    r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
)


class ConfigError(ValueError):
    """The configuration (file, environment or a referenced key/token file) is unusable.

    ``str(exc)`` is ready to print: one line per problem, each naming the field, the value and the fix.
    """


# --------------------------------------------------------------------------- helpers


def _check_host(host: str) -> str:
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    if _HOSTNAME.fullmatch(host):
        return host
    raise ValueError("expected an IP address (e.g. 0.0.0.0, ::) or a host name")


def parse_host_port(text: str, *, allow_port_zero: bool = False) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> (host, port); ValueError says what form is expected.

    ``allow_port_zero``: for listeners, where port 0 asks the kernel for a free port.
    """
    low = 0 if allow_port_zero else 1
    form = f"expected 'HOST:PORT' (e.g. 127.0.0.1:7480 or [::1]:7480) with PORT in {low}..65535"
    text = text.strip()
    if text.startswith("["):
        host, sep, port_s = text[1:].partition("]:")
    else:
        host, sep, port_s = text.rpartition(":")
        if ":" in host:
            raise ValueError(f"{form}; put IPv6 addresses in brackets")
    if not sep or not host:
        raise ValueError(form)
    try:
        port = int(port_s)
    except ValueError:
        raise ValueError(form) from None
    if not low <= port <= 65535:
        raise ValueError(form)
    try:
        return _check_host(host), port
    except ValueError as exc:
        raise ValueError(f"{form}; {exc}") from None


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True, frozen=True)


Port = Annotated[int, Field(ge=0, le=65535)]


# --------------------------------------------------------------------------- sections


class UdpConfig(_Section):
    host: str = Field(default="0.0.0.0", description="Address the data socket binds to ('::' for IPv6).")
    port: Port = Field(default=7400, description="UDP port of the data socket; 0 picks an ephemeral port.")
    rcvbuf_bytes: int = Field(
        default=8 * MIB,
        ge=64 * 1024,
        le=1 << 30,
        description="SO_RCVBUF request (the kernel caps it at net.core.rmem_max unless run as root, which "
        "uses SO_RCVBUFFORCE). The 208 KiB default lost half of a 100 Mbit/s burst.",
    )
    sndbuf_bytes: int = Field(
        default=8 * MIB,
        ge=64 * 1024,
        le=1 << 30,
        description="SO_SNDBUF request (capped by net.core.wmem_max).",
    )

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        return _check_host(v)


class ControlConfig(_Section):
    socket: Path | None = Field(
        default=None,
        description="UNIX socket of the control API (default /run/pfec/<kind>.sock; the directory is "
        "systemd's RuntimeDirectory=pfec). Set to '' to disable the UNIX socket.",
    )
    tcp: str | None = Field(
        default=None,
        description="Optional TCP listener 'HOST:PORT' for the control API; requires a bearer token "
        "(token_file). Unset: UNIX socket only.",
    )
    token_file: Path | None = Field(
        default=None,
        description="File holding the bearer token for the TCP control API (default "
        "$CREDENTIALS_DIRECTORY/control-token when run by systemd).",
    )

    @field_validator("socket", "token_file", mode="before")
    @classmethod
    def _empty_is_none(cls, v: Any) -> Any:
        return None if isinstance(v, str) and not v.strip() else v

    @field_validator("socket")
    @classmethod
    def _socket(cls, v: Path | None) -> Path | None:
        if v is not None and not v.is_absolute():
            raise ValueError("use an absolute path such as /run/pfec/sender.sock")
        # sockaddr_un.sun_path is 108 bytes including the NUL.
        if v is not None and len(os.fsencode(v)) > 107:
            raise ValueError("UNIX socket paths must be at most 107 bytes; choose a shorter path")
        return v

    @field_validator("tcp")
    @classmethod
    def _tcp(cls, v: str | None) -> str | None:
        if v is None:
            return None
        parse_host_port(v)
        return v.strip()

    @model_validator(mode="after")
    def _tcp_needs_token(self) -> ControlConfig:
        if self.tcp is not None and self.token_file is None:
            raise ValueError(
                f"control.tcp = {self.tcp!r} needs control.token_file (a file with the bearer token), "
                "or run under systemd with LoadCredential=control-token:PATH"
            )
        if self.socket is None and self.tcp is None:
            raise ValueError("the control API needs control.socket or control.tcp; set at least one")
        return self

    @property
    def tcp_address(self) -> tuple[str, int] | None:
        return None if self.tcp is None else parse_host_port(self.tcp)


class MetricsConfig(_Section):
    enabled: bool = Field(default=True, description="Serve Prometheus metrics over HTTP at /metrics.")
    host: str = Field(default="0.0.0.0", description="Address of the metrics HTTP listener.")
    port: Port = Field(
        default=9400, description="Port of the metrics HTTP listener (9400 receiver, 9401 sender)."
    )

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        return _check_host(v)


class SecurityConfig(_Section):
    psk_file: Path = Field(
        default=Path("/etc/pfec/psk"),
        description="Pre-shared key of the node pair: 32 raw bytes or 64 hex characters (`pfec keygen`). "
        "Default $CREDENTIALS_DIRECTORY/psk under systemd, else /etc/pfec/psk.",
    )


class ModelConfig(_Section):
    path: str = Field(
        default="default",
        min_length=1,
        description="Hugging Face causal LM directory, or 'default' for the embedded SmolLM2-135M.",
    )
    device: str = Field(
        default="auto", description="'auto' (CUDA when available), 'cpu', 'cuda' or 'cuda:N'."
    )
    cache_dir: Path | None = Field(
        default=None,
        description="Where the converted safetensors model cache lives (default $CACHE_DIRECTORY under "
        "systemd, else the user cache).",
    )

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        v = v.strip().lower()
        if v in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d{1,2}", v):
            return v
        raise ValueError("expected 'auto', 'cpu', 'cuda' or 'cuda:N'")


class LinkConfig(_Section):
    rate_mbps: float = Field(
        default=DEFAULT_RATE_MBPS, gt=0, le=400_000,
        description="Bottleneck rate the sender paces at, Mbit/s.",
    )
    owd_ms: float = Field(
        default=10.0,
        ge=0,
        le=10_000,
        description="Expected one-way delay, ms (budgets the OFFER's deadline).",
    )


class SenderFecConfig(_Section):
    scheme: str = Field(default="heuristic", description="Default scheme (`pfec sim --help` lists them).")
    window_cap: int = Field(
        default=64, ge=1, le=4095, description="Coding window cap K, symbols (RFC 8681 NSS)."
    )
    repair_budget: float = Field(
        default=DEFAULT_REPAIR_BUDGET, ge=0, le=10,
        description="Repair budget B_rep as a fraction of the source symbols.",
    )

    @field_validator("scheme")
    @classmethod
    def _scheme(cls, v: str) -> str:
        if v not in SCHEMES:
            raise ValueError(f"unknown scheme; choose one of {', '.join(SCHEMES)}")
        return v


class ProfilesConfig(_Section):
    directory: Path = Field(
        default=DEFAULT_PROFILE_DIR,
        description="Directory of the utility profiles this node knows, by name: a handoff names a profile "
        "('shipped', 'synthetic' or NAME for DIRECTORY/NAME.json), never a path. Default: the repo's "
        "profiles/ folder.",
    )
    max_bytes: int = Field(
        default=MAX_PROFILE_BYTES, ge=1024, le=64 * MIB,
        description="Largest profile file read, bytes (only regular files are read).",
    )

    @field_validator("directory")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        if not v.is_absolute():
            raise ValueError("use an absolute path such as /opt/pfec/profiles")
        return v


class _CommonLimits(_Section):
    max_context_tokens: int = Field(
        default=8192, ge=16, le=1 << 20,
        description="Largest context (tokens) a handoff may carry, whatever the model allows (both sides "
        "check it before allocating anything).",
    )
    max_budget_ms: float = Field(
        default=60_000.0, gt=0, le=3_600_000,
        description="Longest deadline (time budget) of one handoff, ms.",
    )
    worker_queue: int = Field(
        default=8, ge=1, le=1024,
        description="Model jobs (prefill, rebuild, generation) waiting for the worker thread before new "
        "ones are refused (503 on the sender's control API).",
    )
    worker_stuck_s: float = Field(
        default=300.0, gt=0, le=86_400,
        description="A model job running longer than this turns /readyz red (/healthz stays liveness).",
    )


class SenderLimitsConfig(_CommonLimits):
    max_request_bytes: int = Field(
        default=MIB, ge=1024, le=64 * MIB, description="Largest control API request body, bytes (413 above)."
    )
    max_json_depth: int = Field(
        default=32, ge=2, le=256, description="Deepest JSON nesting a control request may use (400 above)."
    )
    allow_destinations: tuple[str, ...] = Field(
        default=(),
        description="Networks (CIDR) the sender may stream to although they are multicast, broadcast, "
        "unspecified or link-local (refused by default), e.g. ['239.1.0.0/16'].",
    )

    @field_validator("allow_destinations", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:  # an environment variable: comma-separated networks
        return tuple(n.strip() for n in v.split(",") if n.strip()) if isinstance(v, str) else v

    @field_validator("allow_destinations")
    @classmethod
    def _networks(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for net in v:
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError:
                raise ValueError(f"{net!r} is not a network; use CIDR such as 239.1.0.0/16") from None
        return v


class LimitsConfig(_CommonLimits):
    max_sessions: int = Field(
        default=64, ge=1, le=65536, description="Concurrent handoffs before OFFERs are refused."
    )
    max_session_bytes: int = Field(
        default=1 << 30,
        ge=MIB,
        le=1 << 40,
        description="Largest allocation one session may make, bytes: its KV payload (symbols x symbol "
        "size) plus its decoder (span x span coefficients and span payload rows).",
    )
    session_grace_s: float = Field(
        default=30.0, ge=0, le=3600,
        description="Every session is reaped at its deadline plus this grace, whatever the sender does: "
        "one still without a RESULT (rebuild or generation not done) gets an error RESULT. Default: how long "
        "the sender waits for a generated answer.",
    )
    max_blob_bytes: int = Field(
        default=MIB, ge=4096, le=64 * MIB,
        description="Largest OFFER application blob (and decompressed data) accepted from a sender, bytes.",
    )


LogLevel = Literal["debug", "info", "warning", "error", "critical"]


class _DaemonConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True, frozen=True)

    log_level: LogLevel = Field(default="info", description="Python logging level.")
    udp: UdpConfig
    control: ControlConfig
    metrics: MetricsConfig
    security: SecurityConfig = Field(default_factory=lambda: SecurityConfig(), description="Key material.")
    model: ModelConfig = Field(default_factory=lambda: ModelConfig(), description="The LLM both nodes share.")
    profiles: ProfilesConfig = Field(
        default_factory=lambda: ProfilesConfig(), description="Utility profiles, by name."
    )

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, v: Any) -> Any:
        return v.strip().lower() if isinstance(v, str) else v


class SenderDaemonConfig(_DaemonConfig):
    """`pfec sender serve`: prefills, streams KV blocks, answers the control API."""

    udp: UdpConfig = Field(
        default_factory=lambda: UdpConfig(port=0), description="Data socket (ephemeral port by default)."
    )
    control: ControlConfig = Field(
        default_factory=lambda: ControlConfig(socket=Path("/run/pfec/sender.sock")),
        description="Control API.",
    )
    metrics: MetricsConfig = Field(
        default_factory=lambda: MetricsConfig(port=9401), description="Prometheus endpoint."
    )
    link: LinkConfig = Field(default_factory=lambda: LinkConfig(), description="Pacing.")
    fec: SenderFecConfig = Field(
        default_factory=lambda: SenderFecConfig(), description="Scheme and repair defaults."
    )
    limits: SenderLimitsConfig = Field(
        default_factory=lambda: SenderLimitsConfig(), description="Request bounds and destinations."
    )


class ReceiverDaemonConfig(_DaemonConfig):
    """`pfec receiver serve`: decodes, rebuilds the KV cache at the deadline, generates."""

    udp: UdpConfig = Field(
        default_factory=lambda: UdpConfig(), description="Data socket (0.0.0.0:7400 by default)."
    )
    control: ControlConfig = Field(
        default_factory=lambda: ControlConfig(socket=Path("/run/pfec/receiver.sock")),
        description="Control API.",
    )
    metrics: MetricsConfig = Field(
        default_factory=lambda: MetricsConfig(), description="Prometheus endpoint."
    )
    reconstruction: Literal["mask", "zero"] = Field(
        default="mask",
        description="Default partial-KV rebuild: 'mask' lost rows out of attention, or 'zero'-fill.",
    )
    limits: LimitsConfig = Field(default_factory=lambda: LimitsConfig(), description="Admission limits.")


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


def _env_overrides(kind: str, env: Mapping[str, str]) -> tuple[dict[str, Any], dict[tuple[str, ...], str]]:
    prefix = ENV_PREFIX[kind]
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
    env_data, sources = _env_overrides(kind, env)
    data = _merge(_merge(_SECTION_DEFAULTS[kind], file_data), env_data)
    data = _systemd_defaults(data, env)
    try:
        return _MODELS[kind].model_validate(data)  # type: ignore[return-value]
    except ValidationError as exc:
        where = f" in {path}" if path is not None else ""
        raise ConfigError(
            f"invalid {kind} configuration{where}:\n" + format_validation_error(exc, sources)
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
    exc: ValidationError, sources: Mapping[tuple[str, ...], str] | None = None
) -> str:
    """One line per bad field: ``section.key: bad value 'x' — <fix>`` (``(from VAR)`` for env values)."""
    model = _MODELS.get("sender" if exc.title == SenderDaemonConfig.__name__ else "receiver")
    if exc.title not in (SenderDaemonConfig.__name__, ReceiverDaemonConfig.__name__):
        model = None
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
