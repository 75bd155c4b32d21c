"""A model cannot be planned without the decision hooks: the daemon refuses to start without an
implementation of each, with an error that names them, instead of failing the first tick."""

from __future__ import annotations

import pytest

from superfluid.core.cli import load
from superfluid.core.daemon import Daemon
from superfluid.core.errors import ConfigError
from superfluid.core.plugins import REQUIRED_HOOKS, check_required_hooks, make_plugin_manager


def test_the_built_in_policies_provide_every_required_hook():
    check_required_hooks(make_plugin_manager())


def test_without_the_qos_plugin_the_daemon_refuses_to_start():
    config, _ = load(["serve"])
    pm = make_plugin_manager(disabled=("qos",))
    with pytest.raises(ConfigError) as exc:
        Daemon(config, pm)
    for name in REQUIRED_HOOKS:
        assert name in str(exc.value)
    assert "qos plugin" in str(exc.value)
