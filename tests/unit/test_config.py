"""Configuration: defaults < TOML file < flags, validated with errors that name the key and file.

Everything goes through ``superfluid.core.cli.load`` (the real plugin manager, so plugin-declared
options such as the HTTP front end's are present) or ``build_config`` directly."""

from __future__ import annotations

import pytest

from superfluid.core.cli import load, main
from superfluid.core.config import Schema, build_config, core_options
from superfluid.core.errors import ConfigError


def write_toml(tmp_path, text: str, name: str = "superfluid.toml") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def load_file(tmp_path, text: str, *flags: str):
    path = write_toml(tmp_path, text)
    config, _pm = load(["serve", "--config", path, *flags])
    return config, path


def core_schema() -> Schema:
    schema = Schema()
    for opt in core_options():
        schema.add(opt)
    return schema


# ---- defaults ----------------------------------------------------------------------------------

def test_defaults():
    config, pm = load(["serve"])
    assert config["max-batch"] == 8
    assert config["prefill-budget"] == 4096
    assert config["tick-decode-budget"] == 0
    assert config["tick-target-ms"] == 2000
    assert config["starvation-ticks"] == 8
    assert config["engine"] == "llamacpp"
    assert config["host"] == "127.0.0.1"
    assert config["http-default-qos"] == "agent"
    assert config["http-qos-header"] is True
    assert config.source == "defaults"
    # No model configured: one entry for the default model, resolved at startup.
    assert len(config.models) == 1
    assert config.models[0].path == ""
    assert config.models[0]["max-batch"] == 8
    assert pm.has_plugin("qos") and pm.has_plugin("http")


def test_build_config_defaults_directly():
    config = build_config(core_schema(), {}, {})
    assert config["max-batch"] == 8
    assert config["prefill-budget"] == 4096
    assert config["tick-target-ms"] == 2000
    assert config["starvation-ticks"] == 8


# ---- the TOML file ------------------------------------------------------------------------------

TOML_WITH_MODEL = """\
max-batch = 4

[[models]]
path = "/models/tiny.gguf"
name = "tiny"
max-batch = 2
"""


def test_toml_file_and_model_table(tmp_path):
    config, path = load_file(tmp_path, TOML_WITH_MODEL)
    assert config.source == path
    assert config["max-batch"] == 4
    assert config["prefill-budget"] == 4096  # untouched keys keep their defaults
    assert len(config.models) == 1
    model = config.models[0]
    assert model.name == "tiny"
    assert model.path == "/models/tiny.gguf"
    assert model.engine == "llamacpp"
    assert model["max-batch"] == 2          # the table's own value
    assert model["prefill-budget"] == 4096  # inherited from the top level


def test_model_table_name_defaults_to_file_stem(tmp_path):
    config, _ = load_file(tmp_path, '[[models]]\npath = "/models/SmolLM2-135M.gguf"\n')
    assert config.models[0].name == "SmolLM2-135M"
    assert config.models[0]["max-batch"] == 8


def test_flags_override_the_file(tmp_path):
    config, _ = load_file(tmp_path, "max-batch = 4\nprefill-budget = 1024\n",
                          "--max-batch", "6", "--tick-target-ms", "500")
    assert config["max-batch"] == 6
    assert config["prefill-budget"] == 1024
    assert config["tick-target-ms"] == 500


def test_flag_value_reaches_models_without_their_own(tmp_path):
    config, _ = load_file(tmp_path, TOML_WITH_MODEL + '\n[[models]]\npath = "/models/other.gguf"\n',
                          "--max-batch", "6")
    by_name = {m.name: m for m in config.models}
    assert by_name["tiny"]["max-batch"] == 2   # set in its own table
    assert by_name["other"]["max-batch"] == 6  # inherits the flag


def test_model_flag_comes_first(tmp_path):
    config, _ = load_file(tmp_path, TOML_WITH_MODEL, "--model", "/m/a.gguf", "--model-name", "a")
    assert [m.name for m in config.models] == ["a", "tiny"]
    assert config.models[0].path == "/m/a.gguf"


def test_underscore_spelling_accepted(tmp_path):
    config, _ = load_file(tmp_path, "max_batch = 3\ntick_target_ms = 700\n"
                                    '[[models]]\npath = "/m/x.gguf"\nprefill_budget = 512\n')
    assert config["max-batch"] == 3
    assert config["tick-target-ms"] == 700
    assert config.models[0]["prefill-budget"] == 512


def test_plugin_options_in_toml(tmp_path):
    config, _ = load_file(tmp_path, 'host = "0.0.0.0"\ninsecure = true\nport = 9000\nhttp-qos-header = false\n'
                                    'http-default-qos = "background-agent"\n')
    assert config["host"] == "0.0.0.0"
    assert config["port"] == 9000
    assert config["http-qos-header"] is False
    assert config["http-default-qos"] == "background"


def test_boolean_flag():
    config, _ = load(["serve", "--no-http-qos-header"])
    assert config["http-qos-header"] is False


# ---- errors that name the key and the file -------------------------------------------------------

def test_unknown_key_names_key_and_file(tmp_path):
    path = write_toml(tmp_path, "max-batchh = 4\n")
    with pytest.raises(ConfigError) as exc:
        load(["serve", "--config", path])
    msg = str(exc.value)
    assert "max-batchh" in msg
    assert path in msg
    assert "max-batch" in msg.replace("max-batchh", "")  # the suggestion


def test_unknown_model_key_names_key_and_file(tmp_path):
    # "host" exists but is not model-scoped.
    path = write_toml(tmp_path, '[[models]]\npath = "/m/x.gguf"\nhost = "0.0.0.0"\n')
    with pytest.raises(ConfigError) as exc:
        load(["serve", "--config", path])
    assert "host" in str(exc.value)
    assert path in str(exc.value)


def test_model_table_without_path(tmp_path):
    path = write_toml(tmp_path, '[[models]]\nname = "x"\n')
    with pytest.raises(ConfigError) as exc:
        load(["serve", "--config", path])
    assert "path" in str(exc.value)
    assert path in str(exc.value)


@pytest.mark.parametrize("text, key", [
    ('max-batch = "x"\n', "max-batch"),
    ("max-batch = true\n", "max-batch"),
    ("max-batch = 2.5\n", "max-batch"),
    ('port = "80"\n', "port"),
    ('host = 1\n', "host"),
    ('http-qos-header = "yes"\n', "http-qos-header"),
])
def test_wrong_type_names_key_and_file(tmp_path, text, key):
    path = write_toml(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        load(["serve", "--config", path])
    assert key in str(exc.value)
    assert path in str(exc.value)


def test_wrong_type_in_model_table(tmp_path):
    path = write_toml(tmp_path, '[[models]]\npath = "/m/x.gguf"\nmax-batch = "x"\n')
    with pytest.raises(ConfigError) as exc:
        load(["serve", "--config", path])
    assert "max-batch" in str(exc.value)
    assert path in str(exc.value)


@pytest.mark.parametrize("text, key", [
    ("prefill-budget = 10\n", "prefill-budget"),
    ("prefill-budget = 5000\n", "prefill-budget"),
    ("prefill-budget = -1\n", "prefill-budget"),
    ("max-batch = 0\n", "max-batch"),
    ("max-batch = 257\n", "max-batch"),
    ("tick-target-ms = 0\n", "tick-target-ms"),
    ("starvation-ticks = 0\n", "starvation-ticks"),
    ("port = 70000\n", "port"),
])
def test_out_of_range_names_key_and_file(tmp_path, text, key):
    path = write_toml(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        load(["serve", "--config", path])
    assert key in str(exc.value)
    assert path in str(exc.value)


@pytest.mark.parametrize("value", [0, 64, 4096])
def test_prefill_budget_edges_valid(tmp_path, value):
    config, _ = load_file(tmp_path, f"prefill-budget = {value}\n")
    assert config["prefill-budget"] == value


def test_out_of_range_flag_names_flag():
    with pytest.raises(ConfigError) as exc:
        load(["serve", "--prefill-budget", "10"])
    assert "--prefill-budget" in str(exc.value)


def test_prefill_budget_zero_flag_is_adaptive():
    config, _ = load(["serve", "--prefill-budget", "0"])
    assert config["prefill-budget"] == 0


def test_not_toml(tmp_path):
    path = write_toml(tmp_path, "max-batch = = 4\n")
    with pytest.raises(ConfigError) as exc:
        load(["serve", "--config", path])
    assert path in str(exc.value)


def test_unimportable_plugin_named(tmp_path):
    path = write_toml(tmp_path, 'plugins = ["superfluid_no_such_plugin_xyz"]\n')
    with pytest.raises(ConfigError) as exc:
        load(["serve", "--config", path])
    assert "superfluid_no_such_plugin_xyz" in str(exc.value)
    assert path in str(exc.value)


# ---- QoS class options ----------------------------------------------------------------------------

@pytest.mark.parametrize("alias, canonical", [
    ("interactive-chat", "interactive"), ("0", "interactive"), ("inline-completion", "completion"),
    ("foreground", "agent"), ("background-agent", "background"), ("3", "background"),
])
def test_http_default_qos_alias(alias, canonical):
    config, _ = load(["serve", "--http-default-qos", alias])
    assert config["http-default-qos"] == canonical


def test_http_default_qos_unknown_fails():
    with pytest.raises(Exception) as exc:
        load(["serve", "--http-default-qos", "bogus"])
    assert "bogus" in str(exc.value)


def test_http_default_qos_unknown_is_config_error():
    with pytest.raises(ConfigError) as exc:
        load(["serve", "--http-default-qos", "bogus"])
    assert "http-default-qos" in str(exc.value)


def test_main_unknown_default_qos_exit_code(capsys):
    assert main(["serve", "--http-default-qos", "bogus"]) == 2
    assert "bogus" in capsys.readouterr().err


def test_http_default_qos_toml_integer_resolved_or_rejected(tmp_path):
    path = write_toml(tmp_path, "http-default-qos = 0\n")
    try:
        config, _ = load(["serve", "--config", path])
    except ConfigError as exc:
        assert "http-default-qos" in str(exc)
    else:
        assert config["http-default-qos"] == "interactive"


def test_http_default_qos_toml_list_rejected(tmp_path):
    path = write_toml(tmp_path, 'http-default-qos = ["a"]\n')
    with pytest.raises(ConfigError):
        load(["serve", "--config", path])


# ---- models ---------------------------------------------------------------------------------------

def test_two_models_same_name_fail(tmp_path):
    path = write_toml(tmp_path, '[[models]]\npath = "/a/x.gguf"\nname = "m"\n'
                                '[[models]]\npath = "/b/y.gguf"\nname = "m"\n')
    with pytest.raises(ConfigError) as exc:
        load(["serve", "--config", path])
    assert "m" in str(exc.value)
    assert path in str(exc.value)


def test_two_models_same_stem_fail(tmp_path):
    path = write_toml(tmp_path, '[[models]]\npath = "/a/x.gguf"\n[[models]]\npath = "/b/x.gguf"\n')
    with pytest.raises(ConfigError):
        load(["serve", "--config", path])


def test_model_flag_clashing_with_table_name(tmp_path):
    path = write_toml(tmp_path, '[[models]]\npath = "/a/x.gguf"\nname = "tiny"\n')
    with pytest.raises(ConfigError):
        load(["serve", "--config", path, "--model", "/b/tiny.gguf"])


# ---- main() and --help -----------------------------------------------------------------------------

def test_main_missing_config_file(tmp_path, capsys):
    missing = str(tmp_path / "nope.toml")
    assert main(["serve", "--config", missing]) == 2
    err = capsys.readouterr().err
    assert missing in err


def test_main_bad_key_exit_code(tmp_path, capsys):
    path = write_toml(tmp_path, "max-batch = 0\n")
    assert main(["serve", "--config", path]) == 2
    err = capsys.readouterr().err
    assert "max-batch" in err and path in err


def test_main_config_is_directory(tmp_path, capsys):
    assert main(["serve", "--config", str(tmp_path)]) == 2


def test_serve_help_lists_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--max-batch", "--prefill-budget", "--tick-decode-budget", "--tick-target-ms",
                 "--starvation-ticks", "--model", "--engine", "--host", "--port", "--config",
                 "--http-default-qos", "--no-http-qos-header"):
        assert flag in out, flag


# ---- fractions: the pressure watermarks ---------------------------------------------------------

@pytest.mark.parametrize("flag", ["85", "85%", "0.85", " 85 % ".strip()])
def test_pressure_high_as_fraction_or_percentage_flag(flag):
    config, _ = load(["serve", "--pressure-high", flag])
    assert config.models[0]["pressure-high"] == pytest.approx(0.85)


@pytest.mark.parametrize("value", ["85", '"85%"', "0.85"])
def test_pressure_high_as_fraction_or_percentage_toml(tmp_path, value):
    config, _ = load_file(tmp_path, f"pressure-high = {value}\npressure-low = \"60%\"\n")
    assert config.models[0]["pressure-high"] == pytest.approx(0.85)
    assert config.models[0]["pressure-low"] == pytest.approx(0.60)


@pytest.mark.parametrize("flag, needle", [("abc", "percentage"), ("150%", "between"), ("-5", "between")])
def test_pressure_high_bad_values_name_the_flag(flag, needle):
    with pytest.raises(ConfigError) as exc:
        load(["serve", "--pressure-high", flag])
    assert "pressure-high" in str(exc.value) and needle in str(exc.value)
