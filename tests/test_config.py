"""Daemon configuration: defaults, TOML + environment precedence, error lines, key files."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import typer
from pydantic import ValidationError
from typer.testing import CliRunner

from pfec.common.node.config import (
    ConfigError,
    ReceiverDaemonConfig,
    SenderDaemonConfig,
    format_validation_error,
    load_config,
    parse_host_port,
)
from pfec.common.node.keys import generate_psk, keygen_cmd, psk_fingerprint, read_psk, read_token


def _toml(tmp_path: Path, text: str, name: str = "c.toml") -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def test_defaults_per_kind() -> None:
    s = load_config("sender", None, {})
    r = load_config("receiver", None, {})
    assert isinstance(s, SenderDaemonConfig) and isinstance(r, ReceiverDaemonConfig)
    assert (s.udp.host, s.udp.port) == ("0.0.0.0", 0)
    assert (r.udp.host, r.udp.port) == ("0.0.0.0", 7400)
    assert s.metrics.port == 9401 and r.metrics.port == 9400
    assert s.control.socket == Path("/run/pfec/sender.sock")
    assert r.control.socket == Path("/run/pfec/receiver.sock")
    assert s.control.tcp is None and s.control.tcp_address is None
    assert s.udp.rcvbuf_bytes == s.udp.sndbuf_bytes == 8 * 1024 * 1024
    assert s.security.psk_file == Path("/etc/pfec/psk")
    assert r.reconstruction == "mask" and r.limits.max_sessions == 64
    assert s.fec.scheme == "heuristic" and s.fec.window_cap == 0  # sized from the path
    assert s.model.path == "default" and s.model.device == "auto"
    # Direct construction agrees with the loader's per-kind defaults.
    assert SenderDaemonConfig() == s and ReceiverDaemonConfig() == r


def test_env_overrides_file(tmp_path: Path) -> None:
    p = _toml(
        tmp_path,
        """
        log_level = "debug"
        [udp]
        host = "127.0.0.1"
        [link]
        rate_mbps = 50
        [fec]
        window_cap = 32
        """,
    )
    cfg = load_config(
        "sender",
        p,
        {
            "PFEC_SENDER__LINK__RATE_MBPS": "25.5",
            "pfec_sender__log_level": "WARNING",  # names and levels are case-insensitive
            "PFEC_RECEIVER__UDP__PORT": "1",  # the other kind's variables are ignored
            "HOME": "/root",
        },
    )
    assert cfg.link.rate_mbps == 25.5
    assert cfg.log_level == "warning"
    assert cfg.fec.window_cap == 32
    # A partial [udp] table keeps the sender's ephemeral default port.
    assert (cfg.udp.host, cfg.udp.port) == ("127.0.0.1", 0)


def test_systemd_credentials_and_cache(tmp_path: Path) -> None:
    env = {
        "CREDENTIALS_DIRECTORY": "/run/credentials/pfec-receiver.service",
        "CACHE_DIRECTORY": "/var/cache/pfec",
    }
    cfg = load_config("receiver", None, env)
    assert cfg.security.psk_file == Path("/run/credentials/pfec-receiver.service/psk")
    assert cfg.model.cache_dir == Path("/var/cache/pfec")
    p = _toml(tmp_path, '[control]\ntcp = "[::1]:7480"\n[security]\npsk_file = "/etc/other"\n')
    cfg = load_config("receiver", p, env)
    assert cfg.security.psk_file == Path("/etc/other")  # explicit setting wins
    assert cfg.control.token_file == Path("/run/credentials/pfec-receiver.service/control-token")
    assert cfg.control.tcp_address == ("::1", 7480)


def test_error_lines_name_field_value_and_fix(tmp_path: Path) -> None:
    p = _toml(
        tmp_path,
        """
        log_level = "loud"
        [udp]
        port = 70000
        portt = 1
        [model]
        device = "tpu"
        """,
    )
    with pytest.raises(ConfigError) as ei:
        load_config("receiver", p, {"PFEC_RECEIVER__METRICS__PORT": "abc"})
    lines = str(ei.value).splitlines()
    assert lines[0] == f"invalid receiver configuration in {p}:"
    body = "\n".join(lines[1:])
    assert "log_level: bad value 'loud' — expected 'debug', 'info'" in body
    assert "udp.port: bad value 70000 — must be <= 65535" in body
    assert "udp.portt: bad value 1 — unknown setting; valid keys here: host, port, rcvbuf_bytes" in body
    assert "model.device: bad value 'tpu' — expected 'auto', 'cpu', 'cuda' or 'cuda:N'" in body
    assert "metrics.port: bad value 'abc' (from PFEC_RECEIVER__METRICS__PORT) — must be an integer" in body
    assert len(lines) == 1 + 5


def test_cross_field_and_scheme_errors() -> None:
    env = {"PFEC_SENDER__CONTROL__TCP": "0.0.0.0:7480", "PFEC_SENDER__FEC__SCHEME": "nope"}
    with pytest.raises(ConfigError) as ei:
        load_config("sender", None, env)
    msg = str(ei.value)
    assert "control.tcp = '0.0.0.0:7480' needs control.token_file" in msg
    assert (
        "fec.scheme: bad value 'nope' (from PFEC_SENDER__FEC__SCHEME) — unknown scheme; choose one of" in msg
    )
    assert "heuristic" in msg
    # Empty env value unsets an optional field; no control listener at all is refused.
    with pytest.raises(ConfigError, match=r"needs control.socket or control.tcp"):
        load_config("sender", None, {"PFEC_SENDER__CONTROL__SOCKET": ""})


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("[udp\nport=1", "invalid TOML"),
        ("[control]\nsocket = 'relative.sock'", "use an absolute path"),
        ("[control]\nsocket = '/" + "x" * 120 + "'", "at most 107 bytes"),
        ("[fec]\nrepair_budget = -0.1", "fec.repair_budget: bad value -0.1 — repair budget -0.1: a fraction"),
        ("[fec]\nrepair_budget = 'all'", "bad value 'all' — repair budget 'all': a fraction"),
        ("udp = 3", "udp: bad value 3 — must be a table"),
    ],
)
def test_more_bad_files(tmp_path: Path, text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=None) as ei:
        load_config("sender", _toml(tmp_path, text), {})
    assert fragment in str(ei.value)


def test_bad_env_names_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"PFEC_SENDER__UDP____PORT: bad variable name"):
        load_config("sender", None, {"PFEC_SENDER__UDP____PORT": "1"})
    with pytest.raises(ConfigError, match=r"cannot read .* check the path"):
        load_config("sender", tmp_path / "absent.toml", {})
    with pytest.raises(ConfigError, match=r"is a section, not a value"):
        load_config("sender", None, {"PFEC_SENDER__UDP__HOST": "::", "PFEC_SENDER__UDP": "x"})


def test_format_validation_error_directly() -> None:
    with pytest.raises(ValidationError) as ei:
        ReceiverDaemonConfig.model_validate({"limits": {"max_sessions": 0}, "bogus": 1})
    text = format_validation_error(ei.value)
    assert text.splitlines() == [
        "limits.max_sessions: bad value 0 — must be >= 1",
        "bogus: bad value 1 — unknown setting; valid keys here: "
        + ", ".join(ReceiverDaemonConfig.model_fields),
    ]


def test_profiles_and_limits_sections(tmp_path: Path) -> None:
    s = load_config("sender", None, {})
    r = load_config("receiver", None, {})
    repo_profiles = Path(__file__).resolve().parents[1] / "profiles"
    assert s.profiles.directory == r.profiles.directory == repo_profiles  # resolved from the package
    assert s.limits.max_context_tokens == r.limits.max_context_tokens == 8192
    assert s.limits.max_budget_ms == r.limits.max_budget_ms == 60_000
    assert r.limits.max_blob_bytes == 1 << 20 and s.limits.allow_destinations == ()
    env = {"PFEC_SENDER__LIMITS__ALLOW_DESTINATIONS": "239.1.0.0/16, ff15::/16",
           "PFEC_SENDER__PROFILES__DIRECTORY": str(tmp_path)}
    s = load_config("sender", None, env)
    assert s.limits.allow_destinations == ("239.1.0.0/16", "ff15::/16") and s.profiles.directory == tmp_path
    with pytest.raises(ConfigError) as info:
        load_config("sender", _toml(tmp_path, '[limits]\nallow_destinations = ["not-a-net"]\n'
                                              '[profiles]\ndirectory = "rel/dir"\n'), {})
    text = str(info.value)
    assert "limits.allow_destinations" in text and "not-a-net" in text and "CIDR" in text, text
    assert "profiles.directory" in text and "absolute" in text, text
    with pytest.raises(ConfigError, match=r"limits\.session_grace_s"):
        load_config("receiver", None, {"PFEC_RECEIVER__LIMITS__SESSION_GRACE_S": "-1"})


def test_host_port_parsing() -> None:
    assert parse_host_port("127.0.0.1:80") == ("127.0.0.1", 80)
    assert parse_host_port("[fe80::1]:9") == ("fe80::1", 9)
    assert parse_host_port("node-b.lan:7400") == ("node-b.lan", 7400)
    for bad in ("::1:80", "host", "h:0", "h:99999", ":80", "bad host:1"):
        with pytest.raises(ValueError, match="expected 'HOST:PORT'"):
            parse_host_port(bad)


def test_every_field_is_documented() -> None:
    def walk(model: type) -> list[str]:
        missing = []
        for name, info in model.model_fields.items():  # type: ignore[attr-defined]
            if not info.description:
                missing.append(f"{model.__name__}.{name}")
            ann = info.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                missing += walk(ann)
        return missing

    assert walk(SenderDaemonConfig) + walk(ReceiverDaemonConfig) == []


# --------------------------------------------------------------------------- key files


def test_generate_and_read_psk(tmp_path: Path) -> None:
    p = tmp_path / "psk"
    psk = generate_psk(p)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert p.read_bytes() == psk.key.hex().encode() + b"\n"
    back = read_psk(p)
    assert back.key == psk.key and back.encoding == "hex" and len(back.key) == 32
    assert psk.key.hex() not in repr(back) and psk_fingerprint(psk.key) in repr(back)
    with pytest.raises(ConfigError, match="already exists — pass --force"):
        generate_psk(p)
    assert read_psk(p).key == psk.key  # untouched by the refused call
    again = generate_psk(p, force=True)
    assert again.key != psk.key and read_psk(p).key == again.key
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert [f.name for f in tmp_path.iterdir()] == ["psk"]  # no temp files left behind


def test_read_psk_formats_and_errors(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.write_bytes(bytes(range(32)))
    raw.chmod(0o600)
    assert read_psk(raw).encoding == "raw" and read_psk(raw).key == bytes(range(32))
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x01" * 33)
    bad.chmod(0o600)
    with pytest.raises(ConfigError, match=r"bad value of 33 bytes — expected 32 raw bytes or 64 hex"):
        read_psk(bad)
    short_hex = tmp_path / "hex"
    short_hex.write_text("ab" * 31 + "\n")
    short_hex.chmod(0o600)
    with pytest.raises(ConfigError, match=r"63 bytes"):
        read_psk(short_hex)
    with pytest.raises(ConfigError, match=r"no such file — create it with `pfec keygen"):
        read_psk(tmp_path / "absent")
    raw.chmod(0o604)
    with pytest.raises(ConfigError, match=r"mode 0604 lets every user read it — chmod 600"):
        read_psk(raw)


def test_read_token(tmp_path: Path) -> None:
    t = tmp_path / "tok"
    t.write_text("0123456789abcdef0123\n")
    os.chmod(t, 0o400)
    assert read_token(t) == "0123456789abcdef0123"
    t.chmod(0o600)
    t.write_text("short\n")
    with pytest.raises(ConfigError, match=r"at least 16 printable"):
        read_token(t)


def test_keygen_cmd(tmp_path: Path) -> None:
    app = typer.Typer()
    app.command()(keygen_cmd)
    runner = CliRunner()
    p = tmp_path / "k"
    res = runner.invoke(app, [str(p)])
    assert res.exit_code == 0, res.output
    assert "fingerprint" in res.output and p.exists()
    res = runner.invoke(app, [str(p)])
    assert res.exit_code == 2 and "already exists" in res.output
    res = runner.invoke(app, [str(p), "--force"])
    assert res.exit_code == 0


def test_model_torch_threads_is_bounded_and_defaults_to_usable_cpus() -> None:
    """Issue 13: the torch thread count is a bounded field; unset means the node's usable CPUs."""
    assert load_config("sender", None, {}).model.torch_threads is None
    one = load_config("receiver", None, {"PFEC_RECEIVER__MODEL__TORCH_THREADS": "1"})
    assert one.model.torch_threads == 1
    for bad in ("0", "1000", "-2", "two"):
        with pytest.raises(ConfigError, match="torch_threads"):
            load_config("receiver", None, {"PFEC_RECEIVER__MODEL__TORCH_THREADS": bad})
