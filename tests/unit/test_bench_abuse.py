"""tools.bench.abuse without a server: its arguments, policy file and report table."""

from plugins.http.keys.policy import load_policy
from tools.bench import abuse


def test_arguments_default_to_every_scenario():
    args = abuse.parser().parse_args([])
    assert args.scenarios is None and args.slow_connections == 500 and args.agents == 8
    args = abuse.parser().parse_args(["--scenario", "fim", "--scenario", "slowloris"])
    assert args.scenarios == ["fim", "slowloris"]


def test_policy_holds_the_hashes_of_the_secrets(tmp_path):
    secrets = abuse.write_policy(tmp_path / "keys.toml")
    policy = load_policy(str(tmp_path / "keys.toml"))
    for name, cls in abuse.KEYS.items():
        assert policy.identify(secrets[name]).name == name
        assert policy.keys[name].qos == cls
    assert not any(s in (tmp_path / "keys.toml").read_text() for s in secrets.values())


def test_table_from_a_report():
    chat = {"status": 200, "qos_header": "interactive", "ttft_s": 0.2, "total_s": 0.5}
    rnd = {**chat, "preemptions_delta": 1.0, "agents": 8, "agents_ok": 0, "agent_prompt_tokens": []}
    report = {"ceiling": {"capped": {**rnd, "qos_header": "agent", "preemptions_delta": 0.0}, "contrast": rnd},
              "fim": {"sent": 10, "wall_s": 1.0, "statuses": {"200": 4, "429": 6}, "with_retry_after": 6,
                      "retry_after_range": [1, 1], "chat_ttft_max_s": 0.3},
              "slowloris": {"connections": 500, "outcomes": {"silent": {"408": 250}}, "closed_after_s": [10.0, 10.1],
                            "health_after": 200, "chat_ttft_max_s": 0.1}}
    text = abuse.table(report)
    assert text.count("\n") == 5 and "preemptions +0" in text and "`agent`" in text and "408" in text


def test_raise_nofile_is_a_no_op_when_enough():
    got = abuse.raise_nofile(16)
    assert got["soft_after"] == got["soft_before"] and not got["raised"]
