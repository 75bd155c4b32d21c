"""Vision-language families by the names their files give them, and the words an engine uses
when it serves such a model's language half but not its images.

A model's family is known before a weight is read: a Hugging Face directory's ``model_type``, an
mmproj GGUF's ``clip.projector_type``, a text GGUF's ``general.architecture``. An engine that
has no vision tower for a family still serves the text half where it can, and says so in the
400 an image request gets (``EngineCapabilities.images_not_served``, which the core passes on
without knowing any engine); where it cannot load the model at all, its ConfigError names the
family and the engine that serves it. The names live here, in one place, so every engine says
the same thing about the same family."""

from __future__ import annotations

#: HF ``model_type`` of a vision-language model -> its family's name
HF_FAMILIES = {"idefics3": "SmolVLM / Idefics3", "smolvlm": "SmolVLM", "gemma3": "Gemma 3",
               "qwen2_vl": "Qwen2-VL", "qwen2_5_vl": "Qwen2.5-VL", "qwen3_vl": "Qwen3-VL",
               "llava_next": "LLaVA-NeXT"}
#: llama.cpp's mmproj ``clip.projector_type`` -> the family
PROJECTOR_FAMILIES = {"idefics3": "SmolVLM / Idefics3", "gemma3": "Gemma 3", "qwen2vl_merger": "Qwen2-VL",
                      "qwen2.5vl_merger": "Qwen2.5-VL", "qwen3vl_merger": "Qwen3-VL"}
#: llama.cpp's text GGUF ``general.architecture`` of a language half no text model shares -> the family
GGUF_ARCH_FAMILIES = {"qwen2vl": "Qwen2-VL / Qwen2.5-VL", "qwen3vl": "Qwen3-VL"}
#: the engine that serves these families' images (llama.cpp's mtmd reads their mmproj), as
#: people and as ``--engine`` name it
IMAGES_ELSEWHERE, IMAGES_ELSEWHERE_FLAG = "llama.cpp", "llamacpp"
#: families whose images llama.cpp does not serve either, and who does (LLaVA-NeXT: libmtmd lays
#: its images out otherwise than transformers, so llama.cpp refuses it)
SERVED_BY = {"LLaVA-NeXT": "they are served from the model's Hugging Face directory with --engine basert "
                           "(llama.cpp refuses them)"}


def family(kind: str, table: dict[str, str] = HF_FAMILIES) -> str:
    """The family's name, or the file's own word for it when the family is not known here."""
    return table.get(kind, repr(kind))


def images_not_served(engine: str, family_name: str, what: str) -> str:
    """The reason an engine gives for taking no images of a model it serves as text:
    ``basert does not serve Gemma 3 images (projector gemma3); llama.cpp does``. ``what``
    names the file's evidence (``projector gemma3``, ``model_type qwen3_vl``)."""
    elsewhere = SERVED_BY.get(family_name) or (f"{IMAGES_ELSEWHERE} does (--engine {IMAGES_ELSEWHERE_FLAG}, "
                                                "the model's GGUF with its mmproj)")
    return f"{engine} does not serve {family_name} images ({what}); {elsewhere}; text chat is served here"


def not_loadable(engine: str, family_name: str, what: str, instead: str) -> str:
    """A ConfigError's words for a vision-language model an engine cannot load at all."""
    return f"{engine} does not serve {family_name} models ({what}); {instead}"
