"""A vision-language model an engine serves as text only: the reason the engine gives reaches the
400 as it is (the core names no engine), the families are named from the files' own words, and
the config fields mlx-lm needs from a transformers 5 directory are filled in. The served
behaviour is tests/server/test_vlm_families_other_engines.py's."""

from __future__ import annotations

import json

import attrs
import pytest

from superfluid.core.errors import ConfigError, InvalidRequest
from superfluid.plugins import vision_families as families


def test_an_engine_reason_is_the_400_for_an_image_and_a_text_model_keeps_its_own(make):
    loop, engine = make()
    with pytest.raises(InvalidRequest) as plain:
        loop.check_takes_images()
    assert plain.value.code == "model_not_multimodal"
    reason = families.images_not_served("someengine", "Gemma 3", "projector gemma3")
    engine.capabilities = attrs.evolve(engine.capabilities, images_not_served=reason)
    with pytest.raises(InvalidRequest) as told:
        loop.check_takes_images(param="input")
    err = told.value
    assert (err.status, err.code, err.param) == (400, "images_not_served", "input")
    assert err.message == f"model {loop.name!r} takes no images here: {reason}"
    assert reason.startswith("someengine does not serve Gemma 3 images (projector gemma3); llama.cpp does")


def test_family_names_come_from_each_file_kind():
    assert families.family("qwen2_5_vl") == "Qwen2.5-VL"
    assert families.family("qwen3vl_merger", families.PROJECTOR_FAMILIES) == "Qwen3-VL"
    assert families.family("llava") == "'llava'"  # an unknown family in the file's own word


def _directory(tmp_path, config: dict):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_basert_names_a_vision_half_it_has_no_tower_for(tmp_path):
    pytest.importorskip("torch")
    from superfluid.plugins.basert import vision

    gemma = _directory(tmp_path / "g", {"model_type": "gemma3", "vision_config": {"patch_size": 8}})
    smol = _directory(tmp_path / "s", {"model_type": "idefics3", "vision_config": {"patch_size": 8}})
    assert vision.not_served(gemma, name="m") == ("Gemma 3", "model_type gemma3")
    assert vision.not_served(smol, name="m") is None


def test_basert_names_an_mmproj_projector_it_has_no_tower_for(tmp_path):
    gguf = pytest.importorskip("gguf")
    pytest.importorskip("torch")
    from superfluid.plugins.basert import vision

    def mmproj(projector: str) -> str:
        path = str(tmp_path / f"{projector}.gguf")
        w = gguf.GGUFWriter(path, "clip")
        w.add_bool("clip.has_vision_encoder", True)
        w.add_string("clip.projector_type", projector)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    assert vision.not_served(mmproj("qwen2.5vl_merger"), name="m") == ("Qwen2.5-VL", "projector qwen2.5vl_merger")
    assert vision.not_served(mmproj("idefics3"), name="m") is None


def test_mlx_serves_the_text_half_of_the_families_mlx_lm_runs(tmp_path):
    from superfluid.plugins.mlx import vision

    qwen = _directory(tmp_path / "q", {"model_type": "qwen3_vl", "vision_config": {"patch_size": 8}})
    smol = _directory(tmp_path / "s", {"model_type": "idefics3", "vision_config": {"patch_size": 8}})
    text = _directory(tmp_path / "t", {"model_type": "qwen3"})
    assert vision.images_not_served(qwen).startswith("mlx does not serve Qwen3-VL images (model_type qwen3_vl)")
    assert vision.images_not_served(smol) is None and vision.images_not_served(text) is None


@pytest.mark.parametrize("layers,refused", [(2, True), (6, False)])
def test_mlx_refuses_a_gemma3_shallower_than_mlx_lm_runs(tmp_path, layers, refused):
    from superfluid.plugins.mlx import vision

    path = _directory(tmp_path, {"model_type": "gemma3", "vision_config": {"patch_size": 8},
                                 "text_config": {"num_hidden_layers": layers}})
    if refused:
        with pytest.raises(ConfigError, match="mlx does not serve Gemma 3 models .*--engine basert"):
            vision.check_text_half("m", path)
    else:
        vision.check_text_half("m", path)


def test_transformers5_rope_and_vocab_fields_are_filled_in_for_mlx_lm():
    from superfluid.plugins.mlx.loader import transformers5_fields

    qwen = {"model_type": "qwen2_5_vl", "text_config": {"rope_parameters": {"rope_theta": 10000.0}}}
    assert transformers5_fields(qwen)["text_config"]["rope_theta"] == 10000.0
    gemma = {"model_type": "gemma3", "text_config": {"vocab_size": 99, "rope_parameters": {
        "full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}}}}
    fields = transformers5_fields(gemma)
    assert fields["vocab_size"] == 99
    assert (fields["text_config"]["rope_theta"], fields["text_config"]["rope_local_base_freq"]) == (1e6, 1e4)
    stated = {"model_type": "qwen2", "rope_theta": 5.0, "rope_parameters": {"rope_theta": 7.0}}
    assert transformers5_fields(stated) == {}  # a base the config states is kept
