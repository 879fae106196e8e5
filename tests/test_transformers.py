# Hugging Face transformers on this package, unchanged: a small random-weight Llama (GQA, head dim 64) in
# bfloat16 with attn_implementation="flash_attention_2" against the same weights with "sdpa", with and without
# padding (left and right) in the batch: logits at real tokens and every parameter gradient; and greedy generation
# of a few hundred tokens on a left-padded batch, token for token against sdpa. Skipped when
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


PROMPT_LENGTHS = (5, 17, 40)  # one prompt per length, left-padded to the longest in one batch
NEW_TOKENS = 200
# Largest difference allowed between a decode step's logits under flash_attention_2 and sdpa's logits for the same
# prefix. Both run in float16 (logits ~0.45 std for this random model); their difference measured on CPU between two
# attention implementations was 1.2e-3, while a wrong mask or lost padding moves logits by O(0.1-1).
LOGIT_TOL = 0.05


def _teacher_forced_logits(model, sequences, prompt_mask):
    """sdpa's logits for each generated token given the same prefix: one forward over the whole left-padded
    sequences, with the position ids generate() uses (cumulative count of real tokens)."""
    batch, prompt_len = prompt_mask.shape
    mask = torch.cat([prompt_mask, prompt_mask.new_ones(batch, NEW_TOKENS)], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=sequences, attention_mask=mask, position_ids=positions).logits
    return logits[:, prompt_len - 1:prompt_len - 1 + NEW_TOKENS].float()


def test_llama_greedy_generation_padded_batch():
    """Greedy generation of NEW_TOKENS tokens on a left-padded batch of prompts of different lengths with
    flash_attention_2 (prefill through unpad_input / varlen, then decode steps, whose pad_input gets int32 indices):
    at every step the logits match sdpa's for the same prefix and the chosen token is sdpa's choice, up to a tie
    within the two runs' rounding difference. float16 logits tie often (one ulp is ~5e-4 here), so sdpa's own
    generate() may take the other side of a tie and part from there: the step-by-step check against sdpa on our
    prefix covers all NEW_TOKENS steps regardless, and sdpa's generate() must agree up to its first tie."""
    _require(backward=False)
    models = {name: model.half() for name, model in _models().items() if name in ("flash", "sdpa")}
    prompts = [torch.randint(3, VOCAB, (n,), device="cuda") for n in PROMPT_LENGTHS]
    longest = max(PROMPT_LENGTHS)
    input_ids = torch.zeros(len(prompts), longest, dtype=torch.long, device="cuda")
    mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, longest - len(prompt):] = prompt
        mask[row, longest - len(prompt):] = 1
    generate = dict(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS,
                    min_new_tokens=NEW_TOKENS, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        with CountFlashCalls() as counter:
            flash = models["flash"].generate(**generate)
        sdpa = models["sdpa"].generate(**generate)
        forced = _teacher_forced_logits(models["sdpa"], flash.sequences, mask)
    assert counter.calls >= LAYERS * NEW_TOKENS, f"flash_attn ran {counter.calls} times for {NEW_TOKENS} steps"
    assert flash.sequences.shape == (len(prompts), longest + NEW_TOKENS)
    assert torch.equal(flash.sequences[:, :longest], input_ids)
    for step in range(NEW_TOKENS):
        ours = flash.logits[step].float()
        difference = (ours - forced[:, step]).abs().amax(dim=-1)
        assert difference.max() <= LOGIT_TOL, f"step {step}: logits differ from sdpa's by {difference.tolist()}"
        for row in range(len(prompts)):
            pick = int(flash.sequences[row, longest + step])
            best = forced[row, step].max()
            assert forced[row, step, pick] >= best - 2 * difference[row], (
                f"prompt {row}, step {step}: flash_attention_2 picked {pick}, not sdpa's choice nor a tie with it")
    for row in range(len(prompts)):
        differ = (flash.sequences[row, longest:] != sdpa.sequences[row, longest:]).nonzero()
        if len(differ):
            step = int(differ[0])
            theirs = int(sdpa.sequences[row, longest + step])
            ours = flash.logits[step][row].float()
            noise = 2 * (ours - sdpa.logits[step][row].float()).abs().max()
            assert ours.max() - ours[theirs] <= noise, (
                f"prompt {row}: sdpa's generate() took {theirs} at step {step}, not a tie with our pick")
