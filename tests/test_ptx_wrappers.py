# Kernel-primitive tier: one-tile GPU tests of the inline-PTX wrappers (csrc/include/flash_attn/ptx/) through
# the test-only op torch.ops.flash_attn._ptx_selftest. Expected per-lane register contents are computed here
# from the layouts documented in mma_sm80.h / ldmatrix_sm80.h (g = lane // 4, t = lane % 4), so a wrong
# wrapper or a wrong layout comment fails. Inputs are random, distinct and non-zero. Skipped without a GPU or
# without CUDA code in the build.
import pytest
import torch

import flash_attn
from flash_attn._native import C

LANES = 32
TILE = 16  # mma M and K, ldmatrix.x4 tile side
MMA_N = 8
CP_ASYNC_CHUNKS = 64
CP_ASYNC_WORDS = 4  # 16 bytes as int32
RED_FLOATS = 4  # red.global.add.v4.f32
WORD_MASK = 0xFFFFFFFF
HALF_MASK = 0xFFFF


def _has_cuda_build():
    return any(kernel["device"] == "cuda" for kernel in flash_attn.built_kernels())


def _lacks_sm90_code():
    """No GPU, a GPU before Hopper, or kernels running from compute_80 PTX (which has no sm90 instructions)."""
    return not torch.cuda.is_available() or C.loaded_code(torch.cuda.current_device())[0] < 90


pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and _has_cuda_build() and torch.cuda.get_device_capability() >= (8, 0)),
    reason="needs an sm80+ GPU and a build with CUDA code",
)

LANE = torch.arange(LANES)
G = LANE // 4
T = LANE % 4


def selftest(name, *inputs):
    return torch.ops.flash_attn._ptx_selftest(name, [x.cuda() for x in inputs])


def distinct_int16(*shape):
    """Distinct non-zero 16-bit values, so a lane that received the wrong element cannot match by chance."""
    count = 1
    for n in shape:
        count *= n
    values = torch.randperm(2 ** 15 - 1)[:count] + 1
    sign = torch.where(torch.rand(count) < 0.5, -1, 1)
    return (values * sign).to(torch.int16).view(*shape)


def pack(low, high):
    """The 32-bit register holding two 16-bit values, low first (as int64 in [0, 2**32))."""
    return (low.to(torch.int64) & HALF_MASK) | ((high.to(torch.int64) & HALF_MASK) << 16)


def as_words(x):
    return x.cpu().to(torch.int64) & WORD_MASK


def fragment_regs(matrices, transposed):
    """(32, len(matrices)): lane l holds {row g, cols 2t, 2t+1} of each 8x8 matrix (of its transpose)."""
    regs = []
    for m in matrices:
        m = m.t() if transposed else m
        regs.append(pack(m[G, 2 * T], m[G, 2 * T + 1]))
    return torch.stack(regs, dim=1)


def lane_matrices(tile, row_of_lane, col_of_lane, count):
    """The 8x8 matrices ldmatrix reads when lanes 8i..8i+7 give the row addresses of matrix i."""
    return [torch.stack([tile[row_of_lane(8 * i + r), col_of_lane(8 * i + r):col_of_lane(8 * i + r) + 8]
                         for r in range(8)]) for i in range(count)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mma_m16n8k16(dtype):
    a = torch.randn(TILE, TILE).to(dtype)
    b_nk = torch.randn(MMA_N, TILE).to(dtype)  # B (k x n) stored K-major, as the attention kernels hold K
    c = torch.randn(TILE, MMA_N)
    (d,) = selftest("mma_m16n8k16", a, b_nk, c)
    expected = a.float() @ b_nk.float().t() + c  # bf16/fp16 products are exact in fp32
    torch.testing.assert_close(d.cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_pack2(dtype):
    values = distinct_int16(2 * LANES).view(dtype)
    (packed,) = selftest("pack2", values)
    bits = values.view(torch.int16)
    torch.testing.assert_close(as_words(packed), pack(bits[0::2], bits[1::2]), rtol=0, atol=0)


def test_ldmatrix_x2_trans():
    tile = distinct_int16(TILE, MMA_N)  # (k, n), row k addressed by lane k
    (regs,) = selftest("ldmatrix_x2_trans", tile)
    expected = fragment_regs(lane_matrices(tile, lambda lane: lane, lambda lane: 0, 2), transposed=True)
    torch.testing.assert_close(as_words(regs), expected, rtol=0, atol=0)
    # The B fragment of mma_sm80.h: b0 = (k 2t..2t+1, n g), b1 = (k 2t+8.., n g).
    b_frag = torch.stack([pack(tile[2 * T, G], tile[2 * T + 1, G]), pack(tile[2 * T + 8, G], tile[2 * T + 9, G])], 1)
    torch.testing.assert_close(expected, b_frag, rtol=0, atol=0)


@pytest.mark.parametrize("transposed", [False, True])
def test_ldmatrix_x4(transposed):
    tile = distinct_int16(TILE, TILE)
    (regs,) = selftest("ldmatrix_x4_trans" if transposed else "ldmatrix_x4", tile)
    # Lane l addresses row l % 16 at column 8 * (l // 16): matrices (rows 0-7 | 8-15) x (cols 0-7 | 8-15).
    matrices = lane_matrices(tile, lambda lane: lane % TILE, lambda lane: 8 * (lane // TILE), 4)
    expected = fragment_regs(matrices, transposed)
    assert not torch.equal(expected, fragment_regs(matrices, not transposed))
    torch.testing.assert_close(as_words(regs), expected, rtol=0, atol=0)
    if transposed:
        # Tile as B (k x n): registers are (b0, b1) of n-tile 0 then of n-tile 1.
        layout = [pack(tile[2 * T + k0, G + n0], tile[2 * T + k0 + 1, G + n0]) for n0 in (0, 8) for k0 in (0, 8)]
    else:
        # Tile as A (m x k): a0 = (g, 2t..), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..).
        layout = [pack(tile[G + m0, 2 * T + k0], tile[G + m0, 2 * T + k0 + 1]) for k0 in (0, 8) for m0 in (0, 8)]
    torch.testing.assert_close(expected, torch.stack(layout, 1), rtol=0, atol=0)


def test_cp_async_16_with_zero_fill():
    src = torch.randint(1, 2 ** 31 - 1, (CP_ASYNC_CHUNKS, CP_ASYNC_WORDS), dtype=torch.int32)
    valid = (torch.rand(CP_ASYNC_CHUNKS) < 0.6).to(torch.int32)
    valid[0], valid[1], valid[LANES], valid[LANES + 1] = 1, 0, 1, 0  # both kinds in both commit groups
    (dst,) = selftest("cp_async_16", src, valid)
    expected = torch.where(valid.bool().unsqueeze(1), src, torch.zeros_like(src))
    torch.testing.assert_close(dst.cpu(), expected, rtol=0, atol=0)


def test_cp_async_4_with_zero_fill():
    words = torch.randint(1, 2 ** 31 - 1, (LANES,), dtype=torch.int32)
    valid = (torch.rand(LANES) < 0.6).to(torch.int32)
    valid[0], valid[1] = 1, 0
    (dst,) = selftest("cp_async_4", words, valid)
    torch.testing.assert_close(dst.cpu(), torch.where(valid.bool(), words, torch.zeros_like(words)), rtol=0, atol=0)


@pytest.mark.skipif(_lacks_sm90_code(), reason="red.global.add.v4.f32 needs code compiled for sm90")
def test_red_add_v4_f32_plain_and_predicated():
    base, added, extra = (torch.randn(LANES, RED_FLOATS) for _ in range(3))
    valid = (torch.rand(LANES) < 0.5).to(torch.int32)
    valid[0], valid[1] = 1, 0
    (dst,) = selftest("red_add_v4_f32", base, added, extra, valid)
    # Same fp32 additions in the same order: base + added, then + extra where valid.
    expected = torch.where(valid.bool().unsqueeze(1), (base + added) + extra, base + added)
    torch.testing.assert_close(dst.cpu(), expected, rtol=0, atol=0)


@pytest.mark.skipif(_lacks_sm90_code(), reason="stmatrix needs code compiled for sm90")
def test_stmatrix_x4_inverts_the_fragment_layout():
    halves = distinct_int16(LANES, 4, 2)
    regs = pack(halves[..., 0], halves[..., 1])
    regs = torch.where(regs >= 2 ** 31, regs - 2 ** 32, regs).to(torch.int32)
    (tile,) = selftest("stmatrix_x4", regs)
    # Matrix i (lanes 8i..8i+7 address its rows): rows 8 (i % 2).., cols 8 (i // 2)..; lane l holds its
    # {row g, cols 2t, 2t + 1}.
    expected = torch.zeros(TILE, TILE, dtype=torch.int16)
    for i in range(4):
        rows = (i % 2) * MMA_N + G
        cols = (i // 2) * MMA_N + 2 * T
        expected[rows, cols] = halves[:, i, 0]
        expected[rows, cols + 1] = halves[:, i, 1]
    torch.testing.assert_close(tile.cpu(), expected, rtol=0, atol=0)


@pytest.mark.skipif(_lacks_sm90_code(), reason="griddepcontrol needs code compiled for sm90")
def test_griddep_dependent_starts_early_and_waits_for_the_primary():
    words = torch.randint(1, 2 ** 31 - 1, (LANES,), dtype=torch.int32)
    # The first call loads the dependent kernel (CUDA lazy module loading), which waits for the running primary: in
    # the first call of a process the primary timed out (H200, 547 ms), in every later one the dependent started.
    (first,) = selftest("griddep", words)
    torch.testing.assert_close(first.cpu()[:LANES], words, rtol=0, atol=0)
    (dst,) = selftest("griddep", words)
    dst = dst.cpu()
    # After wait_for_primary_grid() the primary's writes are visible ...
    torch.testing.assert_close(dst[:LANES], words, rtol=0, atol=0)
    # ... and the dependent started while the primary ran (the primary saw it before writing them): the launch
    # attribute and allow_dependent_launch() took effect, so the wait above was needed.
    assert dst[LANES].item() == 1


@pytest.mark.skipif(_lacks_sm90_code(), reason="thread-block clusters need code compiled for sm90")
def test_cluster_ctas_read_each_others_shared_memory():
    ctas, vec = 4, 4  # ptx_selftest.h kClusterCtas, kClusterVec
    values = torch.randn(ctas, LANES, vec)
    (dst,) = selftest("cluster_exchange", values)
    dst = dst.cpu()
    # One cluster along z: rank r is CTA z = r ...
    torch.testing.assert_close(dst[:, :, 0], torch.arange(ctas, dtype=torch.float32)[:, None].expand(ctas, LANES),
                               rtol=0, atol=0)
    # ... and each lane reads its neighbour's (rank r + 1) staged word and 16-byte vector.
    neighbour = values.roll(-1, dims=0)
    torch.testing.assert_close(dst[:, :, 1], neighbour[:, :, 0], rtol=0, atol=0)
    torch.testing.assert_close(dst[:, :, 2:], neighbour, rtol=0, atol=0)


def test_unknown_selftest_name_is_rejected():
    with pytest.raises(RuntimeError, match="unknown self test"):
        selftest("ldmatrix_x8", torch.zeros(1))


BULK_ROWS, BULK_COLS, BULK_BOX = 40, 48, 16  # csrc/sm80/ptx_selftest.h kBulkRows, kBulkCols, kBulkBox{Rows,Cols}


@pytest.mark.skipif(_lacks_sm90_code(), reason="the bulk tensor reduction needs code compiled for sm90")
@pytest.mark.parametrize("col, row", [(16, 8), (32, 32), (0, 0)])
def test_bulk_reduce_add_2d(col, row):
    """One 16 x 16 box added at (col, row) of a 40 x 48 fp32 matrix through a tensor map; rows past the matrix (the
    (32, 32) box reaches row 47) are skipped, and nothing outside the box changes."""
    base, box = torch.randn(BULK_ROWS, BULK_COLS), torch.randn(BULK_BOX, BULK_BOX)
    (dst,) = selftest("bulk_reduce_add_2d", base, box, torch.tensor([col, row], dtype=torch.int32))
    expected = base.clone()
    rows = min(BULK_BOX, BULK_ROWS - row)
    expected[row:row + rows, col:col + BULK_BOX] += box[:rows]
    torch.testing.assert_close(dst.cpu(), expected, rtol=0, atol=0)


@pytest.mark.skipif(_lacks_sm90_code(), reason="the bulk tensor load and store need code compiled for sm90")
@pytest.mark.parametrize("load, store", [((16, 8), (0, 0)), ((32, 32), (16, 30)), ((0, 0), (32, 24))])
def test_bulk_copy_2d(load, store):
    """A 16 x 16 box of a 40 x 48 fp32 matrix loaded with tma_load_2d (rows past the matrix arrive as zeros) and stored
    with bulk_store_2d into another (rows past it are not written): the box replaces its place and nothing else."""
    src, base = torch.randn(BULK_ROWS, BULK_COLS), torch.randn(BULK_ROWS, BULK_COLS)
    (dst,) = selftest("bulk_copy_2d", src, base, torch.tensor([*load, *store], dtype=torch.int32))
    box = torch.zeros(BULK_BOX, BULK_BOX)
    rows = min(BULK_BOX, BULK_ROWS - load[1])
    box[:rows] = src[load[1]:load[1] + rows, load[0]:load[0] + BULK_BOX]
    expected = base.clone()
    rows = min(BULK_BOX, BULK_ROWS - store[1])
    expected[store[1]:store[1] + rows, store[0]:store[0] + BULK_BOX] = box[:rows]
    torch.testing.assert_close(dst.cpu(), expected, rtol=0, atol=0)


# csrc/sm80/ptx_selftest.h kTma*: the source (batch, rows, heads, cols) and the box (rows x cols of one head).
TMA_BATCH, TMA_ROWS, TMA_HEADS, TMA_COLS = 2, 40, 3, 96
TMA_BOX_ROWS, TMA_BOX_COLS = 32, 64


def _tma_box(src, col, head, row, batch):
    """The box at (col, head, row, batch): in-range elements from src, zeros past its rows and columns."""
    box = torch.zeros(TMA_BOX_ROWS, TMA_BOX_COLS, dtype=src.dtype)
    rows = max(0, min(TMA_BOX_ROWS, TMA_ROWS - row))
    cols = max(0, min(TMA_BOX_COLS, TMA_COLS - col))
    box[:rows, :cols] = src[batch, row:row + rows, head, col:col + cols]
    return box


@pytest.mark.skipif(_lacks_sm90_code(), reason="the TMA tile load needs code compiled for sm90")
@pytest.mark.parametrize("first, second", [((0, 1, 0, 0), (64, 2, 16, 1)), ((32, 0, 8, 1), (0, 2, 39, 0))])
def test_tma_load_4d(first, second):
    """Two 32 x 64 boxes of one head loaded one after the other into one 128-byte-swizzled shared tile through one
    mbarrier (phases 0 and 1), read back through SegmentSwizzledRows: each equals its slice of the source, with zeros
    where it reaches past the last row (40) or column (96), and none of the first box left in the second."""
    src = distinct_int16(TMA_BATCH, TMA_ROWS, TMA_HEADS, TMA_COLS)
    where = torch.tensor([first, second], dtype=torch.int32)
    (dst,) = selftest("tma_load_4d", src, where)
    dst = dst.cpu()
    for i, coords in enumerate((first, second)):
        assert torch.equal(dst[i], _tma_box(src, *coords)), f"box {i} at {coords}"


WGMMA_M = WGMMA_N = WGMMA_K = 64


@pytest.mark.skipif(_lacks_sm90_code(), reason="wgmma needs code compiled for sm_90a")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", ["wgmma_ss", "wgmma_rs", "wgmma_ss_mn"])
def test_wgmma_tile(dtype, form):
    """One warpgroup, four k16 steps of m64n64k16 through 128-byte-swizzled shared tiles and descriptors, in the three
    forms the attention kernels use: S = Q.K^T (both operands K-major), O += P.V (A from accumulator-shaped registers,
    B read MN-major) and the backward's dQ = dS.K (both MN-major). The fp32 result equals the exact product: small
    integers / 4 keep every product and sum exact, so a misplaced element cannot hide in rounding."""
    a = (torch.randint(-8, 9, (WGMMA_M, WGMMA_K)) / 4).to(dtype)
    b = (torch.randint(-8, 9, (WGMMA_K, WGMMA_N)) / 4).to(dtype)
    want = {"wgmma_ss": a.double() @ b.double().T, "wgmma_rs": a.double() @ b.double(),
            "wgmma_ss_mn": a.double().T @ b.double()}[form]
    (d,) = selftest(form, a, b)
    assert torch.equal(d.cpu().double(), want)
