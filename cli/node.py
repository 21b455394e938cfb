"""The node commands: `pfec sender serve`, `pfec receiver serve`, `pfec node serve` (the daemons; a node has
both roles) and `pfec keygen`."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from pfec.cli.shared import fail
from pfec.common.node.config import ConfigError, ReceiverDaemonConfig, SenderDaemonConfig, load_config
from pfec.common.node.eventloop import run_event_loop
from pfec.common.node.keys import keygen_cmd, read_psk, read_token
from pfec.node.config import load_node_config

__all__ = ["keygen_cmd", "node_serve_cmd", "receiver_serve_cmd", "sender_serve_cmd"]

ConfigOpt = Annotated[Path | None, typer.Option("--config", help="TOML config file (deploy/*.example.toml).")]
ConfigT = TypeVar("ConfigT", bound=SenderDaemonConfig | ReceiverDaemonConfig)  # a node's is both
Serve = Callable[[ConfigT, bytes, str | None], Coroutine[Any, Any, None]]


def sender_serve_cmd(config: ConfigOpt = None) -> None:
    """Run the sender daemon until SIGTERM."""
    from pfec.sender.serve import serve  # deferred: aiohttp + numba (keeps `pfec --help` fast)

    _serve(lambda: load_config("sender", config, os.environ), serve)


def receiver_serve_cmd(config: ConfigOpt = None) -> None:
    """Run the receiver daemon until SIGTERM."""
    from pfec.receiver.serve import serve  # deferred: aiohttp + numba (keeps `pfec --help` fast)

    _serve(lambda: load_config("receiver", config, os.environ), serve)


def node_serve_cmd(config: ConfigOpt = None) -> None:
    """Run a node with both roles (one model, prefix store and control API) until SIGTERM."""
    from pfec.node.serve import serve  # deferred: aiohttp + numba (keeps `pfec --help` fast)

    _serve(lambda: load_node_config(config, os.environ), serve)


def _serve(load: Callable[[], ConfigT], serve: Serve[ConfigT]) -> None:
    """Load the config, the key and the token (a problem prints the bad value and exits 2), then run the
    daemon on uvloop until it stops."""
    try:
        config = load()
        psk = read_psk(config.security.psk_file).key
        token_file = config.control.token_file  # set whenever control.tcp is (the config checks it)
        token = read_token(token_file) if config.control.tcp is not None and token_file else None
    except ConfigError as exc:
        raise fail(str(exc)) from None
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        run_event_loop(serve(config, psk, token))
    except (OSError, ValueError) as exc:
        raise fail(str(exc)) from None
