"""The basert engine as the daemon sees it: in-process, so the model's thread runs each tick
itself (no worker, no pipe; a crash is the daemon's, and there is nothing to restart).

Startup does everything that can fail before any memory is committed: the device and dtype
exist, the flags are in range, the architecture is one basert implements (read from the file's
metadata before a single weight is read); then the weights load (validated on the host before
they move to the device) and the KV pool is sized from the memory left. Any failure frees what
was loaded, so no model is half-loaded.

A SmolVLM / Idefics3 takes images: its vision half (:mod:`.vision`) is the mmproj GGUF beside a
text GGUF (or set with ``mmproj``), or the vision weights in its Hugging Face directory; a
LLaVA-NeXT too, from its Hugging Face directory (:mod:`.llava_next`). The
constructor reads only its shape (to lay an image out in a prompt, ``ModelInfo.vision``); the
tower loads with the language model in :meth:`BasertEngine.start`. A Gemma 3 or Qwen-VL serves
its language half alone: images get a 400 naming the family (``images_not_served``)."""

from __future__ import annotations

import gc
import json
import logging
import os
from typing import Callable

import attrs
import psutil
import torch

from superfluid.core.config import CORE_OPTIONS
from superfluid.core.constrain import Constrainer
from superfluid.core.engine import EngineCapabilities
from superfluid.core.errors import ConfigError
from superfluid.core.media import find_mmproj
from superfluid.core.stop_flag import StopFlag
from superfluid.core.vocab_engine import VocabEngine
from superfluid.plugins import rank_head
from superfluid.plugins import vision_families as families
from superfluid.plugins.vocab import HFVocab, open_vocab
from superfluid.plugins.vocab.constraints import lltokenizer

from . import model as models
from . import rope, vision
from .decode_graph import DecodeGraphs
from .device import free_memory, resolve_decode, resolve_device, resolve_dtype
from .kv_pool import PagedKV
from .options import OPTIONS
from .runner import PREFILL_STEP, BasertRunner
from .shape import HF_MODEL_TYPES, SUPPORTED_ARCHS, hf_architecture

log = logging.getLogger("superfluid.basert")

DEFAULT_MAX_CONTEXT = 8192
BLOCK_SIZE = 16


def architecture(vocab, config: dict | None = None, name: str = "config.json") -> str:
    """The model's architecture as the file states it (GGUF ``general.architecture``, HF
    ``model_type``; a vision-language model's: its language half's)."""
    if isinstance(vocab, HFVocab):  # HF names (gemma3_text) mapped to basert's
        if config is not None:
            return hf_architecture(config, name)
        return HF_MODEL_TYPES.get(vocab.model_type, vocab.model_type)
    return getattr(vocab, "arch", "") or ""


class BasertEngine(VocabEngine):
    engine_name = "basert"
    implements_rope_scaling = True  # rope.py applies --rope-scaling, --rope-scale, --yarn-* at start

    def __init__(self, *, model, config):
        self.model_config = model
        self.name = model.name
        self.path = model.path
        if not (os.path.isfile(self.path) or os.path.isdir(self.path)):
            raise ConfigError(f"model {model.name!r}: file not found: {self.path}")
        if os.path.isdir(self.path) and not os.path.isfile(os.path.join(self.path, "config.json")):
            raise ConfigError(f"model {model.name!r}: {self.path} is not a Hugging Face model directory "
                              "(no config.json)")
        core, own = CORE_OPTIONS.of(model), OPTIONS.of(model)
        self.device = resolve_device(own.device, model.name)
        self.dtype = resolve_dtype(own.dtype, self.device)
        self.speculate = int(own.speculate or 0)
        self.kv_bits = int(core.kv_bits or 0)  # a core option: every engine reads it
        self.kv_memory = float(own.kv_memory or 0.5)
        attention, graphs = own.attention, own.cuda_graphs
        self.attention, self.cuda_graphs = resolve_decode(attention, graphs, self.device, self.kv_bits, model.name)
        self.decode_auto = attention == "auto" and graphs == "auto"  # may fall back to sdpa
        self.decode_capture_s = 0.0
        self.pool_cells = int(core.kv_pool_cells or 0)
        vocab = open_vocab(self.path, model.name)
        hf_config = None
        try:
            if isinstance(vocab, HFVocab):
                with open(os.path.join(self.path, "config.json")) as f:
                    hf_config = json.load(f)
            self.arch = architecture(vocab, hf_config, model.name)
        except (OSError, ValueError, ConfigError) as exc:
            vocab.close()
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"model {model.name!r}: unreadable config.json ({exc})") from None
        if self.arch in families.GGUF_ARCH_FAMILIES:  # a Qwen-VL GGUF's language half
            vocab.close()
            raise ConfigError(f"model {model.name!r}: " + families.not_loadable(
                "basert", families.GGUF_ARCH_FAMILIES[self.arch], f"GGUF architecture {self.arch}",
                "serve the GGUF with --engine llamacpp (text and, with its mmproj, images), or the Hugging "
                "Face directory with basert (text)"))
        if self.arch not in SUPPORTED_ARCHS:
            vocab.close()
            raise ConfigError(f"model {model.name!r}: architecture {self.arch or 'unknown'!r} is not one "
                              f"basert implements ({', '.join(SUPPORTED_ARCHS)})")
        self._take_vocab(model, vocab, DEFAULT_MAX_CONTEXT)
        self.threads = core.threads or psutil.cpu_count(logical=False) or os.cpu_count() or 1
        self.capabilities = EngineCapabilities(
            max_lanes=self.max_lanes, context_length=self.max_context, stops_mid_tick=True,
            uniform_decode_rounds=True, supports_parking=True, persists_kv=True, prefix_cache=True,
            aborts_mid_step=False, grammars=True, logprobs=True, logit_bias=True, embeddings=True,
            generates=not core.embedding_only, prefill_step_tokens=PREFILL_STEP,
            adapters="per_row",  # rows of different LoRA sets in one step (lora.py)
            # the spec's basert targets: 250 ms while a lane is free or finishing, --tick-target-ms
            # (uncapped) while every lane is busy
            tick_target_free_ms=250.0, tick_target_busy_cap_ms=60000.0)
        # a reranker GGUF (rank pooling and its head): how its pairs become prompts, for /v1/rerank (rank.py)
        self.info = attrs.evolve(self.info, rerank=rank_head.rerank_format(self.path, model.name, self.vocab))
        self.vision_src, self.vision_shape = self._vision(model, core.mmproj)
        self.image_encoding = core.image_encoding
        self.stop_flag = StopFlag()  # in-process: the runner reads it between steps
        self.model = None
        self.vision = None  # the vision tower, once started (a model that takes images)
        self.pool: PagedKV | None = None
        self.runner: BasertRunner | None = None
        self.constrainer = None

    def _vision(self, model, configured: str | None) -> tuple[str | None, vision.VisionShape | None]:
        """Where the vision half is and its shape (None, None: a text-only model), and the
        layout it gives an image in a prompt (``info.vision``). An mmproj set with ``mmproj``
        serves either kind of model file; a GGUF's is otherwise the one beside it, an HF
        directory's its own vision weights. Any problem closes the vocabulary: a model that fails
        here holds nothing."""
        try:
            if os.path.isdir(self.path):  # (find_mmproj would look beside the directory, not in it)
                if configured and not os.path.isfile(configured):
                    raise FileNotFoundError(f"mmproj file not found: {configured}")
                mmproj = configured
            else:
                mmproj = find_mmproj(self.path, configured)
            src = vision.source(self.path, mmproj)
            if src is None:
                return None, None
            other = vision.not_served(src, name=model.name)
            if other is not None:  # a family this tower is not: its language half serves text alone
                reason = families.images_not_served("basert", *other)
                self.capabilities = attrs.evolve(self.capabilities, images_not_served=reason)
                log.info("model %s: serving text only: %s", model.name, reason)
                return None, None
            shape = vision.read_shape(src, name=model.name)

            def token_id(text: str) -> int | None:
                ids = self.vocab.tokenize(text, add_special=False, parse_special=True)
                return ids[0] if len(ids) == 1 else None

            layout = shape.layout(token_id)
        except (OSError, ValueError, ConfigError) as exc:
            self.vocab.close()
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"model {model.name!r}: {exc}") from None
        self.info = attrs.evolve(self.info, vision=layout)
        self.capabilities = attrs.evolve(self.capabilities, vision=True)
        log.info("model %s: takes images through %s (%s: %d rows an image, %d px tiles)", model.name, src,
                 layout.family, layout.rows, layout.tile)
        return src, shape

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self, progress: Callable[[str], None] | None = None) -> None:
        if self.device.type == "cpu":
            torch.set_num_threads(self.threads)
        if progress:
            progress(f"loading {self.name}: weights on {self.device}")
        try:
            self.model = models.load(self.path, name=self.name, device=self.device, dtype=self.dtype)
            rope.apply(self.model, CORE_OPTIONS.of(self.model_config), self.name, self.device)  # --rope-*, --yarn-*
            if self.vision_src is not None:
                if progress:
                    progress(f"loading {self.name}: vision tower on {self.device}")
                self.vision = vision.load(self.vision_src, name=self.name, device=self.device, dtype=self.dtype,
                                          out_size=self.model.shape.hidden_size)
            self.pool = self._new_pool(self.model.shape)
            # in-process: the daemon's own vocabulary serves the token masks too (no second load)
            n_vocab = self.model.shape.vocab_size
            self.constrainer = Constrainer(lltokenizer(self.vocab, n_vocab), n_vocab, tuple(sorted(self.vocab.eog)))
        except BaseException:
            self._free()
            raise
        decoder = self._new_decoder(progress)
        self.runner = BasertRunner(self.model, self.pool, set(self.vocab.eog), self.stop_flag, device=self.device,
                                 speculate=self.speculate, constrainer=self.constrainer, decoder=decoder,
                                 encoder=vision.encoder(self.vision) if self.vision is not None else None,
                                 image_encoding=self.image_encoding)
        self.runner.rank_head = rank_head.RankHead.from_gguf(self.path) if self.info.rerank else None
        shape = self.model.shape
        log.info("model %s: basert on %s (%s, %s), %d layers, KV pool %d blocks x %d tokens (%s KV, %.0f MiB), "
                 "speculation %s", self.name, self.device, str(self.dtype).replace("torch.", ""), shape.arch,
                 shape.n_layers, self.pool.n_blocks, self.pool.block_size,
                 f"{self.kv_bits}-bit" if self.kv_bits else "full-width",
                 self.pool.n_blocks * self.pool.block_size * self._bytes_per_token(shape) / 2**20,
                 f"{self.speculate} tokens" if self.speculate else "off")
        log.info("model %s: decode attention %s, CUDA graphs %s (%.1f s to compile and capture)", self.name,
                 self.attention, "on" if self.cuda_graphs else "off", self.decode_capture_s)

    def _new_decoder(self, progress) -> DecodeGraphs | None:
        """The decode-only path (flex attention, CUDA graphs), compiled and captured now so that
        no tick pays for it. If that fails where the flags left the choice to basert (auto), it
        says why and serves on the gather path; where they asked for it, the model does not start."""
        if self.attention != "flex":
            return None
        try:
            if progress and self.cuda_graphs:
                progress(f"loading {self.name}: capturing CUDA graphs for decode steps")
            decoder = DecodeGraphs(self.model, self.pool, max_lanes=self.max_lanes, max_context=self.max_context,
                                   graphs=self.cuda_graphs)
            with torch.inference_mode():
                self.decode_capture_s = decoder.warm_up()
            return decoder
        except Exception as exc:
            if not self.decode_auto:
                self._free()
                raise ConfigError(f"model {self.name!r}: attention flex / cuda-graphs failed to start on "
                                  f"{self.device}: {exc}") from exc
            log.warning("model %s: flex attention and CUDA graphs failed to start (%s); decoding on the "
                        "gather path (attention sdpa)", self.name, exc)
            self.attention, self.cuda_graphs = "sdpa", False
            return None

    def _bytes_per_token(self, shape) -> float:
        return PagedKV.bytes_per_token(shape.n_layers, shape.n_kv_heads, shape.head_dim, self.dtype, self.kv_bits)

    def _new_pool(self, shape) -> PagedKV:
        """A pool for every lane's full context (or ``kv-pool-cells``), as far as ``kv-memory`` of
        the free memory allows; at least one lane's context, else the model does not start."""
        per_token = self._bytes_per_token(shape)
        wanted = self.pool_cells or self.max_lanes * self.max_context
        fits = int(free_memory(self.device) * self.kv_memory / per_token)
        cells = min(wanted, fits)
        if cells < self.max_context:
            raise ConfigError(f"model {self.name!r}: the KV pool fits {cells} tokens in {self.kv_memory:.0%} of "
                              f"the free memory on {self.device}, under one lane's context ({self.max_context}); "
                              "lower max-context, or raise kv-memory or kv-bits")
        if cells < wanted:
            log.info("model %s: KV pool holds %d of the %d tokens lanes x context asks for; lanes beyond "
                     "it queue", self.name, cells, wanted)
        n_blocks = -(-cells // BLOCK_SIZE)
        return PagedKV(n_layers=shape.n_layers, n_kv_heads=shape.n_kv_heads, head_dim=shape.head_dim,
                       n_blocks=n_blocks, block_size=BLOCK_SIZE, dtype=self.dtype, device=self.device,
                       bits=self.kv_bits, scratch=self.attention == "flex")

    def _free(self) -> None:
        if self.runner is not None and hasattr(self.runner.media, "close"):
            self.runner.media.close()  # its image encoder's thread
        self.runner = None
        self.pool = None
        self.model = None
        self.vision = None
        self.constrainer = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def close(self) -> None:
        self._free()
        super().close()

    # ---- the daemon's side ------------------------------------------------------------------

    def run_tick(self, plan):
        with torch.inference_mode():
            return self.runner.run(plan)

    def describe(self) -> dict:
        out = {"engine": "basert", "state": "ready" if self.runner else "stopped", "device": str(self.device),
               "dtype": str(self.dtype).replace("torch.", ""), "kv_bits": self.kv_bits or torch.finfo(self.dtype).bits,
               "speculate": self.speculate, "attention": self.attention, "cuda_graphs": self.cuda_graphs}
        if self.pool is not None:
            per_cell = self._bytes_per_token(self.model.shape)  # with its quantized pages' scales
            out.update(kv_blocks=self.pool.n_blocks, block_size=self.pool.block_size,
                       kv_blocks_used=self.pool.used_blocks(), bytes_per_cell=round(per_cell, 2),
                       kv_bytes=int(self.pool.n_blocks * self.pool.block_size * per_cell))
        if self.vision_shape is not None:
            out["vision"] = {"source": self.vision_src, "tile": self.vision_shape.image_size,
                             "rows": self.vision_shape.rows}
            if self.runner is not None and self.runner.media is not None:
                out["vision"]["encoded"] = self.runner.media.encodes
        if self.runner is not None and self.runner.gate is not None:
            gate = self.runner.gate
            out["speculation"] = {"drafted": gate.drafted, "accepted": gate.accepted,
                                  "acceptance_rate": round(gate.acceptance_rate, 4)}
        return out
