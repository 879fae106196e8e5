"""Paged KV caches (Dao-AILab's block_table): a cache of num_blocks pages of page_size rows (any page_size >= 1),
sequence b's row p in row p % page_size of page block_table[b, p // page_size]. The block table is checked
(ops.check_index_values) and clamped; flash_attn_with_kvcache hands pages and table to the fwd op (the CUDA decode
kernels read pages in place), the other paths gather the pages into the contiguous layouts the kernels read."""

from __future__ import annotations

import torch

from .ops import check_index_values


def checked_block_table(op: str, block_table: torch.Tensor, batch: int, cache: torch.Tensor,
                        device: torch.device) -> torch.Tensor:
    """block_table (batch, max_blocks) checked against the paged cache (num_blocks, page_size, nheads_k, headdim):
    its shape, dtype (int32 or int64) and values (once per tensor version), returned on `device` as it is."""
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(f"{op}: block_table must be (batch, max_blocks_per_sequence) with batch = {batch}; got "
                         f"shape {tuple(block_table.shape)}")
    if block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: block_table must have dtype torch.int32; got {block_table.dtype}")
    if cache.dim() != 4:
        raise ValueError(f"{op}: a paged cache must be (num_blocks, page_size, nheads_k, headdim); got shape "
                         f"{tuple(cache.shape)}")
    num_blocks = cache.shape[0]
    if block_table.numel() > 0 and num_blocks == 0:
        raise ValueError(f"{op}: block_table indexes an empty paged cache (shape[0] == 0)")
    block_table = block_table.to(device)
    check_index_values(op, "block_table", block_table, 0, num_blocks - 1)
    return block_table


def block_indices(op: str, block_table: torch.Tensor, batch: int, cache: torch.Tensor,
                  device: torch.device) -> torch.Tensor:
    """block_table checked as by checked_block_table, as clamped int64 indices on `device` (for torch indexing)."""
    table = checked_block_table(op, block_table, batch, cache, device)
    return table.to(dtype=torch.int64).clamp(0, max(cache.shape[0] - 1, 0))


def locate(rows: torch.Tensor, pages: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, row in page) of logical rows (batch, n)."""
    return pages.gather(1, rows // page_size), rows % page_size


def gather_sequences(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """(batch, max_blocks * page_size, nheads_k, headdim): every sequence's pages in order."""
    return cache[pages].flatten(1, 2)


def pack_varlen(cache: torch.Tensor, pages: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """The varlen packing (rows cu_seqlens[b] ... cu_seqlens[b + 1] - 1 for sequence b) of the sequences' first
    lengths rows, in a (batch * max_seqlen, nheads_k, headdim) tensor: at least cu_seqlens[-1] rows (when the lengths
    respect max_seqlen) without reading cu_seqlens on the host; rows past cu_seqlens[-1] hold clamped copies that no
    kernel reads."""
    batch, page_size = pages.shape[0], cache.shape[1]
    rows = torch.arange(batch * max_seqlen, device=cache.device)
    starts = cu_seqlens.to(torch.int64)
    sequence = (torch.searchsorted(starts[1:], rows, right=True)).clamp(max=max(batch - 1, 0))
    position = (rows - starts[sequence]).clamp(0, max(pages.shape[1] * page_size - 1, 0))
    page = pages[sequence, position // page_size]
    return cache[page, position % page_size]


def paged_keys_values(name, k_cache, v_cache, block_table, batch, cu_seqlens_k, max_seqlen_k, device):
    """The varlen packing (pack_varlen) of paged caches' keys and values for cu_seqlens_k; errors name `name`."""
    pages = block_indices(name, block_table, batch, k_cache, device)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"{name}: paged k and v must have the same shape; got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    capacity = pages.shape[1] * k_cache.shape[1]
    if max_seqlen_k > capacity:
        raise ValueError(f"{name}: max_seqlen_k={max_seqlen_k} exceeds the {capacity} rows a sequence's "
                         f"{pages.shape[1]} pages of {k_cache.shape[1]} hold")
    return (pack_varlen(k_cache, pages, cu_seqlens_k, max_seqlen_k),
            pack_varlen(v_cache, pages, cu_seqlens_k, max_seqlen_k))
