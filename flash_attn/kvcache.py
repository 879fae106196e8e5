"""flash_attn_with_kvcache: Dao-AILab's decoding entry point (attention of new queries over a KV cache, with
the new keys/values appended to the cache in place), on flash_attn's fwd op. The per-sequence cache lengths go
to the op as seqused_k (the kernels stop at each sequence's length and align masks and ALiBi to it); calls that
need gradients, which seqused_k has none of, fold the lengths into an additive float32 bias instead. Index values
(cache_seqlens, cache_batch_idx, block_table) are checked once per tensor version and clamped on the device, never
read under capture, so the call can be captured in a CUDA graph. Paged caches (block_table) go to the op as pages
and a block table (the CUDA decode kernels read the pages in place; other calls read a gathered copy), or, where
gradients are needed, are gathered here. New rows are appended by one fused op unless gradients are needed, where torch
indexing keeps the autograd graph: kvcache_decode_ (the append and the attention in one op, where the decode kernels can
write the new rows and rotate q themselves, dispatch/fwd_plan.cpp) without cache_batch_idx and cache_leftpad,
kvcache_append_ (write, rotate k and q, count the keys) before the attention otherwise."""

from __future__ import annotations

import torch

from .interface import _window, attention
from .layers.rotary import apply_rotary_emb
from .ops import check_index_values
from .paged_kv import checked_block_table, gather_sequences, locate

_NAME = "flash_attn_with_kvcache"


@torch.library.register_fake("flash_attn::kvcache_append_")
def _append_fake(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, cache_leftpad, rotary_cos,
                 rotary_sin, interleaved, q, q_per_row):
    return k.new_empty((k.shape[0],), dtype=torch.int32), (k.new_empty((0,)) if q is None else torch.empty_like(
        q, memory_format=torch.contiguous_format))


@torch.library.register_fake("flash_attn::kvcache_decode_")
def _decode_fake(q, k_cache, v_cache, k, v, cache_seqlens, block_table, rotary_cos, rotary_sin, interleaved,
                 softmax_scale, window_left, window_right, softcap, alibi_slopes, num_splits):
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=lse_dtype))


def _check_rotary(rotary_cos, rotary_sin, k, cache_rows):
    if rotary_cos is None or rotary_sin is None:
        raise ValueError(f"{_NAME}: rotary_cos and rotary_sin must be given together")
    if k is None:
        raise ValueError(f"{_NAME}: rotary_cos / rotary_sin need the new k and v (rotary applies to the appended keys "
                         "and the queries)")
    if rotary_cos.shape[0] < cache_rows:
        raise ValueError(f"{_NAME}: rotary_cos / rotary_sin have {rotary_cos.shape[0]} rows for a cache of "
                         f"{cache_rows}; they must cover every cache position")


def _rotate_queries(q, rotary_cos, rotary_sin, positions, interleaved, causal_or_local):
    """Dao's rotary rule for the queries: at positions[b] + i when the call is causal or local, otherwise all at
    positions[b] (they are taken as one position)."""
    if causal_or_local:
        return apply_rotary_emb(q, rotary_cos, rotary_sin, interleaved=interleaved, seqlen_offsets=positions)
    batch, seqlen_q, nheads, head_dim = q.shape
    one_position = q.reshape(batch, 1, seqlen_q * nheads, head_dim)
    rotated = apply_rotary_emb(one_position, rotary_cos, rotary_sin, interleaved=interleaved, seqlen_offsets=positions)
    return rotated.reshape(q.shape)


def _rotate(q, k, rotary_cos, rotary_sin, positions, interleaved, causal_or_local):
    """The queries by _rotate_queries, the new keys at their positions positions[b] + i."""
    k = apply_rotary_emb(k, rotary_cos, rotary_sin, interleaved=interleaved, seqlen_offsets=positions)
    return _rotate_queries(q, rotary_cos, rotary_sin, positions, interleaved, causal_or_local), k


def _check_cache_seqlens(cache_seqlens, batch, cache_rows, new_rows):
    """cache_seqlens leaves room for the new rows: an int or a (batch,) tensor of values in [0, rows - new rows]."""
    high = cache_rows - new_rows
    if cache_seqlens is None:
        return
    if isinstance(cache_seqlens, int):
        if not 0 <= cache_seqlens <= high:
            raise ValueError(f"{_NAME}: cache_seqlens={cache_seqlens} must be in [0, {high}] (the cache has "
                             f"{cache_rows} rows and {new_rows} new ones are appended)")
        return
    if cache_seqlens.shape != (batch,):
        raise ValueError(f"{_NAME}: cache_seqlens must be an int or a (batch,) = ({batch},) tensor; got shape "
                         f"{tuple(cache_seqlens.shape)}")
    check_index_values(_NAME, "cache_seqlens", cache_seqlens, 0, high)


def _cache_lengths(cache_seqlens, batch, cache_rows, new_rows, device):
    """(batch,) int64 lengths of the cache before the new rows (checked by _check_cache_seqlens), clamped."""
    if cache_seqlens is None:
        return torch.full((batch,), cache_rows, dtype=torch.int64, device=device)
    if isinstance(cache_seqlens, int):
        return torch.full((batch,), cache_seqlens, dtype=torch.int64, device=device)
    return cache_seqlens.to(device=device, dtype=torch.int64).clamp(0, max(cache_rows - new_rows, 0))


def _direct_seqused_k(cache_seqlens, device, appends, first_row):
    """cache_seqlens itself as the op's seqused_k when it already is one (int32, on q's device) and no rows are
    appended or skipped: a decode step then launches nothing before the attention kernel (the kernels clamp each
    length to [0, cache rows], as the conversion in _cache_lengths would). None otherwise."""
    if appends or first_row is not None or not isinstance(cache_seqlens, torch.Tensor):
        return None
    if cache_seqlens.dtype != torch.int32 or cache_seqlens.device != device:
        return None
    return cache_seqlens


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _bias(lengths, seqlen_q, cache_rows, window, nheads, alibi_slopes):
    """(batch, nheads, seqlen_q, cache_rows) float32: 0 where query i sees key j, -inf elsewhere, minus the
    ALiBi term; queries are aligned to the end of their sequence (key lengths[b] - seqlen_q + i)."""
    device = lengths.device
    rows = torch.arange(seqlen_q, device=device).view(1, -1, 1)
    cols = torch.arange(cache_rows, device=device).view(1, 1, -1)
    distance = rows + (lengths.view(-1, 1, 1) - seqlen_q) - cols  # query position - key position
    visible = cols < lengths.view(-1, 1, 1)
    left, right = window
    if left >= 0:
        visible = visible & (distance <= left)
    if right >= 0:
        visible = visible & (distance >= -right)
    bias = torch.zeros(visible.shape, dtype=torch.float32, device=device).masked_fill(~visible, float("-inf"))
    bias = bias.unsqueeze(1)
    batch = lengths.shape[0]
    if alibi_slopes is None:
        return bias.expand(batch, nheads, seqlen_q, cache_rows)
    slopes = alibi_slopes.to(torch.float32).reshape(-1 if alibi_slopes.dim() == 2 else 1, nheads, 1, 1)
    return bias - slopes * distance.abs().unsqueeze(1).to(torch.float32)


def _left_padding(cache_leftpad, batch, cache_rows, pages, device):
    """(batch,) int64 first cache row of each sequence (checked, clamped), or None without left padding."""
    if cache_leftpad is None:
        return None
    if pages is not None:
        raise NotImplementedError(f"{_NAME}: cache_leftpad together with block_table is not supported (nor in Dao's); "
                                  "leave the padding out of the pages instead")
    if cache_leftpad.shape != (batch,):
        raise ValueError(f"{_NAME}: cache_leftpad must be a (batch,) = ({batch},) tensor; got shape "
                         f"{tuple(cache_leftpad.shape)}")
    check_index_values(_NAME, "cache_leftpad", cache_leftpad, 0, cache_rows)
    return cache_leftpad.to(device=device, dtype=torch.int64).clamp(0, cache_rows)


def _sequence_view(cache, entries, pages, first_row, contiguous):
    """(batch, cache rows, nheads_k, headdim): the cache as each sequence sees it, its key 0 first (the cache itself
    when sequence b is entry b from row 0; otherwise gathered, a copy, through cache_batch_idx, the pages or the left
    padding). Rows past a sequence's end are whatever the cache holds there: the kernels never read them."""
    if pages is not None:
        return gather_sequences(cache, pages)
    if first_row is not None:
        rows = cache.shape[1]
        logical = torch.arange(rows, device=cache.device).view(1, -1)
        physical = (first_row.view(-1, 1) + logical).clamp(max=max(rows - 1, 0))
        return cache[entries.view(-1, 1), physical]
    return cache if contiguous else cache[entries]


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """q (batch, seqlen_q, nheads, headdim) attends over k_cache / v_cache (batch_cache, seqlen_cache, nheads_k,
    headdim): sequence b uses the first cache_seqlens[b] rows of cache entry cache_batch_idx[b] (default b),
    after k / v (batch, seqlen_new, nheads_k, headdim), if given, are written in place at rows
    cache_seqlens[b] ... cache_seqlens[b] + seqlen_new - 1. causal / window_size align the queries to the end of
    each sequence.

    block_table (batch, max_blocks) int32 makes the caches paged, (num_blocks, page_size, nheads_k, headdim) with
    any page_size >= 1: row p of sequence b is row p % page_size of block block_table[b, p // page_size]. CUDA
    decode-shaped calls (at most 16 query rows per KV head, no softcap / ALiBi) read the pages in place, and so does
    the Hopper forward where the pages fit its key blocks (pages of whole key blocks, or of 16+ rows when few query
    tiles re-read them); other calls, and calls that need gradients, read a gathered contiguous copy.

    rotary_cos / rotary_sin (seqlen_ro >= cache rows, rotary_dim / 2), with k / v: the new keys are rotated at
    positions cache_seqlens[b] + i before they are written, the queries at cache_seqlens[b] + i when causal or local
    and at cache_seqlens[b] otherwise (rotary_interleaved: GPT-J pairs). cache_leftpad (batch,): sequence b's keys
    start at cache row cache_leftpad[b] (rows before it are padding), so it has cache_seqlens[b] - cache_leftpad[b]
    keys and its positions (masks, rotary) count from there; gathered into a copy for now; not with block_table.
    num_splits (Dao's semantics): how many parts the CUDA kernel splits each sequence's keys into, merged by a combine
    kernel; 0 lets flash_attn choose, 1 never splits, n > 1 takes n (at most 128); no effect on CPU. Returns out, or
    (out, softmax_lse (batch, nheads, seqlen_q)) when return_softmax_lse. An inference API: with no input requiring grad
    (or under torch.no_grad()) the op reads each sequence's length directly (seqused_k) and visits only its keys;
    otherwise the lengths become a float32 bias of batch x seqlen_q x seqlen_cache (x nheads with ALiBi) that the
    backward can differentiate through."""
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"{_NAME}: num_splits must be an int >= 0 (0 lets flash_attn choose); got {num_splits!r}")
    if (k is None) != (v is None):
        raise ValueError(f"{_NAME}: k and v must be given together or both omitted")
    if k is not None and cache_seqlens is None:
        raise ValueError(f"{_NAME}: appending k / v needs cache_seqlens (where each sequence's new rows go)")
    batch, seqlen_q, nheads = q.shape[0], q.shape[1], q.shape[2]
    pages = None
    page_size = k_cache.shape[1]
    cache_entries, cache_rows = k_cache.shape[0], k_cache.shape[1]
    if block_table is not None:
        if cache_batch_idx is not None:
            raise ValueError(f"{_NAME}: block_table and cache_batch_idx cannot be combined (as in Dao's); put the "
                             "entry's pages in block_table instead")
        pages = checked_block_table(_NAME, block_table, batch, k_cache, q.device)  # as given: int32 or int64
        cache_rows = pages.shape[1] * page_size
    new_rows = 0 if k is None else k.shape[1]
    if new_rows > cache_rows:
        raise ValueError(f"{_NAME}: {new_rows} new rows (k.shape[1]) do not fit a cache of {cache_rows} rows per "
                         "sequence")
    if pages is None and cache_batch_idx is None and cache_entries != batch:
        raise ValueError(f"{_NAME}: k_cache has {cache_entries} entries for a batch of {batch}; pass "
                         "cache_batch_idx to say which cache entry each sequence uses")
    _check_cache_seqlens(cache_seqlens, batch, cache_rows, new_rows)
    entries = None  # the cache entry of each sequence (int64), where an index needs it
    if cache_batch_idx is not None:
        if cache_batch_idx.shape != (batch,):
            raise ValueError(f"{_NAME}: cache_batch_idx must be a (batch,) = ({batch},) tensor; got shape "
                             f"{tuple(cache_batch_idx.shape)}")
        if batch > 0 and cache_entries == 0:
            raise ValueError(f"{_NAME}: cache_batch_idx indexes an empty cache (k_cache.shape[0] == 0)")
        check_index_values(_NAME, "cache_batch_idx", cache_batch_idx, 0, cache_entries - 1)
        entries = cache_batch_idx.to(device=q.device, dtype=torch.int64).clamp(0, max(cache_entries - 1, 0))
    first_row = _left_padding(cache_leftpad, batch, cache_rows, pages, q.device)
    window = _window(window_size, causal)
    rotary = rotary_cos is not None or rotary_sin is not None
    if rotary:
        _check_rotary(rotary_cos, rotary_sin, k, cache_rows)
    grad = _needs_grad(q, k, v, k_cache, v_cache, alibi_slopes, rotary_cos, rotary_sin)
    if pages is not None and grad:
        pages = pages.to(torch.int64).clamp(0, max(cache_entries - 1, 0))  # torch indexing: clamped here
    fused = k is not None and not grad  # the append by kvcache_append_, which has no autograd
    if entries is None and pages is None and ((k is not None and not fused) or first_row is not None):
        entries = torch.arange(batch, device=q.device)
    direct = None if grad else _direct_seqused_k(cache_seqlens, q.device, k is not None, first_row)
    if fused:
        seqlens = (cache_seqlens.to(q.device).contiguous() if isinstance(cache_seqlens, torch.Tensor)
                   else torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device))
    if fused and cache_batch_idx is None and first_row is None:
        # The append and the attention in one op (csrc/api/flash_api.cpp kvcache_decode_ says which kernels write the
        # new rows).
        scale = softmax_scale if softmax_scale is not None else (q.shape[-1] ** -0.5 if q.shape[-1] > 0 else 1.0)
        out, lse = torch.ops.flash_attn.kvcache_decode_(
            q, k_cache, v_cache, k, v, seqlens, None if pages is None else pages.to(torch.int32),
            rotary_cos if rotary else None, rotary_sin if rotary else None, rotary_interleaved, float(scale),
            window[0], window[1], float(softcap), None if alibi_slopes is None else alibi_slopes.to(torch.float32),
            num_splits)
        return (out, lse) if return_softmax_lse else out
    if fused:
        # The queries are rotated in the same launch (Dao's rule, _rotate_queries), into a new tensor.
        direct, q_rotated = torch.ops.flash_attn.kvcache_append_(
            k_cache, v_cache, k, v, seqlens, entries, pages, first_row, rotary_cos if rotary else None,
            rotary_sin if rotary else None, rotary_interleaved, q if rotary else None, window != (-1, -1))
        if rotary:
            q = q_rotated
    lengths = None if direct is not None else _cache_lengths(cache_seqlens, batch, cache_rows, new_rows, q.device)
    if rotary and not fused:
        positions = lengths if first_row is None else (lengths - first_row).clamp(min=0)
        q, k = _rotate(q, k, rotary_cos, rotary_sin, positions, rotary_interleaved, window != (-1, -1))
    if k is not None and not fused:
        rows = lengths.view(-1, 1) + torch.arange(k.shape[1], device=q.device).view(1, -1)
        first, second = (entries.view(-1, 1).expand_as(rows), rows) if pages is None else locate(rows, pages, page_size)
        k_cache[first, second] = k
        v_cache[first, second] = v
        lengths = lengths + k.shape[1]
    contiguous = cache_batch_idx is None
    # Without gradients the op reads the pages itself (in place on CUDA decode calls, a gathered copy otherwise);
    # its values were checked by checked_block_table, and the kernels clamp them.
    table = pages.to(torch.int32) if pages is not None and not grad else None
    keys = k_cache if table is not None else _sequence_view(k_cache, entries, pages, first_row, contiguous)
    values = v_cache if table is not None else _sequence_view(v_cache, entries, pages, first_row, contiguous)
    if first_row is not None and direct is None:
        lengths = (lengths - first_row).clamp(min=0)  # the keys each sequence sees, from its first row
    if direct is None and _needs_grad(q, keys, values, alibi_slopes):
        bias = _bias(lengths, seqlen_q, cache_rows, window, nheads, alibi_slopes)
        out, lse, _ = attention(q, keys, values, softmax_scale=softmax_scale, softcap=softcap, attn_bias=bias,
                                bottom_right=False, num_splits=num_splits)
    else:
        slopes = None if alibi_slopes is None else alibi_slopes.to(torch.float32)
        seqused_k = direct if direct is not None else lengths.to(torch.int32)
        out, lse, _ = attention(q, keys, values, softmax_scale=softmax_scale, window=window, softcap=softcap,
                                alibi_slopes=slopes, seqused_k=seqused_k, num_splits=num_splits, block_table=table)
    return (out, lse) if return_softmax_lse else out
