"""docs/configuration.md documents every option that the core and the built-in plugins declare."""

from pathlib import Path

from superfluid.core.config import Schema, core_options
from superfluid.core.plugins import make_plugin_manager

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_every_option_is_documented():
    schema = Schema()
    for opt in core_options():
        schema.add(opt)
    make_plugin_manager().hook.superfluid_add_config(schema=schema)
    text = DOC.read_text()
    missing = [name for name in schema.options if f"`--{name}`" not in text]
    assert not missing, f"undocumented options: {missing}"
