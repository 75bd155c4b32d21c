"""model-alias: parsing, the checks against the served models, and what a request naming an
alias is served by and at which class."""

import pytest

from superfluid.core import qos
from superfluid.core.errors import ConfigError, InvalidRequest
from superfluid.plugins.http.aliases import Alias, Aliases, parse_alias
from superfluid.plugins.http.keys.auth import applied_class


def test_parse_name_model_and_class():
    assert parse_alias("claude-haiku=smollm2@background") == Alias("claude-haiku", "smollm2", "background")
    assert parse_alias(" gpt = org/model ") == Alias("gpt", "org/model", None)
    assert parse_alias("fast=smollm2@background-agent").qos == "background"  # a class alias resolves


@pytest.mark.parametrize("text", ["", "x", "=m", "a=", "a=b=c", "a=b@"])
def test_malformed_aliases_are_refused(text):
    with pytest.raises(ConfigError):
        parse_alias(text)


def test_an_unknown_class_is_refused():
    with pytest.raises(InvalidRequest):
        parse_alias("a=b@urgentest")


def test_aliases_must_name_a_served_model_and_not_shadow_one():
    with pytest.raises(ConfigError, match="not served"):
        Aliases([Alias("a", "missing")], ["smollm2"])
    with pytest.raises(ConfigError, match="already a served model"):
        Aliases([Alias("smollm2", "smollm2")], ["smollm2"])
    with pytest.raises(ConfigError, match="twice"):
        Aliases([Alias("a", "smollm2"), Alias("a", "smollm2")], ["smollm2"])


def test_resolution():
    aliases = Aliases([Alias("haiku", "smollm2", "background")], ["smollm2"])
    assert aliases.model("haiku") == "smollm2" and aliases.qos("haiku") == "background"
    assert aliases.model("smollm2") == "smollm2" and aliases.qos("smollm2") is None
    assert aliases.model(None) is None


class _Request(dict):
    def __init__(self, headers):
        super().__init__()
        self.headers = headers


def test_the_alias_class_yields_to_a_class_the_request_asks_for():
    config = {}
    assert applied_class(_Request({}), config, otherwise="background") == "background"
    assert applied_class(_Request({"x-superfluid-qos": "interactive"}), config,
                         otherwise="background") == "interactive"
    assert applied_class(_Request({}), config, asked="agent", otherwise="background") == "agent"
    assert applied_class(_Request({}), config) == qos.DEFAULT_CLASS
