"""flash_attn: exact FlashAttention for PyTorch, a drop-in for Dao-AILab's flash_attn 2.x API and for
torch.nn.functional.scaled_dot_product_attention, on CPU (C++) and NVIDIA GPUs (CUDA kernels)."""

__version__ = "2.8.0"

from .interface import (  # noqa: E402
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from .kvcache import flash_attn_with_kvcache  # noqa: E402
from .ops import built_kernels, is_supported  # noqa: E402
from .sdpa import scaled_dot_product_attention  # noqa: E402

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "scaled_dot_product_attention",
    "built_kernels",
    "is_supported",
]
