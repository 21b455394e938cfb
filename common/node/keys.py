"""Key and token files of a node: the pair's pre-shared key (read, check, generate) and the control API's
bearer token.

Both files must be private (no access for other users) and hold exactly what is expected; every error
names the setting, the file, what is wrong and the fix (a ``ConfigError`` ready to print). Key material is
never printed: ``Psk`` shows a short fingerprint to compare on both nodes.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Final, Literal

import typer

from pfec.common.node.config import ConfigError

__all__ = [
    "PSK_BYTES",
    "Psk",
    "generate_psk",
    "keygen_cmd",
    "psk_fingerprint",
    "read_psk",
    "read_token",
]

PSK_BYTES: Final = 32
_HEX64 = re.compile(r"[0-9a-fA-F]{64}")

@dataclass(frozen=True, slots=True)
class Psk:
    key: bytes
    encoding: Literal["raw", "hex"]  # how the file stored it
    path: Path

    def __repr__(self) -> str:  # never print key material
        fp = psk_fingerprint(self.key)
        return f"Psk(encoding={self.encoding!r}, path={str(self.path)!r}, fingerprint={fp})"


def psk_fingerprint(key: bytes) -> str:
    """Short SHA-256 fingerprint to compare the key on both nodes without revealing it."""
    return hashlib.sha256(b"pfec-psk-fingerprint\x00" + key).hexdigest()[:16]


def _check_private(path: Path, what: str) -> os.stat_result:
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ConfigError(
            f"{what} {str(path)!r}: no such file — create it with `pfec keygen {path}` (copy it to the peer)"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{what} {str(path)!r}: cannot stat ({exc.strerror}) — check permissions") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{what} {str(path)!r}: not a regular file — point it at the key file itself")
    if st.st_mode & 0o007:
        raise ConfigError(
            f"{what} {str(path)!r}: mode {stat.S_IMODE(st.st_mode):04o} lets every user read it — "
            f"chmod 600 {path}"
        )
    return st


def read_psk(path: Path) -> Psk:
    """Read and check the pre-shared key: exactly 32 raw bytes, or 64 hex characters (+ optional newline)."""
    path = Path(path)
    _check_private(path, "security.psk_file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"security.psk_file {str(path)!r}: cannot read ({exc.strerror}) — check permissions"
        ) from None
    text = data.strip(b" \t\r\n")
    if len(text) == 64 and _HEX64.fullmatch(text.decode("ascii", "replace")):
        return Psk(bytes.fromhex(text.decode("ascii")), "hex", path)
    if len(data) == PSK_BYTES:
        return Psk(data, "raw", path)
    raise ConfigError(
        f"security.psk_file {str(path)!r}: bad value of {len(data)} bytes — expected 32 raw bytes or 64 hex "
        f"characters; generate one with `pfec keygen {path}`"
    )


def read_token(path: Path) -> str:
    """Bearer token for the TCP control API: one line of at least 16 printable ASCII characters."""
    path = Path(path)
    _check_private(path, "control.token_file")
    try:
        token = path.read_text("ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"control.token_file {str(path)!r}: cannot read as ASCII ({exc}) — write one line, e.g. "
            "`openssl rand -hex 32`"
        ) from None
    if len(token) < 16 or not token.isprintable() or any(c.isspace() for c in token):
        raise ConfigError(
            f"control.token_file {str(path)!r}: bad value ({len(token)} characters) — expected one token of "
            "at least 16 printable characters without spaces, e.g. `openssl rand -hex 32`"
        )
    return token


def generate_psk(path: Path, force: bool = False) -> Psk:
    """Write a fresh key as 64 hex characters + newline, mode 0600; refuse to overwrite unless ``force``."""
    path = Path(path)
    if path.exists() and not force:
        raise ConfigError(
            f"{str(path)!r} already exists — pass --force to replace it (the peer needs the new key)"
        )
    if path.is_dir():
        raise ConfigError(f"{str(path)!r} is a directory — give a file path such as /etc/pfec/psk")
    key = secrets.token_bytes(PSK_BYTES)
    parent = path.parent if str(path.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".pfec-psk-", dir=parent)  # created 0600
    except OSError as exc:
        raise ConfigError(
            f"cannot create a file in {str(parent)!r} ({exc.strerror}) — create the directory"
        ) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(key.hex().encode("ascii") + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        if force:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # atomic create-if-absent: fails if someone created it meanwhile
            os.unlink(tmp)
    except FileExistsError:
        os.unlink(tmp)
        raise ConfigError(f"{str(path)!r} already exists — pass --force to replace it") from None
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return Psk(key, "hex", path)


def keygen_cmd(
    path: Annotated[Path, typer.Argument(help="Key file to write, e.g. /etc/pfec/psk.")] = Path(
        "/etc/pfec/psk"
    ),
    force: Annotated[bool, typer.Option("--force", help="Replace an existing key file.")] = False,
) -> None:
    """Generate the node pair's pre-shared key (64 hex characters, mode 0600); copy it to the peer."""
    try:
        psk = generate_psk(path, force=force)
    except ConfigError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {psk.path} (mode 0600), fingerprint {psk_fingerprint(psk.key)}")
    typer.echo("copy it to the peer node over a secure channel, e.g. scp -p, and compare fingerprints")
