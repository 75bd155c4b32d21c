"""Pressure sources (spec: scheduling-and-qos.md, "Memory pressure"): PSI parsing and the levels
of the OS source (plugins/pressure), and the pressure-source hook swapped in by a TOML
``plugins`` list, whose sources reach a model's ticks. No servers, no models."""

from __future__ import annotations

import pathlib
import sys
import uuid
from types import SimpleNamespace

import pytest

from superfluid.core.cli import load
from superfluid.plugins.pressure import sources as psrc
from superfluid.plugins.pressure.sources import OsPressure, level_from, macos_level, parse_psi

from .fakes import prompt, step, submit

PSI_DIR = pathlib.Path(__file__).parent.parent / "data" / "psi"


# ---- PSI parsing and levels -------------------------------------------------------------------------

def test_parse_psi_samples():
    calm = parse_psi((PSI_DIR / "calm").read_text())
    assert calm == {"some": {"avg10": 0.0, "avg60": 0.0, "avg300": 0.0, "total": 0.0},
                    "full": {"avg10": 0.0, "avg60": 0.0, "avg300": 0.0, "total": 0.0}}
    some = parse_psi((PSI_DIR / "some-pressure").read_text())
    assert some["some"] == {"avg10": 23.51, "avg60": 12.07, "avg300": 3.85, "total": 48213377.0}
    assert some["full"]["avg10"] == 2.14
    full = parse_psi((PSI_DIR / "full-pressure").read_text())
    assert full["some"]["avg10"] == 78.91
    assert full["full"] == {"avg10": 41.37, "avg60": 30.02, "avg300": 11.58, "total": 456789012.0}


def test_parse_psi_tolerates_odd_input():
    assert parse_psi("") == {}
    # No "full" line (as for CPU PSI on older kernels), indentation, junk lines, a bad value.
    text = "  some avg10=12.50 avg60=bad avg300=1.00 total=5\nnoise here\ncpu avg10=99\n"
    assert parse_psi(text) == {"some": {"avg10": 12.5, "avg300": 1.0, "total": 5.0}}
    assert level_from(parse_psi(text), None) == "warning"


@pytest.mark.parametrize("some,full,available,level", [
    (0.0, 0.0, None, "ok"),
    (9.99, 0.0, None, "ok"),
    (10.0, 0.0, None, "warning"),            # some avg10 >= 10 %
    (60.0, 9.99, None, "warning"),
    (60.0, 10.0, None, "critical"),          # full avg10 >= 10 %
    (0.0, 10.0, None, "critical"),
    (None, None, 0.50, "ok"),
    (None, None, 0.10, "ok"),                # under 10 % available: warning
    (None, None, 0.0999, "warning"),
    (None, None, 0.05, "warning"),           # under 5 % available: critical
    (None, None, 0.0499, "critical"),
    (None, None, 0.0, "critical"),
    (None, None, None, "ok"),
    (10.0, 0.0, 0.50, "warning"),
    (0.0, 0.0, 0.07, "warning"),
    (0.0, 0.0, 0.01, "critical"),
    (12.0, 0.0, 0.04, "critical"),           # the worse of the two
    (80.0, 20.0, 0.90, "critical"),
])
def test_level_from_thresholds(some, full, available, level):
    psi = None if some is None else {"some": {"avg10": some}, "full": {"avg10": full}}
    assert level_from(psi, available) == level


def test_level_from_samples():
    psi = {name: parse_psi((PSI_DIR / name).read_text()) for name in ("calm", "some-pressure", "full-pressure")}
    assert level_from(psi["calm"], 0.5) == "ok"
    assert level_from(psi["some-pressure"], 0.5) == "warning"
    assert level_from(psi["full-pressure"], 0.5) == "critical"
    assert level_from(psi["calm"], 0.08) == "warning"
    assert level_from(psi["calm"], 0.03) == "critical"
    assert level_from({}, 0.5) == "ok"


@pytest.mark.parametrize("value,level", [(1, "ok"), (2, "warning"), (4, "critical"), (0, "ok")])
def test_macos_level(value, level):
    assert macos_level(value) == level


linux_only = pytest.mark.skipif(sys.platform == "darwin", reason="OsPressure reads sysctl on macOS")


@linux_only
def test_os_pressure_reads_psi_file_with_real_psutil():
    for name in ("calm", "some-pressure", "full-pressure"):
        assert OsPressure(psi_path=str(PSI_DIR / name)).level() in psrc.LEVELS
    assert OsPressure(psi_path=str(PSI_DIR / "full-pressure")).level() == "critical"
    assert OsPressure(psi_path=str(PSI_DIR / "no-such-file")).level() in psrc.LEVELS  # no PSI: memory only
    assert OsPressure.name == "os"


@linux_only
def test_os_pressure_levels_with_fixed_available_memory(monkeypatch, tmp_path):
    memory = {"available": 50, "total": 100}
    monkeypatch.setattr(psrc.psutil, "virtual_memory", lambda: SimpleNamespace(**memory))
    path = tmp_path / "memory"
    source = OsPressure(psi_path=str(path))
    assert source.level() == "ok"                          # no PSI file: available memory only
    for name, level in (("calm", "ok"), ("some-pressure", "warning"), ("full-pressure", "critical"),
                        ("calm", "ok")):                   # read again at every call
        path.write_text((PSI_DIR / name).read_text())
        assert source.level() == level, name
    memory.update(available=8)
    assert source.level() == "warning"
    memory.update(available=4)
    assert source.level() == "critical"
    memory.update(available=0, total=0)                    # no total: PSI only
    assert source.level() == "ok"


# ---- the pressure-source plugin, swapped in by TOML -------------------------------------------------

PLUGIN_SOURCE = '''
from superfluid.core.hookspecs import hookimpl


class FixedSource:
    name = "fixed"

    def __init__(self, level):
        self._level = level

    def level(self):
        return self._level


@hookimpl
def superfluid_add_pressure_sources(register, config):
    register(FixedSource("critical"))
'''


@pytest.fixture
def pressure_plugin(tmp_path, monkeypatch):
    """(module name, TOML path): a module defining a pressure source, named by a TOML plugins list."""
    name = f"sf_test_pressure_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(PLUGIN_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    toml = tmp_path / "superfluid.toml"
    toml.write_text(f'plugins = ["{name}"]\n')
    yield name, toml
    sys.modules.pop(name, None)


def all_sources(pm, config) -> list:
    sources = []
    pm.hook.superfluid_add_pressure_sources(register=sources.append, config=config)
    return sources


def test_toml_plugin_source_replaces_os_pressure(pressure_plugin):
    name, toml = pressure_plugin
    config, pm = load(["serve", "--config", str(toml), "--no-os-pressure"])
    assert config["os-pressure"] is False
    assert name in config.plugins and pm.has_plugin(name)
    sources = all_sources(pm, config)
    assert len(sources) == 1
    assert type(sources[0]).__module__ == name and sources[0].level() == "critical"


def test_toml_plugin_source_beside_os_pressure(pressure_plugin):
    name, toml = pressure_plugin
    config, pm = load(["serve", "--config", str(toml)])
    assert config["os-pressure"] is True
    sources = all_sources(pm, config)
    assert len(sources) == 3
    assert sorted(type(s).__name__ for s in sources) == ["CgroupMemory", "FixedSource", "OsPressure"]
    assert [s.level() for s in sources if type(s).__module__ == name] == ["critical"]


def test_os_pressure_key_in_toml_and_flag_precedence(pressure_plugin):
    name, toml = pressure_plugin
    toml.write_text(f'plugins = ["{name}"]\nos-pressure = false\n')
    config, pm = load(["serve", "--config", str(toml)])
    assert [type(s).__name__ for s in all_sources(pm, config)] == ["FixedSource"]
    config, pm = load(["serve", "--config", str(toml), "--os-pressure"])  # the flag wins
    assert sorted(type(s).__name__ for s in all_sources(pm, config)) == ["CgroupMemory", "FixedSource", "OsPressure"]


def test_plugin_source_drives_a_scheduler(pressure_plugin, make):
    """As the daemon wires it: the plugin's sources go to the scheduler, whose ticks report them."""
    name, toml = pressure_plugin
    config, pm = load(["serve", "--config", str(toml), "--no-os-pressure"])
    loop, engine = make(sources=all_sources(pm, config), start=False, prefix_cache=True)
    submit(loop, prompt(100, 20), 2)
    _, stats = step(loop, engine)
    assert stats.pressure == "critical"
