# Hugging Face transformers on this package, unchanged: a small random-weight Llama (GQA, head dim 64) in
# bfloat16 with attn_implementation="flash_attention_2" against the same weights with "sdpa", with and without
# padding (left and right) in the batch: logits at real tokens and every parameter gradient. Skipped when
# transformers is absent; needs a GPU with our CUDA kernels (transformers uses flash_attention_2 only on GPUs).
#
# Tolerance: both runs are bf16 end to end, so they differ by bf16 rounding everywhere (matmuls, norms,
# attention), which 4 layers amplify; a fixed rtol would be either loose or flaky. As in
# helpers.assert_close_fa, the ground truth is the sdpa model in float32 and flash_attention_2 may be at
# most MULT times as far from it as the bf16 sdpa model is (plus the bf16 floor). A wrong mask, wrong
# unpadding or a GQA mix-up moves logits by O(1) and fails by orders of magnitude; MULT = 3 leaves room for
# the two runs' independent rounding adding up with random signs.
import copy

import pytest
import torch

import flash_attn
from helpers import assert_close_fa
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
MULT = 3
HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB = 512, 4, 8, 2, 1000
HEAD_DIM = HIDDEN // HEADS
BATCH, SEQLEN = 3, 48
RIGHT_PAD, LEFT_PAD = 10, 13


def _require(backward):
    if not flash_attn.is_supported("cuda", torch.bfloat16, HEAD_DIM, backward=backward):
        pytest.skip(f"no CUDA {'forward+backward' if backward else 'forward'} kernel for bf16 head_dim={HEAD_DIM}")
    from transformers.utils import is_flash_attn_2_available

    assert is_flash_attn_2_available(), (
        "transformers does not detect flash_attn: it needs the installed distribution's metadata "
        "(pip install --no-build-isolation -e .), not just a PYTHONPATH checkout")


def _models():
    config = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
                                      max_position_embeddings=256)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config).eval()
    state = base.state_dict()
    models = {}
    for name, attn, dtype in (("flash", "flash_attention_2", torch.bfloat16), ("sdpa", "sdpa", torch.bfloat16),
                              ("truth", "sdpa", torch.float32)):
        # A config of its own per model: from_config records the attention implementation on the config object,
        # so a shared one would switch every model to the last implementation asked for.
        model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attn,
                                                              dtype=dtype)
        model.load_state_dict(state)
        models[name] = model.to(device="cuda", dtype=dtype).eval()
    assert models["flash"].config._attn_implementation == "flash_attention_2"
    assert models["sdpa"].config._attn_implementation == "sdpa"
    return models


class CountFlashCalls(TorchDispatchMode):
    """Counts torch.ops.flash_attn.fwd calls: proves transformers really ran this package's kernels."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.ops.flash_attn.fwd.default
        return func(*args, **(kwargs or {}))


def _batch(padding):
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQLEN), device="cuda")
    mask = torch.ones(BATCH, SEQLEN, dtype=torch.long, device="cuda")
    if padding:
        mask[1, SEQLEN - RIGHT_PAD:] = 0  # right padding
        mask[2, :LEFT_PAD] = 0  # left padding
    labels = input_ids.masked_fill(mask == 0, -100)
    return input_ids, (mask if padding else None), mask.bool(), labels


@pytest.mark.parametrize("padding", [False, True], ids=["no_padding", "left_right_padding"])
def test_llama_logits_match_sdpa(padding):
    _require(backward=False)
    models = _models()
    input_ids, mask, real, _ = _batch(padding)
    with torch.no_grad(), CountFlashCalls() as counter:
        logits = {name: model(input_ids=input_ids, attention_mask=mask).logits for name, model in models.items()}
    assert counter.calls == LAYERS, f"expected one flash_attn call per layer, saw {counter.calls}"
    assert_close_fa(logits["flash"][real], logits["truth"][real], logits["sdpa"][real], MULT)


@pytest.mark.parametrize("padding", [False, True], ids=["no_padding", "left_right_padding"])
def test_llama_gradients_match_sdpa(padding):
    _require(backward=True)
    models = _models()
    input_ids, mask, _, labels = _batch(padding)
    grads = {}
    for name, model in models.items():
        model.zero_grad()
        model(input_ids=input_ids, attention_mask=mask, labels=labels).loss.backward()
        grads[name] = {n: p.grad for n, p in model.named_parameters()}
    for param_name, grad in grads["flash"].items():
        assert grad is not None, f"no gradient for {param_name}"
        assert_close_fa(grad, grads["truth"][param_name], grads["sdpa"][param_name], MULT)
