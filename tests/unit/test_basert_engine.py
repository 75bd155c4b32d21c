"""The basert engine in-process, configured as ``superfluid serve`` configures it (the real CLI
parser and plugin manager, ``superfluid.core.cli.load``), on tiny random Hugging Face directories:
what fails at startup and how (an architecture basert does not implement, a KV pool that cannot
hold one lane, a device that is not there), that a failed start leaves nothing loaded, and what a
started engine tells the scheduler (capabilities) and ``/health`` (``describe``)."""

from __future__ import annotations

import json
import shutil

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from superfluid.core.cli import load  # noqa: E402
from superfluid.core.errors import ConfigError  # noqa: E402
from superfluid.core.settings import SchedulerSettings  # noqa: E402
from superfluid.plugins.basert import create_engine  # noqa: E402
from superfluid.plugins.basert.shape import SUPPORTED_ARCHS  # noqa: E402
from superfluid.plugins.qos.planner import tick_target_s  # noqa: E402

VOCAB = 49152  # SmolLM2's tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=2)
MAX_CONTEXT = 1 << 20  # the largest --max-context the CLI accepts


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """SmolLM2's tokenizer files, as the mlx converter writes them from the default GGUF."""
    pytest.importorskip("mlx.core")
    from superfluid.core.default_model import default_model_path
    from superfluid.plugins.mlx.convert import convert

    out = tmp_path_factory.mktemp("smollm2_mlx")
    convert(default_model_path(), str(out))
    return out


def save_dir(path, model, tokenizer_dir):
    model.save_pretrained(path, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, path / name)
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, tokenizer_dir):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                      tie_word_embeddings=True, **IDS)
    return save_dir(tmp_path_factory.mktemp("llama"), transformers.LlamaForCausalLM(config), tokenizer_dir)


@pytest.fixture(scope="module")
def wide_kv_dir(tmp_path_factory, tokenizer_dir):
    """A llama whose KV is wide (4 KV heads of 256: 16 KiB a token in fp32) and whose training
    context is the CLI's largest, so one lane's full context needs 16 GiB of KV."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, head_dim=256,
                                      max_position_embeddings=MAX_CONTEXT, tie_word_embeddings=True, **IDS)
    return save_dir(tmp_path_factory.mktemp("wide_kv"), transformers.LlamaForCausalLM(config), tokenizer_dir)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, tokenizer_dir):
    """A real (tiny) GPT-2 checkpoint: a tokenizer basert could use, an architecture it does not run."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=1024,
                                     bos_token_id=1, eos_token_id=2)
    return save_dir(tmp_path_factory.mktemp("gpt2"), transformers.GPT2LMHeadModel(config), tokenizer_dir)


def engine_for(path, *flags: str, name: str = "tiny"):
    """A BasertEngine configured exactly as ``superfluid serve --model PATH --engine basert FLAGS``."""
    config, _pm = load(["serve", "--model", str(path), "--model-name", name, "--engine", "basert",
                        "--threads", "1", *flags])
    model = config.models[0]
    assert model.engine == "basert"
    return create_engine(model=model, config=config)


def test_unsupported_architecture_fails_naming_model_arch_and_the_supported(gpt2_dir):
    assert json.loads((gpt2_dir / "config.json").read_text())["model_type"] == "gpt2"
    with pytest.raises(ConfigError) as info:
        engine_for(gpt2_dir, "--max-context", "512", name="gpt-tiny")
    message = str(info.value)
    assert "'gpt-tiny'" in message and "gpt2" in message
    for arch in SUPPORTED_ARCHS:
        assert arch in message


def test_kv_memory_too_small_for_one_lane_fails_and_frees_everything(wide_kv_dir):
    engine = engine_for(wide_kv_dir, "--max-context", str(MAX_CONTEXT), "--max-batch", "1", "--kv-memory", "0.01",
                        "--device", "cpu")
    assert engine._bytes_per_token(_shape(wide_kv_dir)) == 2 * 2 * 4 * 256 * 4  # 16 GiB for one lane
    progress: list[str] = []
    with pytest.raises(ConfigError) as info:
        engine.start(progress.append)
    message = str(info.value)
    assert "kv-memory" in message and "'tiny'" in message and str(MAX_CONTEXT) in message
    assert progress  # it did get as far as loading the weights ...
    assert engine.model is None and engine.pool is None and engine.runner is None  # ... and let them go
    assert engine.constrainer is None
    assert engine.describe()["state"] == "stopped" and "kv_blocks" not in engine.describe()
    engine.close()


def _shape(path):
    from superfluid.plugins.basert.shape import ModelShape

    return ModelShape.from_hf_config(json.loads((path / "config.json").read_text()))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_device_on_a_cpu_machine_fails_naming_the_device(llama_dir):
    with pytest.raises(ConfigError) as info:
        engine_for(llama_dir, "--max-context", "1024", "--device", "cuda")
    message = str(info.value)
    assert "'cuda'" in message and "'tiny'" in message and "not available" in message


def test_started_engine_reports_capabilities_and_its_pool(llama_dir):
    engine = engine_for(llama_dir, "--max-context", "1024", "--max-batch", "2", "--device", "cpu",
                        "--kv-bits", "8", "--tick-target-ms", "2000")
    before = engine.describe()
    assert before["state"] == "stopped" and "kv_blocks" not in before
    engine.start()
    try:
        caps = engine.capabilities
        assert caps.tick_target_free_ms == 250
        assert caps.max_lanes == 2 and caps.context_length == 1024
        settings = SchedulerSettings(tick_target_ms=engine.model_config["tick-target-ms"])
        assert settings.tick_target_ms == 2000
        assert tick_target_s(caps, settings, admitting=False) == 2.0  # --tick-target-ms 2000 is not capped
        assert tick_target_s(caps, settings, admitting=True) == 0.25
        info = engine.describe()
        assert info["engine"] == "basert" and info["state"] == "ready"
        assert info["device"] == "cpu" and info["dtype"] == "float32" and info["kv_bits"] == 8
        assert info["kv_blocks"] == 2 * 1024 // info["block_size"]  # lanes x context, nothing more
        assert info["kv_blocks_used"] == 0
        ids = engine.tokenize("<|im_start|>user\nhi<|im_end|>")
        assert ids[0] == 1 and ids[-1] == 2  # the directory's tokenizer, special tokens parsed
    finally:
        engine.close()
    assert engine.model is None and engine.pool is None and engine.describe()["state"] == "stopped"


def test_full_width_kv_reports_the_width_of_its_dtype(llama_dir):
    """--kv-bits 0 keeps the KV in the model's dtype: fp32 on the CPU, so 32 bits a value (the
    pool's bytes per token say so), not 16."""
    from superfluid.plugins.basert.kv_pool import PagedKV

    engine = engine_for(llama_dir, "--max-context", "512", "--max-batch", "1", "--device", "cpu", "--dtype", "fp32")
    engine.start()
    try:
        info = engine.describe()
        assert info["dtype"] == "float32" and info["kv_blocks"] == 512 // info["block_size"]
        shape = engine.model.shape
        per_value = PagedKV.bytes_per_token(shape.n_layers, shape.n_kv_heads, shape.head_dim, engine.dtype, 0) / (
            shape.n_layers * 2 * shape.n_kv_heads * shape.head_dim)
        assert per_value == 4
        assert info["kv_bits"] == 8 * per_value
    finally:
        engine.close()


@pytest.mark.parametrize("flags,words", [
    (("--attention", "flex", "--kv-bits", "8"), ["attention flex", "kv-bits 8", "'tiny'"]),
    (("--cuda-graphs", "on", "--device", "cpu"), ["cuda-graphs on", "CUDA", "cpu", "'tiny'"]),
    (("--attention", "sdpa", "--cuda-graphs", "on"), ["cuda-graphs on", "'tiny'"]),
    (("--attention", "paged"), ["attention", "auto, sdpa, flex"]),
])
def test_decode_flags_the_device_or_kv_width_cannot_honour_fail_at_startup(llama_dir, flags, words):
    with pytest.raises((ConfigError, SystemExit)) as info:
        engine_for(llama_dir, "--max-context", "512", *flags)
    if info.type is ConfigError:
        for word in words:
            assert word in str(info.value)


def test_flex_attention_on_the_cpu_decodes_as_the_gather_path_does(llama_dir):
    """``--attention flex`` on the CPU (the reference FlexAttention, no graphs): the pool holds a
    scratch block, decode-only steps go through the decoder, and greedy tokens match sdpa's."""
    from superfluid.core.request import SamplingParams
    from superfluid.core.tick import LanePlan, TickPlan

    tokens = {}
    for attention in ("sdpa", "flex"):
        engine = engine_for(llama_dir, "--max-context", "512", "--max-batch", "2", "--device", "cpu",
                            "--attention", attention)
        engine.start()
        try:
            info = engine.describe()
            assert info["attention"] == attention and info["cuda_graphs"] is False
            assert (engine.runner.decoder is not None) == (attention == "flex")
            assert (engine.pool.scratch_block is not None) == (attention == "flex")
            plan = TickPlan(lanes=[LanePlan(slot=0, pos=0, feed=list(range(10, 40)), sample=True, max_new=12,
                                            reset=True, sampling=SamplingParams(temperature=0.0), ignore_eos=True)])
            tokens[attention] = engine.run_tick(plan).lanes[0].tokens
            if attention == "flex":  # its decode steps went through the decoder's bucket of one
                assert int(engine.runner.decoder.buckets[1].decode.positions[0]) == 30 + 10
        finally:
            engine.close()
    assert len(tokens["flex"]) == 12 and tokens["flex"] == tokens["sdpa"]


def test_auto_picks_flex_and_graphs_on_cuda_with_16_bit_kv_only():
    from superfluid.plugins.basert.device import resolve_decode

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_decode("auto", "auto", cuda, 0, "m") == ("flex", True)
    assert resolve_decode("auto", "auto", cuda, 8, "m") == ("sdpa", False)
    assert resolve_decode("auto", "off", cuda, 0, "m") == ("flex", False)
    assert resolve_decode("sdpa", "auto", cuda, 0, "m") == ("sdpa", False)
    assert resolve_decode("auto", "auto", cpu, 0, "m") == ("sdpa", False)
    assert resolve_decode("flex", "auto", cpu, 0, "m") == ("flex", False)
