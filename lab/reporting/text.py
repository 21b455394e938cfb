"""Human-readable text of the reports that handoffs, `pfec sim` and `pfec reliable` return as dicts.

Plain functions over the JSON-ready dicts, so the CLI and the lab (e.g. the demo) print the same lines.
"""

from __future__ import annotations

from typing import Any


def budget_label(fraction: float | None) -> str:
    """A repair budget as the reports print it: a fraction of the sources, or the whole deadline."""
    return "the whole deadline" if fraction is None else f"{fraction:.0%} of the sources"


def format_handoff_report(report: dict[str, Any]) -> str:
    """One handoff's report (a daemon's `GET /handoffs/ID`) as a few lines."""

    def num(key: str, fmt: str, scale: float = 1.0) -> str:
        value = report.get(key)
        return "-" if value is None else format(value * scale, fmt)

    lines = [
        f"handoff {report.get('id', '?')}: {report.get('outcome', report.get('state'))}"
        f" ({report.get('scheme', '?')}, {report.get('mode', '?')} reconstruction)",
        f"  recovered utility {num('recovered_utility', '.2%')}, blocks {report.get('blocks_recovered', '-')}"
        f"/{report.get('n_blocks', '-')}, decoded symbols {report.get('decoded_symbols', '-')}"
        f"/{report.get('n_source', '-')}",
        f"  sent: source {report.get('source_sent', '-')}, repair {report.get('repair_sent', '-')}, "
        f"control {report.get('control_sent', '-')}, {num('bytes_sent', ',.0f')} bytes",
        f"  deadline {num('deadline_ms', '.1f')} ms (rho {num('rho', '.2f')}), "
        f"slack {num('deadline_slack_ms', '.2f')} ms, "
        f"receiver start lateness {num('deadline_late_ms', '.2f')} ms",
        f"  precision {report.get('precision', '-')}: {num('stream_bytes', ',.0f')} bytes of KV for "
        f"{num('native_bytes', ',.0f')} native; planner {report.get('planner_choice') or '-'}, "
        f"predicted TTFT {num('planner_ttft_s', '.3f')} s",
        f"  prefill {num('prefill_s', '.2f')} s, TTFT {num('ttft_s', '.3f')} s"
        f" (started at the {report.get('start') or '-'})",
        f"  recovered utility at precision {num('precision_utility', '.2%')}, levels {report.get('levels')}",
        f"  answer: {report.get('answer')!r}",
    ]
    if "full_kv_answer" in report:
        lines.append(f"  full-KV answer: {report['full_kv_answer']!r}")
    conversation = report.get("conversation")
    if conversation:
        lines.append(f"  conversation: {conversation['n_tokens']} tokens handed over "
                     f"({conversation['prefilled_tokens']} prefilled for it, the rest from the sender's "
                     "prefix cache); the receiver continues it through its /v1 API")
    if report.get("failure"):
        lines.append(f"  failure: {report['failure']}")
    return "\n".join(lines)


def format_sim_table(result: dict[str, Any]) -> str:
    """`pfec sim`'s result: the inputs, then one row per scheme."""
    inp = result["inputs"]
    width = max(16, 2 + max((len(name) for name in result["schemes"]), default=0))
    lines = [
        f"Simulated handoff: {inp['tokens']} tokens ({inp['kv_bytes'] / 1e6:.1f} MB KV, {inp['n_source']} "
        f"source symbols of {inp['symbol_size']} B), {inp['rate_mbps']:g} Mbit/s, RTT {inp['rtt_ms']:g} ms, "
        f"loss {inp['loss']}",
        f"deadline {inp['deadline_ms']:.1f} ms (rho {inp['rho']:.2f}, {inp['slots']} slots), repair budget "
        f"{budget_label(inp['repair_budget'])}, window {inp['window_cap']}, profile {inp['profile']}, "
        f"{inp['realizations']} paired realizations",
        "",
        f"{'scheme':<{width}}{'utility':>9}{'  95% CI':<18}{'effic.':>8}{'symbols':>9}{'source':>9}"
        f"{'repair':>8}{'stalls':>8}{'ms/run':>9}",
    ]
    for name, s in result["schemes"].items():
        lo, hi = s["recovered_utility_ci95"]
        lines.append(
            f"{name:<{width}}{s['recovered_utility_mean']:>9.2%}  [{lo:.2%}, {hi:.2%}]".ljust(width + 27)
            + f"{s.get('efficiency_mean', float('nan')):>8.2%}"
            + f"{s['recovered_symbol_fraction_mean']:>9.2%}{s['source_sent_mean']:>9.0f}"
            f"{s['repair_sent_mean']:>8.0f}{s['stalls_mean']:>8.0f}{s['wall_s_mean'] * 1000:>9.0f}"
        )
    lines.append("")
    if "precision" in inp:
        lines.append(f"precision {inp['precision']}: {inp['stream_symbols']} symbols carry "
                     f"{inp['stream_bytes']:,} B of quantised pieces; utility = U x fidelity at the level "
                     "each block reached, recovered_block_utility (JSON) the plain share of usable blocks")
    if "mode" in inp:  # split / local: the receiver computes (lab/sim/split.py)
        ttft = ", ".join(f"{n} {s['ttft_ms_mean']:.0f} ms" for n, s in result["schemes"].items()
                         if "ttft_ms_mean" in s)
        lines.append(f"mode {inp['mode']}: the receiver computes tokens [0, {inp['meeting_token']}) (and on, "
                     f"until it starts; computed blocks count as exact); TTFT {ttft}; local prefill "
                     f"{inp['local_ttft_ms']:.0f} ms")
    lines.append("utility = share of the profile's KV utility in blocks fully decoded by the deadline")
    lines.append("effic. = utility / the clairvoyant oracle's on the same realization")
    for name, s in result["schemes"].items():
        if "note" in s:
            lines.append(f"{name}: {s['note']}")
    return "\n".join(lines)


def format_reliable_summary(result: dict[str, Any], proto: str) -> str:
    """`pfec reliable`'s result for one protocol in two lines (the link: its rate, or its rate trace)."""
    s = result["schemes"][proto]
    lo, hi = s["recovered_utility_ci95"]
    trace = s.get("rate_trace")
    link = (f"{s['link_rate_mbps']:g} Mbit/s" if trace is None else
            f"a {trace['mean_rate_mbps']:g} Mbit/s mean trace ({trace['name']} x{trace['scale']:g})")
    cpu = s.get("sender_cpu_share_mean")
    return (
        f"{proto} ({', '.join(s['congestion_control'])}, emulator {s['emulator_mode']}), "
        f"deadline {result['inputs']['deadline_ms']:.1f} ms, {s['realizations']} realizations\n"
        f"utility {s['recovered_utility_mean']:.2%} [{lo:.2%}, {hi:.2%}], in-order bytes "
        f"{s['in_order_bytes_mean'] / s['payload_bytes']:.1%} of {s['payload_bytes']}, link rate achieved "
        f"{s['link_rate_achieved_mbps']:.1f} on {link}"
        + ("" if cpu is None else f", sender CPU share {cpu:.2f}")
    )
