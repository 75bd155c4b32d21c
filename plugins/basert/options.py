"""basert's options, read back typed: ``OPTIONS.of(model).speculate``. (``--kv-pool-cells``, the paged
pool's tokens, and ``--kv-bits``, the KV width, are the core's: every engine reads them.)"""

from superfluid.core.errors import ConfigError
from superfluid.core.kv_context_options import parse_kv_bits  # noqa: F401  (re-exported: kv-bits moved to the core)
from superfluid.core.options import Option, PluginOptions, in_range

MAX_DRAFT = 16


def parse_speculate(text: str) -> int:
    """``off`` (or 0), ``on`` (4 drafted tokens) or a number of drafted tokens per step."""
    text = text.strip().lower()
    if text in ("off", "false", "no", "0"):
        return 0
    if text in ("on", "true", "yes", "ngram"):
        return 4
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"expected off, on or a number of drafted tokens 1-{MAX_DRAFT}, got {text!r}") from None


def one_of(*allowed):
    def check(value):
        return None if value in allowed else f"must be one of {', '.join(map(str, allowed))}"
    return check


OPTIONS = PluginOptions("basert", [
    Option("speculate", int, 0, "basert: prompt-lookup speculative decoding (every decoding lane): off, on (4) or "
           f"the tokens drafted per step (1-{MAX_DRAFT}); drafts are verified in the same forward pass and "
           "turned off under load and at low acceptance", in_range(0, MAX_DRAFT), model_scoped=True,
           metavar="off|on|N", parse=parse_speculate),
    Option("device", str, "auto", "basert: the torch device (auto: cuda, then mps, then cpu; or cpu, cuda, "
           "cuda:N, mps)", model_scoped=True, metavar="DEVICE"),
    Option("dtype", str, "auto", "basert: weights and KV dtype (auto: bf16 on CUDA, fp32 elsewhere; or bf16, "
           "fp32)", one_of("auto", "bf16", "fp32"), model_scoped=True, metavar="DTYPE"),
    Option("attention", str, "auto", "basert: the attention of decode-only steps: auto (flex on CUDA with "
           "16-bit KV, else sdpa), sdpa (each row's pages gathered, then PyTorch's scaled_dot_product_attention) "
           "or flex (FlexAttention reading the pages in place; compiled on CUDA, a slow reference elsewhere)",
           one_of("auto", "sdpa", "flex"), model_scoped=True, metavar="auto|sdpa|flex"),
    Option("cuda-graphs", str, "auto", "basert: replay decode-only steps as one CUDA graph per batch size "
           "(1, 2, 4, ... lanes), captured at startup: auto (on with flex attention on CUDA), on or off",
           one_of("auto", "on", "off"), model_scoped=True, metavar="auto|on|off"),
    Option("kv-memory", float, 0.5, "basert: share of the device's free memory (after the weights) the paged KV "
           "pool may take, capped at lanes x context", in_range(0.01, 0.95), model_scoped=True,
           metavar="FRACTION"),
])
