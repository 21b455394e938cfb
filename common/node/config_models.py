"""The daemon configuration's pydantic models: one per TOML table (``[udp]``, ``[control]``, ...) and the
sender's and receiver's whole configuration. Loading them (file, environment, systemd) and the error
messages are :mod:`.config`'s, which re-exports every name here.
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pfec.common.node.multicast import MAX_GROUPS, MAX_TTL, check_groups
from pfec.common.plan.deadline import (
    AUTO_WINDOW,
    DEFAULT_RATE_MBPS,
    DEFAULT_REPAIR_BUDGET,
    MAX_WINDOW_CAP,
    WHOLE_DEADLINE,
    repair_fraction,
)
from pfec.common.plan.utility import DEFAULT_PROFILE_DIR, MAX_PROFILE_BYTES
from pfec.common.sched.open_loop_tail import DEFAULT_LOSS_PRIOR, MAX_LOSS
from pfec.common.sched.policies import SCHEMES

__all__ = [
    "MIB",
    "ControlConfig",
    "LimitsConfig",
    "LinkConfig",
    "LogLevel",
    "MetricsConfig",
    "ModelConfig",
    "Port",
    "ProfilesConfig",
    "ReceiverDaemonConfig",
    "SecurityConfig",
    "SenderDaemonConfig",
    "SenderFecConfig",
    "SenderLimitsConfig",
    "UdpConfig",
    "parse_host_port",
]

MIB: Final = 1 << 20
_HOSTNAME = re.compile(
    r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
)


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
    multicast_group: list[str] = Field(
        default_factory=list, max_length=MAX_GROUPS,
        description="Multicast fan-out's group destinations, IP:PORT (common/node/multicast.py). A receiver "
        "joins each IPv4 multicast group; a sender streams a multicast fan-out only to these (the first is "
        "its default). A unicast IP:PORT stands for a relay that replicates.",
    )
    multicast_interface: str | None = Field(
        default=None, description="IPv4 address of the interface the groups are joined on and sent through "
        "(default: the kernel's choice).")
    multicast_ttl: int = Field(default=1, ge=1, le=MAX_TTL, description="Hops a group datagram may cross.")

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        return _check_host(v)

    @field_validator("multicast_group")
    @classmethod
    def _groups(cls, v: list[str]) -> list[str]:
        return check_groups(v)

    @field_validator("multicast_interface")
    @classmethod
    def _interface(cls, v: str | None) -> str | None:
        if v is not None and not isinstance(ipaddress.ip_address(v), ipaddress.IPv4Address):
            raise ValueError("expected an IPv4 address")
        return v


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
    torch_threads: int | None = Field(
        default=None,
        ge=1,
        le=256,
        description="Torch threads for prefill and (de)quantisation, set once at start-up (default: the CPUs "
        "the node may use, from its affinity mask). Set explicitly: under load 2 threads ran far slower "
        "than 1.",
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
    rate_control: Literal["fixed", "path"] = Field(
        default="path",
        description="path (default): measure the path (sender/transport/path_rate/): rate_mbps is the "
        "estimate the first handoff to a receiver starts from, later ones start from what the previous "
        "measured; one controller per receiver, shared by concurrent handoffs. fixed: pace every handoff at "
        "rate_mbps (the paper's open loop).",
    )
    max_rate_mbps: float | None = Field(
        default=None, gt=0, le=400_000,
        description="With rate_control = path: the most the controller may pace at, Mbit/s (none: no cap).",
    )


class SenderFecConfig(_Section):
    scheme: str = Field(default="heuristic", description="Default scheme (`pfec sim --help` lists them).")
    window_cap: int = Field(
        default=AUTO_WINDOW, ge=AUTO_WINDOW, le=MAX_WINDOW_CAP,
        description="Coding window cap K, symbols (RFC 8681 NSS). 0 (default): sized per handoff from the "
        "path at OFFER time, a quarter of the bandwidth-delay product (rate and owd_ms) rounded up to a "
        "power of two within 64..512 (at 100 Mbit/s: 64 below about 25 ms RTT, 128 to 50 ms, 256 to "
        "100 ms, 512 beyond). "
        "1..4095: that cap for every handoff.",
    )
    repair_budget: float | str = Field(
        default=WHOLE_DEADLINE,
        description=f'Repair budget B_rep. "{WHOLE_DEADLINE}" (default): repair while the receiver lacks '
        "symbols and a repair can still arrive before the deadline (the link time left is the budget). A "
        "number: a cap, as a fraction of the source symbols (the paper's fixed budget is "
        f"{DEFAULT_REPAIR_BUDGET}).",
    )

    @field_validator("repair_budget")
    @classmethod
    def _repair_budget(cls, v: float | str) -> float | str:
        fraction = repair_fraction(v)  # ValueError names the fix
        return WHOLE_DEADLINE if fraction is None else fraction
    loss_prior: float = Field(
        default=DEFAULT_LOSS_PRIOR, ge=0, le=MAX_LOSS,
        description="Datagram loss rate assumed for a receiver no handoff has measured yet: what the "
        "repair of the sources no feedback can save in time plans for before the ACKs measure the loss "
        "(default 0.05, mid-range for lossy edge links; too high costs a few of the least useful sources, "
        "too low loses whole blocks). Past handoffs to a receiver replace it with what they measured.",
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


class CommonLimits(_Section):
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
    serving_queue: int = Field(
        default=4, ge=1, le=1024,
        description="OpenAI API requests (/v1/...) waiting or running on the model worker before new ones "
        "get 503 with Retry-After (generation runs one request at a time).",
    )
    max_completion_tokens: int = Field(
        default=512, ge=1, le=1 << 16,
        description="Longest completion of one OpenAI API request, tokens. A larger max_tokens (or "
        "max_completion_tokens) is a 400; a request that leaves it out gets the rest of the model's context, "
        "up to this. It bounds how long a request holds the model worker: the default model decodes 512 "
        "tokens in about 45 s on 2 CPU cores.",
    )
    force_include_usage: bool = Field(
        default=False,
        description="Every streamed OpenAI API response ends with the usage chunk (cached_tokens included), "
        "as if the request set stream_options.include_usage (vLLM's --enable-force-include-usage). Agent "
        "frameworks ask for it only from OpenAI's own URL.",
    )
    tool_call_parser: Literal["hermes"] = Field(
        default="hermes",
        description="How an OpenAI API reply's tool calls are parsed: hermes (vLLM's --tool-call-parser "
        "hermes), <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> blocks. The only one today.",
    )
    prefix_cache_bytes: int = Field(
        default=512 * MIB, ge=0, le=1 << 40,
        description="Byte budget of the prefix cache store (handed-off contexts and each turn's cache, "
        "reused by requests that start with them); 0 keeps nothing. On a GPU it is device memory: start-up "
        "fails when it exceeds the GPU's free memory once the model is loaded.",
    )
    prefix_cache_entries: int = Field(
        default=32, ge=0, le=65536, description="Most entries the prefix cache store holds (LRU beyond)."
    )
    prefix_cache_ttl_s: float = Field(
        default=900.0, gt=0, le=7 * 86_400,
        description="A prefix cache entry unused for this long is dropped.",
    )


class SenderLimitsConfig(CommonLimits):
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


class LimitsConfig(CommonLimits):
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
