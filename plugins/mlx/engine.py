"""The MLX engine adapter as the daemon sees it: tokenizer here, ticks in a worker process."""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Callable

import attrs

from superfluid.core.config import CORE_OPTIONS
from superfluid.core.engine import EngineCapabilities
from superfluid.core.errors import ConfigError
from superfluid.core.worker_process import WorkerEngine, WorkerProcess

from . import kv_width, rope_config, vision, worker
from .constants import HIDDEN_STATE_MODELS
from superfluid.plugins.vocab import open_vocab

log = logging.getLogger("superfluid.mlx")

DEFAULT_MAX_CONTEXT = 8192


def _capabilities(**kw) -> EngineCapabilities:
    names = {f.name for f in attrs.fields(EngineCapabilities)}
    return EngineCapabilities(**{k: v for k, v in kw.items() if k in names})


def _evolved(caps: EngineCapabilities, **kw) -> EngineCapabilities:
    """``caps`` with the fields this core has of ``kw`` changed (an older core lacks the newer)."""
    names = {f.name for f in attrs.fields(EngineCapabilities)}
    return attrs.evolve(caps, **{k: v for k, v in kw.items() if k in names})


class MlxEngine(WorkerEngine):
    engine_name = "mlx"
    implements_rope_scaling = True  # rope_config: the options become the config mlx-lm builds its RoPE from

    def __init__(self, *, model, config):
        missing = [m for m in ("mlx", "mlx_lm") if importlib.util.find_spec(m) is None]
        if missing:  # the worker imports them; the daemon only checks they are there
            raise ConfigError(f"model {model.name!r}: engine 'mlx' needs {' and '.join(missing)} "
                              "(pip install 'superfluid[mlx]')")
        self.model_config = model
        self.path = model.path
        if not (os.path.isfile(self.path) or os.path.isdir(self.path)):
            raise ConfigError(f"model {model.name!r}: file not found: {self.path}")
        if os.path.isdir(self.path) and not os.path.isfile(os.path.join(self.path, "config.json")):
            raise ConfigError(f"model {model.name!r}: {self.path} is not an mlx-lm model directory "
                              "(no config.json)")
        # a SmolVLM directory: images through mlx-vlm; a Gemma 3 / Qwen-VL one: its text half alone
        text_half_only = vision.images_not_served(self.path)
        if text_half_only:
            vision.check_text_half(model.name, self.path)
        self.vision = vision.has_vision(self.path) and not text_half_only
        vocab = open_vocab(self.path, model.name)
        if self.vision or text_half_only:  # the language half's context and width sit in its text_config
            vocab.info = attrs.evolve(vocab.info, **vision.text_facts(self.path))
        try:
            self.kv_bits = kv_width.kv_bits(model, self.path)  # --kv-bits (ConfigError: not for this model)
        except ConfigError:
            vocab.close()
            raise
        self._take_vocab(model, vocab, DEFAULT_MAX_CONTEXT)
        try:
            self.rope = rope_config.overrides(CORE_OPTIONS.of(model), self.path, self.info.n_ctx_train, model.name)
        except (ConfigError, OSError, ValueError) as exc:
            self.vocab.close()
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"model {model.name!r}: engine 'mlx' cannot read config.json for the rope options "
                              f"({exc})") from None
        if self.rope:
            log.info("model %s: rope from the options: %s", model.name, self.rope)
        self.pool_cells = int(CORE_OPTIONS.of(model).kv_pool_cells or 0)  # a shared pool's (pool.py)
        if self.pool_cells and self.pool_cells < self.max_context:
            raise ConfigError(f"model {model.name!r}: kv-pool-cells {self.pool_cells} is below max-context "
                              f"{self.max_context} (one lane must fit)")
        self.capabilities = _capabilities(
            max_lanes=self.max_lanes, context_length=self.max_context, stops_mid_tick=True,
            uniform_decode_rounds=True, supports_parking=True, persists_kv=True, prefix_cache=True,
            aborts_mid_step=False, grammars=True, logprobs=True, logit_bias=True,
            adapters="per_tick",  # one LoRA set a tick (lora.py)
            # pooling needs the final hidden states, read where the model's layout is known
            embeddings=self.vocab.model_type in HIDDEN_STATE_MODELS,
            generates=not CORE_OPTIONS.of(model).embedding_only,
            prefill_step_tokens=worker.PREFILL_STEP,
            tick_target_free_ms=50.0, tick_target_busy_cap_ms=250.0)
        if self.vision:
            self._take_images(model)
        elif text_half_only:
            self.capabilities = _evolved(self.capabilities, images_not_served=text_half_only)
            log.info("model %s: serving text only: %s", model.name, text_half_only)
        self.worker = WorkerProcess(model.name, "MLX worker")

    def _take_images(self, model) -> None:
        """Declare images: the layout the directory gives one (ConfigError without mlx-vlm, or for
        a vision model not served)."""
        def token_id(text: str) -> int | None:
            ids = self.vocab.tokenize(text, add_special=False, parse_special=True)
            return ids[0] if len(ids) == 1 else None

        try:
            layout = vision.layout(model.name, self.path, token_id)
        except ConfigError:
            self.vocab.close()
            raise
        self.info = attrs.evolve(self.info, vision=layout)
        self.capabilities = attrs.evolve(self.capabilities, vision=True)
        log.info("model %s: takes images through mlx-vlm (%s: %d rows an image, %d px tiles)", model.name,
                 layout.family, layout.rows, layout.tile)

    def start(self, progress: Callable[[str], None] | None = None) -> None:
        spec = worker.WorkerSpec(path=self.path, max_lanes=self.max_lanes, max_context=self.max_context,
                                 eog=frozenset(self.vocab.eog), vision=self.vision, pool_cells=self.pool_cells,
                                 image_encoding=CORE_OPTIONS.of(self.model_config).image_encoding,
                                 kv_bits=self.kv_bits, rope=self.rope)
        info = self.worker.start(worker.main, spec, progress, name=f"superfluid-mlx-{self.info.name}")
        # the slots beyond the lanes keep recently finished prefixes; a shared pool's cached
        # prefixes take cells the lanes could use (core.engine.EngineCapabilities says how each is used)
        self.capabilities = _evolved(self.capabilities, spare_slots=max(0, info["n_seq_max"] - self.max_lanes),
                                     shared_pool=bool(info["kv_unified"]))
        log.info("model %s: MLX worker pid %s ready (mlx %s on %s; %s)", self.info.name,
                 info["pid"], info["mlx"], info["device"], info["kv_line"])
