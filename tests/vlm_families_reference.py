"""The transformers reference for the tiny mtmd-family fixtures (tools/fixtures/tiny_gemma3_vlm.py,
tools/fixtures/tiny_qwen_vl.py): transformers' own processor (resize, the prompt's image tokens)
and model (vision tower, projector, ``generate``), on the fixture's own weights.

Qwen-VL's processors carry a video half that needs torchvision, which this venv does not have
(and must not get: it would switch every transformers image processor to another resize). So the
Qwen processor is transformers' class with its video half left out; its image path
(``__call__`` with images, ``replace_image_token``) is transformers' own code, unchanged.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

FAMILIES = ("gemma3", "qwen2.5-vl", "qwen3-vl")


def fixture(family: str) -> dict:
    """The fixture's paths, built on first use (cached under ~/.cache/superfluid/models)."""
    if family == "gemma3":
        from tools.fixtures import tiny_gemma3_vlm

        return tiny_gemma3_vlm.build()
    from tools.fixtures import tiny_qwen_vl

    return tiny_qwen_vl.build(family)


@functools.cache
def model(family: str):
    import torch
    import transformers

    torch.set_num_threads(2)
    cls = {"gemma3": transformers.Gemma3ForConditionalGeneration,
           "qwen2.5-vl": transformers.Qwen2_5_VLForConditionalGeneration,
           "qwen3-vl": transformers.Qwen3VLForConditionalGeneration}[family]
    loaded, info = cls.from_pretrained(str(fixture(family)["hf"]), dtype=torch.float32, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    if problems:  # a tensor the fixture saved under a name transformers does not read back
        raise RuntimeError(f"{family}: the fixture does not load cleanly: {problems}")
    return loaded.eval()


@functools.cache
def processor(family: str):
    hf = str(fixture(family)["hf"])
    if family == "gemma3":
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(hf)
    import transformers
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    base = transformers.Qwen2_5_VLProcessor if family == "qwen2.5-vl" else transformers.Qwen3VLProcessor

    class ImagesOnly(base):
        """transformers' Qwen-VL processor without its video half (see the module's docstring)."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template)

    return ImagesOnly(image_processor=Qwen2VLImageProcessorPil.from_pretrained(hf),
                      tokenizer=AutoTokenizer.from_pretrained(hf))


def image_prompt(family: str, before: str, after: str) -> str:
    """The prompt text transformers' processor takes for one image between ``before`` and
    ``after``."""
    if family == "gemma3":
        return f"{before}<start_of_image>{after}"
    return f"{before}<|vision_start|><|image_pad|><|vision_end|>{after}"


@dataclass
class Reference:
    input_ids: list[int]      # the prompt as the processor expanded it
    image_tokens: int         # its image placeholder tokens
    grid: tuple[int, int]     # Qwen: the merged patch grid (columns, rows); Gemma 3: (rows, 1)
    tokens: list[int]         # greedy continuation
    suppressed: tuple[int, ...]  # end-of-sequence ids kept from winning (min_new_tokens)


def reference(family: str, before: str, after: str, rgb: tuple[int, int, int], size: tuple[int, int],
              n_new: int) -> Reference:
    """transformers' greedy continuation of the prompt with a one-colour image of ``size``
    (width, height)."""
    import torch
    from PIL import Image

    proc, m = processor(family), model(family)
    w, h = size
    image = Image.frombytes("RGB", (w, h), bytes(rgb) * (w * h))
    inputs = proc(text=image_prompt(family, before, after), images=[image], return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    image_id = m.config.image_token_id
    with torch.no_grad():
        out = m.generate(**inputs, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False)
    if family == "gemma3":
        grid = (ids.count(image_id), 1)
    else:
        t, gh, gw = inputs["image_grid_thw"][0].tolist()
        merge = proc.image_processor.merge_size
        grid = (gw // merge, gh // merge)
    eos = m.generation_config.eos_token_id
    eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    return Reference(ids, ids.count(image_id), grid, out[0, len(ids):].tolist(), eos)
