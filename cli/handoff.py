"""`pfec handoff`: ask a running sender daemon (control API) for a handoff, follow it and print the report."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from pfec.cli.shared import fail
from pfec.common.node.config import ConfigError
from pfec.common.node.keys import read_token
from pfec.lab.reporting.text import format_handoff_report

if TYPE_CHECKING:
    from pfec.common.node.control import ControlClient

__all__ = ["handoff_cmd"]

DEFAULT_SOCKET = Path("/run/pfec/sender.sock")


def handoff_cmd(
    receiver: Annotated[list[str], typer.Option(
        help="Receiver data address HOST:PORT. Give it up to 8 times for a fan-out: one preparation, "
        "one stream per --fanout.")],
    question: Annotated[str | None, typer.Option(help="The question the receiver answers.")] = None,
    context: Annotated[str | None, typer.Option(help="Context text.")] = None,
    context_file: Annotated[Path | None, typer.Option(help="Read the context from this file.")] = None,
    deadline_ms: Annotated[float | None, typer.Option(help="Deadline D in ms.")] = None,
    rho: Annotated[float | None, typer.Option(help="Deadline as (D - T_ow) / T_ser (default 0.8).")] = None,
    scheme: Annotated[str | None, typer.Option(help="Scheme (default: the sender's).")] = None,
    reconstruction: Annotated[str, typer.Option(help="mask | zero")] = "mask",
    rate_mbps: Annotated[float | None, typer.Option(help="Link rate override, Mbit/s.")] = None,
    full_kv_answer: Annotated[bool, typer.Option(help="Also answer from the sender's intact cache.")] = False,
    synthetic_tokens: Annotated[
        int | None, typer.Option(help="Transport test: random KV of this many tokens (no context).")
    ] = None,
    socket_path: Annotated[Path, typer.Option("--socket", help="Sender control socket.")] = DEFAULT_SOCKET,
    url: Annotated[
        str | None, typer.Option(help="TCP control API http://HOST:PORT (instead of --socket).")
    ] = None,
    token_file: Annotated[Path | None, typer.Option(help="Bearer token file for --url.")] = None,
    precision: Annotated[str, typer.Option(
        help="KV precision: auto (the break-even planner's mix; native for synthetic KV) | native | int8 | "
        "int8-int4 | int4 | int2.")] = "auto",
    mode: Annotated[str, typer.Option(
        help="auto (the faster of handoff and local prefill as the break-even planner predicts them; handoff "
        "for synthetic KV) | handoff (the whole cache "
        "streams) | split (the receiver prefills the front while the back streams) | local (the receiver "
        "prefills everything, no KV sent).")] = "auto",
    conversation: Annotated[str | None, typer.Option(
        help="Hand over a conversation the sender served through its OpenAI API (the completion id it "
        "returned) instead of a context and a question; the receiver continues it through its API.")] = None,
    cache_salt: Annotated[str | None, typer.Option(
        help="The cache salt the receiver keeps the context's cache under for later OpenAI API requests "
        "(default: the shared namespace).")] = None,
    fanout: Annotated[str | None, typer.Option(
        help="How a fan-out (several --receiver) is carried: unicast (a session per receiver on one "
        "uplink clock, the default) | multicast (one coded stream to a group, sealed once).")] = None,
    group: Annotated[str | None, typer.Option(
        help="Multicast fan-out: the group destination IP:PORT (a multicast group, or a relay that "
        "replicates), one the sender allows (its udp.multicast_group; default: the first).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object.")] = False,
) -> None:
    """Ask the sender daemon for a handoff, wait for it and print the report."""
    from pfec.common.node.control import ControlClient  # deferred: aiohttp (keeps `pfec --help` fast)

    if context_file is not None:
        try:
            context = context_file.read_text()
        except OSError as exc:
            raise fail(f"--context-file {str(context_file)!r}: {exc.strerror}") from None
    if not receiver:
        raise fail("give --receiver HOST:PORT (up to 8 times for a fan-out)")
    if (fanout is not None or group is not None) and len(receiver) == 1:
        raise fail("--fanout and --group are for a fan-out: give --receiver more than once")
    if group is not None and fanout == "unicast":
        raise fail("--group names a multicast group: it goes with --fanout multicast")
    if fanout is not None and fanout not in ("unicast", "multicast"):
        raise fail(f"--fanout: {fanout!r} is not unicast or multicast")
    body: dict[str, Any] = {"reconstruction": reconstruction, "full_kv_answer": full_kv_answer,
                            "precision": precision, "handoff_mode": mode}
    if len(receiver) == 1:
        body["receiver"] = receiver[0]
    else:  # a fan-out (sender/fanout.py): the daemon checks each address, duplicates and the bound
        body["receivers"] = list(receiver)
        if fanout is not None:
            body["fanout"] = fanout
        if group is not None:  # a group implies a multicast fan-out
            body.update(fanout="multicast", group=group)
    if conversation is not None:
        if context is not None or question is not None or synthetic_tokens is not None or full_kv_answer:
            raise fail("--conversation hands over a conversation: no --context, --question, "
                       "--synthetic-tokens or --full-kv-answer with it")
        body.pop("full_kv_answer")
        body["conversation"] = {"id": conversation}
    elif synthetic_tokens is not None:
        body.update(synthetic_tokens=synthetic_tokens, generate=False)
    else:
        body.update(context=context, question=question)
    options = {"deadline_ms": deadline_ms, "rho": rho, "scheme": scheme, "rate_mbps": rate_mbps,
               "cache_salt": cache_salt}
    body.update({key: value for key, value in options.items() if value is not None})
    try:
        token = read_token(token_file) if token_file is not None else None
    except ConfigError as exc:
        raise fail(str(exc)) from None
    client = ControlClient(None if url else socket_path, url, token)
    try:
        status, data = asyncio.run(_follow(client, body))
    except OSError as exc:
        raise fail(f"cannot reach the sender's control API ({url or socket_path}): {exc}") from None
    if status >= 400:
        raise fail(str(data.get("error", data)))
    typer.echo(json.dumps(data, indent=2) if as_json else format_handoff_report(data))
    if data.get("outcome") != "done":
        raise typer.Exit(1)


async def _follow(client: ControlClient, body: dict[str, Any]) -> tuple[int, Any]:
    """POST the handoff, then poll it until done or failed; state changes go to stderr."""
    status, created = await client.request("POST", "/handoffs", body)
    if status != 202:
        return status, created
    hid, state = created["id"], created.get("state")
    typer.echo(f"handoff {hid}: {state}", err=True)
    while True:  # preparing (prefill) -> streaming -> draining -> done/failed
        status, report = await client.request("GET", f"/handoffs/{hid}?wait=0.5")
        if status != 200 or report.get("state") in ("done", "failed"):
            return status, report
        if report.get("state") != state:
            state = report.get("state")
            typer.echo(f"handoff {hid}: {state}", err=True)
