# Hand-picked parametrisation tables shared by the test files: dense shapes (seqlen_q != seqlen_k
# both ways, odd head dims, MHA/GQA/MQA), feature combinations (window, softcap, ALiBi, scale) and
# varlen length lists with zero-length sequences. Kept small so the CPU tier runs in minutes.
import torch

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim)
SHAPES = [
    (2, 1, 1, 4, 4, 64),
    (1, 1, 17, 4, 2, 40),
    (2, 17, 1, 2, 1, 8),
    (2, 17, 113, 4, 4, 33),
    (1, 113, 17, 4, 1, 72),
    (2, 128, 128, 2, 2, 128),
    (1, 113, 255, 4, 2, 200),
    (1, 255, 128, 2, 1, 256),
    (2, 40, 33, 3, 3, 1),
    (1, 128, 1000, 2, 1, 64),
    (1, 1000, 113, 2, 2, 40),
]

FEATURE_SHAPES = [
    (2, 113, 128, 4, 2, 64),
    (2, 128, 60, 4, 1, 40),
]

# name -> keyword arguments of flash_attn_func; "alibi" is "H" or "BH" (shape of the slopes).
FEATURES = {
    "window_8_8": dict(window_size=(8, 8)),
    "window_0_0": dict(window_size=(0, 0)),
    "window_left_only": dict(window_size=(5, -1)),
    "window_right_only": dict(window_size=(-1, 5)),
    "window_causal": dict(window_size=(4, -1), causal=True),
    "softcap": dict(softcap=5.0),
    "softcap_causal": dict(softcap=30.0, causal=True),
    "alibi": dict(alibi="H"),
    "alibi_batch_causal": dict(alibi="BH", causal=True),
    "scale": dict(softmax_scale=0.3),
    "all": dict(alibi="BH", softcap=8.0, window_size=(16, 3), softmax_scale=0.2),
}

FEATURE_DTYPES = [torch.bfloat16, torch.float32]

HEADDIMS = [1, 8, 33, 40, 64, 72, 128, 200, 256]

# (seqlens_q, seqlens_k, nheads, nheads_k, headdim)
VARLEN_CASES = [
    ([5], [7], 2, 2, 64),
    ([3, 0, 17, 1], [5, 2, 17, 0], 4, 2, 40),
    ([113, 1, 64], [128, 255, 7], 2, 1, 72),
    ([17, 128, 0, 40], [17, 128, 9, 33], 4, 4, 33),
    ([255, 33], [1000, 40], 2, 2, 128),
]


def feature_kwargs(name, batch, nheads, device):
    """flash_attn keyword arguments for FEATURES[name] with concrete ALiBi slopes."""
    from helpers import alibi_slopes_for

    kwargs = dict(FEATURES[name])
    alibi = kwargs.pop("alibi", None)
    if alibi == "H":
        kwargs["alibi_slopes"] = alibi_slopes_for((nheads,), device)
    elif alibi == "BH":
        kwargs["alibi_slopes"] = alibi_slopes_for((batch, nheads), device)
    return kwargs
