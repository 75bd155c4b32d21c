"""Markdown tables of the fleet bench's JSON (pure, so the unit tests can render a canned run)."""

from __future__ import annotations


def _f(v, spec: str = ".2f", none: str = "-") -> str:
    return none if v is None else format(v, spec)


def _errors(errors: dict) -> str:
    return "; ".join(f"{n}× {msg}" for msg, n in sorted(errors.items(), key=lambda kv: -kv[1])) or "none"


def refusals_md(r: dict) -> list[str]:
    if "error" in r:
        return [f"Refusals: not run: {r['error']}", ""]
    out = ["The head's refusals (`superfluid fleet --node URL FLAG`)", "", "| flag | exit | message |", "|---|---:|---|"]
    out += [f"| `{' '.join(x['flags'])}` | {x['rc']} | {x['message']} |" for x in r["runs"]]
    return out + [""]


def affinity_md(a: dict) -> list[str]:
    if "error" in a:
        return [f"Prefix affinity: failed: {a['error']}", ""]
    out = [f"Prefix affinity: {a['requests']} chats over {a['families']} shared system prompts "
           f"(~{a['prefix_tokens_asked']} tokens asked), {a['concurrency']} at a time", "",
           "| policy | prefill tokens (all nodes) | per node | requests per node | completed | prompt tokens | wall (s) |",
           "|---|---:|---|---|---:|---:|---:|"]
    for policy, r in a["runs"].items():
        out.append(f"| {policy} | {r['prefilled_total']:.0f} | {[int(x) for x in r['prefilled_per_node']]} | "
                   f"{[int(x) for x in r['requests_per_node']]} | {r['completed']}/{r['sent']} | "
                   f"{r['prompt_tokens_min']}-{r['prompt_tokens_max']} each | {r['wall_s']} |")
    out += ["", f"cache_aware / round_robin prefill: **{_f(a['ratio_cache_aware_to_round_robin'])}** "
                f"(goal ≤ {a['goal']})", ""]
    return out


def kill_md(k: dict) -> list[str]:
    if "error" in k:
        return [f"Node killed mid-burst: failed: {k['error']}", ""]
    c, p, r = k["counts"], k["probes"], k["rejoin"]
    out = [f"Node SIGKILLed mid-burst: {k['burst']} chats ({k['streamed']} streamed, {k['max_tokens']}-token "
           f"replies); node{k['victim']} killed {k['killed_after_s']} s in, with {k['victim_busy_at_kill']} requests "
           f"running or queued on it (per node {k['busy_per_node_at_kill']})", "",
           "| sent | completed | failed with an error | truncated | lost |", "|---:|---:|---:|---:|---:|",
           f"| {c['sent']} | {c['completed']} | {c['error']} | {c['truncated']} | {c['lost']} |", "",
           f"- errors: {_errors(c['errors'])}",
           f"- requests SMG retried on another node (smg_worker_retries_total): {_f(k.get('smg_retries'), '.0f')}",
           f"- streams: {k['streams']['completed']}/{k['streams']['sent']} completed, "
           f"{k['streams']['error']} ended with an error event ({k.get('failed_streams_with_content')} of them "
           f"after some content; the last failure ended {_f(k.get('failed_ended_after_kill_s_max'))} s after the "
           f"kill), {k['streams']['truncated']} truncated, {k['streams']['lost']} hung",
           f"- head /health calls node{k['victim']} unhealthy after **{_f(k['unhealthy_after_s'])} s**, "
           f"and no longer routed to (SMG's view) after **{_f(k.get('unrouted_after_s'))} s**",
           f"- probes after the kill (one per {p['interval_s']} s for {p['seconds']} s): {p['completed']}/{p['sent']} "
           f"completed; last failed probe sent {_f(p['last_failed_sent_after_kill_s'], '.2f', 'none')} s after "
           f"the kill; errors: {_errors(p['errors'])}",
           f"- rejoin: restarted node ready in {r['restart_ready_s']} s, routed to by the head "
           f"{_f(r['routed_at_head_after_ready_s'])} s later; then {r['requests']['completed']}/"
           f"{r['requests']['sent']} chats completed, per node {[int(x) for x in r['requests_per_node']]}", ""]
    return out


def qos_md(q: dict) -> list[str]:
    if "error" in q:
        return [f"QoS through the head: failed: {q['error']}", ""]
    out = [f"QoS through the head: {q['agents']} agent chats (~{q['agent_tokens_asked']} tokens each) over "
           f"nodes of {q['lanes_per_node']} lanes; at the first chat, per node {q['per_node_at_chat']}; "
           f"the chats go one after the other", "",
           "| chat (class sent as) | TTFT (s) | outcome |", "|---|---:|---|"]
    for label, c in q["chats"].items():
        ttft = _f(c["ttft"])
        out.append(f"| {label} | {'**' + ttft + '**' if label.startswith('interactive') else ttft} | "
                   f"{c['kind']}{': ' + c['error'] if c.get('error') else ''} |")
    return out + ["", f"goal ≤ {q['goal_s']} s for the interactive chat", ""]


def overhead_md(o: dict) -> list[str]:
    if "error" in o:
        return [f"Overhead: failed: {o['error']}", ""]
    out = [f"Overhead: {o['request']}, {o['n']} rounds (routes alternate within a round)", "",
           "| route | n | p50 (ms) | p99 (ms) | p50 added (ms) | p99 added (ms) |", "|---|---:|---:|---:|---:|---:|"]
    for name, s in o["routes"].items():
        added = o["added"].get(name, {})
        out.append(f"| {name} | {s['n']} | {_f(s['p50_ms'])} | {_f(s['p99_ms'])} | "
                   f"{_f(added.get('p50_ms'))} | {_f(added.get('p99_ms'))} |")
    return out + [""]


def faults_md(f: dict) -> list[str]:
    if "error" in f:
        return [f"Faults: failed: {f['error']}", ""]
    d, u, a = f["down_at_start"], f["unknown_model"], f["all_down"]
    return ["Faults at the head", "",
            f"- a node down when the head starts: head /health {d['head_health_status']}, the node healthy "
            f"{d['late_node_healthy']}, routed {d['late_node_routed']}; a chat: {d['chat']['kind']} "
            f"({d['chat']['status']}); the node started (ready in {d['started_ready_s']} s) is routed to "
            f"{_f(d['routed_after_ready_s'])} s after it answers",
            f"- a model no node serves: HTTP {u['status']} `{u.get('code')}`: {u['error']}",
            f"- every node killed: the head calls them all unhealthy after {_f(a['unhealthy_after_s'])} s; "
            f"head /health {a['head_health_status']}; a chat: HTTP {a['chat']['status']} `{a['chat'].get('code')}`: "
            f"{a['chat']['error']}", ""]


def markdown(results: dict) -> str:
    out = [f"Fleet bench, {results.get('date')}, commit {results.get('commit')}, head: {results.get('head')}",
           f"`{results.get('command')}`", ""]
    for key, fn in (("refusals", refusals_md), ("affinity", affinity_md), ("kill", kill_md), ("qos", qos_md),
                    ("overhead", overhead_md), ("faults", faults_md)):
        if key in results:
            out += fn(results[key])
    return "\n".join(out)
