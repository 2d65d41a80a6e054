"""L2 prefetches a task issues before its waits (`g.task(prefetch=...)`): the weight rows a GEMM
tile reads first, fetched while the rows it multiplies are still in flight (an all-gather, or the
gate/up tiles a down tile waits for). Hints only: `prefetch.global.L2` neither blocks nor writes,
so results never depend on them; under the interpreter (USE_ASM False) they do nothing.
"""
import triton
import triton.language as tl


@triton.jit
def l2_lines(b, ld, K, N, k0, col0, COLS: tl.constexpr, ROWS: tl.constexpr, USE_ASM: tl.constexpr):
    """Rows [k0, k0 + ROWS) and columns [col0, col0 + COLS) of b [K, N] (row stride ld) into L2:
    one prefetch per 128-byte line, addresses clamped into b."""
    if USE_ASM:
        PER: tl.constexpr = 1024 // b.dtype.element_ty.primitive_bitwidth   # elements per 128-byte line
        LINES: tl.constexpr = (COLS + PER - 1) // PER
        rows = tl.minimum(k0 + tl.arange(0, ROWS), K - 1).to(tl.int64)
        cols = tl.minimum(col0 + tl.arange(0, LINES) * PER, N - 1)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [b + rows[:, None] * ld + cols[None, :]],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def weight_cols(w, K, N, j, BLOCK_N: tl.constexpr, PREFETCH_ROWS: tl.constexpr, USE_ASM: tl.constexpr):
    """The first PREFETCH_ROWS rows of w [K, N]'s column tile j: a GEMM tile's first weight loads."""
    l2_lines(w, N, K, N, 0, j * BLOCK_N, BLOCK_N, PREFETCH_ROWS, USE_ASM)


@triton.jit
def gate_up_cols(w_gate_up, H, I, j, BLOCK_N: tl.constexpr, PREFETCH_ROWS: tl.constexpr, USE_ASM: tl.constexpr):
    """The first PREFETCH_ROWS rows of column tile j of both halves of w_gate_up [H, 2I] (gate | up)."""
    l2_lines(w_gate_up, 2 * I, H, I, 0, j * BLOCK_N, BLOCK_N, PREFETCH_ROWS, USE_ASM)
    l2_lines(w_gate_up + I, 2 * I, H, I, 0, j * BLOCK_N, BLOCK_N, PREFETCH_ROWS, USE_ASM)


@triton.jit
def weight_slice_cols(w, K, N, j, s, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PREFETCH_ROWS: tl.constexpr, USE_ASM: tl.constexpr):
    """The first PREFETCH_ROWS rows of contraction slice s of SPLITS (whole BLOCK_K steps, as
    gemm_tiles' slice bodies cut them) of w [K, N]'s column tile j."""
    per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLITS)
    l2_lines(w, N, K, N, s * per * BLOCK_K, j * BLOCK_N, BLOCK_N, PREFETCH_ROWS, USE_ASM)
