"""superfluid fleet's configuration: flags over the [fleet] table, errors that name the key and
the file, and the spec's refusals of the local-scheduler options (exit status 2)."""

from __future__ import annotations

import argparse

import pytest

from superfluid.core import cli
from superfluid.core.errors import ConfigError
from superfluid.plugins.fleet import config as fleet_config
from superfluid.plugins.fleet.config import FleetConfig, from_args

NODE = "http://127.0.0.1:9001"


def parse(*argv: str) -> FleetConfig:
    parser = argparse.ArgumentParser()
    fleet_config.add_arguments(parser)
    return from_args(parser.parse_args(list(argv)))


def write(tmp_path, text: str) -> str:
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    return str(path)


def test_defaults_and_flags():
    c = parse("--node", NODE, "--node", "http://10.0.0.2:8080/")
    assert c.nodes == (NODE, "http://10.0.0.2:8080")  # trailing slash dropped
    assert (c.host, c.port, c.policy, c.smg_port, c.log_level) == ("127.0.0.1", 8000, "cache_aware", 0, "info")
    c = parse("--node", NODE, "--policy", "round_robin", "--port", "9100", "--smg-port", "9101",
              "--host", "0.0.0.0", "--log-level", "debug")
    assert (c.policy, c.port, c.smg_port, c.host, c.log_level) == ("round_robin", 9100, 9101, "0.0.0.0", "debug")


def test_toml_table_and_flags_override_it(tmp_path):
    path = write(tmp_path, f'[fleet]\nnodes = ["{NODE}", "http://127.0.0.1:9002"]\npolicy = "prefix_hash"\n'
                           'port = 9200\nsmg_port = 9201\n')
    c = parse("--config", path)
    assert c.nodes == (NODE, "http://127.0.0.1:9002") and c.policy == "prefix_hash" and c.port == 9200
    assert c.smg_port == 9201 and c.source == path
    c = parse("--config", path, "--policy", "least_load", "--node", "http://127.0.0.1:9003")
    assert c.policy == "least_load" and c.nodes == ("http://127.0.0.1:9003",) and c.port == 9200


@pytest.mark.parametrize("text, words", [
    ('[fleet]\nnodes = "http://x:1"\n', ["[fleet] nodes", "list"]),
    ('[fleet]\nnodes = ["ftp://x:1"]\n', ["[fleet] nodes[0]", "http://"]),
    ('[fleet]\nnodes = ["http://x:1/v1"]\n', ["nodes[0]", "no path"]),
    ('[fleet]\nnodes = ["http://x:1"]\npolicy = "fastest"\n', ["[fleet] policy", "cache_aware", "'fastest'"]),
    ('[fleet]\nnodes = ["http://x:1"]\nport = 70000\n', ["[fleet] port", "65535"]),
    ('[fleet]\nnodes = ["http://x:1"]\nport = "80"\n', ["[fleet] port", "integer"]),
    ('[fleet]\nnodes = ["http://x:1"]\nmax_batch = 4\n', ["unknown key 'max_batch'"]),
    ('[fleet]\nnodes = ["http://x:1", "http://x:1"]\n', ["listed twice"]),
    ('nodes = ["http://x:1"]\n', ["no [fleet] table"]),
    ('[fleet]\n', ["no nodes", "--node"]),
    ('[fleet\n', ["not valid TOML"]),
])
def test_file_errors_name_the_key_and_the_file(tmp_path, text, words):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        parse("--config", path)
    assert path in str(exc.value)
    for w in words:
        assert w in str(exc.value)


def test_flag_errors_name_the_flag():
    with pytest.raises(ConfigError, match="--node"):
        parse("--node", "localhost:8080")
    with pytest.raises(ConfigError, match="--policy"):
        parse("--node", NODE, "--policy", "fastest")
    with pytest.raises(ConfigError, match="no nodes"):
        parse()


@pytest.mark.parametrize("argv, flag", [
    (["--class-lanes", "interactive=2"], "--class-lanes"),
    (["--class-lanes"], "--class-lanes"),
    (["--http-default-qos", "background"], "--http-default-qos"),
    (["--no-http-qos-header"], "--no-http-qos-header"),
    (["--http-allow-batch-invariant"], "--http-allow-batch-invariant"),
])
def test_refused_flags_exit_2_naming_the_flag(capsys, argv, flag):
    assert cli.main(["fleet", "--node", NODE, *argv]) == 2
    err = capsys.readouterr().err
    assert flag in err and "no local scheduler" in err and "superfluid serve" in err


@pytest.mark.parametrize("key, value, flag", [
    ("class-lanes", '"interactive=2"', "--class-lanes"),
    ("class_lanes", '"interactive=2"', "--class-lanes"),
    ("http-default-qos", '"background"', "--http-default-qos"),
    ("http-qos-header", "false", "--no-http-qos-header"),
    ("no-http-qos-header", "true", "--no-http-qos-header"),
    ("http-allow-batch-invariant", "true", "--http-allow-batch-invariant"),
])
def test_refused_keys_exit_2_naming_the_key_and_file(tmp_path, capsys, key, value, flag):
    path = write(tmp_path, f'[fleet]\nnodes = ["{NODE}"]\n{key} = {value}\n')
    assert cli.main(["fleet", "--config", path]) == 2
    err = capsys.readouterr().err
    assert path in err and key in err and flag in err and "set it on each node's own `superfluid serve`" in err


def test_discovery_file_alone_is_enough(tmp_path):
    c = parse("--discovery-file", str(tmp_path / "nodes.json"))
    assert c.nodes == () and c.discovery_file.endswith("nodes.json")


REFUSAL = ("superfluid fleet: configuration error: {flag} is a node setting: the fleet head has no local "
           "scheduler; set it on each node's own `superfluid serve`\n")


@pytest.mark.parametrize("argv, flag", [
    (["--class-lanes", "agent=2"], "--class-lanes"),
    (["--http-default-qos", "background"], "--http-default-qos"),
    (["--no-http-qos-header"], "--no-http-qos-header"),
    (["--http-allow-batch-invariant"], "--http-allow-batch-invariant"),
])
def test_refused_flags_give_exactly_their_message(capsys, argv, flag):
    assert cli.main(["fleet", "--node", NODE, *argv]) == 2
    assert capsys.readouterr().err == REFUSAL.format(flag=flag)


def test_a_refused_key_gives_exactly_its_message(tmp_path, capsys):
    path = write(tmp_path, f'[fleet]\nnodes = ["{NODE}"]\nhttp_qos_header = false\n')
    assert cli.main(["fleet", "--config", path]) == 2
    assert capsys.readouterr().err == (f"superfluid fleet: configuration error: {path}: [fleet] http_qos_header: "
                                       + REFUSAL.format(flag="--no-http-qos-header").split("error: ", 1)[1])


def test_the_head_uses_the_core_option_machinery(tmp_path):
    """Its options are core Options, loaded by the serve path's option_values: types, checks and
    the errors that name the key come from there."""
    from superfluid.core.options import PluginOptions
    assert isinstance(fleet_config.OPTIONS, PluginOptions)
    assert {o.name for o in fleet_config.OPTIONS} == {"nodes", "discovery-file", "host", "port", "policy",
                                                       "smg-port", "log-level", "ssl-certfile", "ssl-keyfile",
                                                       "ssl-cafile"}
    assert fleet_config.OPTIONS.of({}).port == 8000
    with pytest.raises(ConfigError, match=r"^--port must be between 0 and 65535, got 70000$"):
        parse("--node", NODE, "--port", "70000")
    with pytest.raises(ConfigError, match="did you mean 'smg-port'"):
        parse("--config", write(tmp_path, '[fleet]\nnodes = ["http://x:1"]\nsmg_prot = 1\n'))
