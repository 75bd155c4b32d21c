"""mlx-lm's own server needs an mlx-lm model directory: this writes one from the GGUF, once, and
lays out the folder ``mlx_lm.server`` runs in, so the bench and the suite can start it from the
same file every other target reads.

* The directory is written by ``python -m superfluid.plugins.mlx.convert`` (same quantized
  tensors as superfluid's MLX engine reads from the GGUF; see docs/mlx.md) into the cache,
  ``$SUPERFLUID_CACHE/mlx-lm/<name>-<key>`` (default ``~/.cache/superfluid``), where the key is
  the GGUF's path, size and modification time: a changed file is converted again. It is written
  beside and renamed into place, so a conversion that was killed leaves nothing half-written.
* ``mlx_lm.server`` answers to the ``model`` a request names by loading that path (or Hugging
  Face repo) unless it is ``default_model``; the other targets answer to an alias (``smollm2``).
  So the server runs in a folder of its own that holds a link named after the alias pointing at
  the directory, and is started with ``--model ALIAS``: a request for the alias is the loaded
  model, with no reload and no hub.
* Its ``/v1/models`` lists the Hugging Face cache too, so ``HF_HUB_CACHE`` is an empty folder of
  the run folder and ``HF_HUB_OFFLINE=1``: nothing is looked up on a hub.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from superfluid.core import lifeline


def cache_root() -> Path:
    return Path(os.environ.get("SUPERFLUID_CACHE", Path.home() / ".cache/superfluid")) / "mlx-lm"


def _key(gguf: Path) -> str:
    st = gguf.stat()
    return hashlib.sha1(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]


def model_dir(gguf: str, timeout: float = 600.0) -> Path:
    """The mlx-lm directory of ``gguf``, converted now if the cache has none."""
    src = Path(gguf)
    out = cache_root() / f"{src.stem}-{_key(src)}"
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        proc = lifeline.popen([sys.executable, "-m", "superfluid.plugins.mlx.convert", str(src), str(tmp)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        log, _ = proc.communicate(timeout=timeout)
        if proc.returncode != 0 or not (tmp / "config.json").exists():
            raise RuntimeError(f"converting {src} for mlx_lm.server failed ({proc.returncode}):\n"
                               f"{log.decode(errors='replace')[-2000:]}")
        try:
            os.replace(tmp, out)
        except OSError:  # another run converted it meanwhile
            if not (out / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def run_folder(gguf: str, alias: str) -> Path:
    """The folder ``mlx_lm.server`` runs in: ``ALIAS`` links to the model directory, and
    ``hf-cache`` is the empty Hugging Face cache it lists."""
    model = model_dir(gguf)
    run = model.parent / f"run-{model.name}-{alias}"
    (run / "hf-cache").mkdir(parents=True, exist_ok=True)
    link = run / alias
    if not link.is_symlink() or link.resolve() != model.resolve():
        tmp = run / f".{alias}.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(model)
        os.replace(tmp, link)
    return run


def env(run: Path) -> dict[str, str]:
    """What ``mlx_lm.server`` needs in its environment to stay off the hub."""
    return {"HF_HUB_CACHE": str(run / "hf-cache"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def command(alias: str, port: int, lanes: int) -> list[str]:
    """``python -m mlx_lm server`` on loopback with ``lanes`` decoding (and prefilling) at once:
    the scenario's lanes, as ``-np`` is llama-server's."""
    return [sys.executable, "-m", "mlx_lm", "server", "--model", alias, "--host", "127.0.0.1",
            "--port", str(port), "--decode-concurrency", str(lanes), "--prompt-concurrency", str(lanes)]
