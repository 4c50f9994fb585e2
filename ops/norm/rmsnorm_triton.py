"""Triton RMSNorm: forward, fused residual add, backward, and the torch.library ops that launch them.

Arithmetic is Hugging Face's Qwen3RMSNorm (see rmsnorm_torch.py): squares summed in fp32, the
normalized row rounded to the input dtype, then multiplied by the weight in fp32 and rounded once
to the promoted output dtype (a product of two 16-bit floats is exact in fp32, so this rounds as
torch's `weight * normalized` does).

One route: every call goes through the torch op `qwen3_ops::rms_norm` or
`qwen3_ops::fused_add_rms_norm`, which launches its kernel with `kernel[grid](...)`. The ops have
fake implementations (torch.compile sees one opaque node per norm); where autograd records the
call, an autograd.Function wraps the op, and its backward is the op `qwen3_ops::rms_norm_backward`.

Rows whose leading dims collapse into at most two strides are read in place (a column slice, the
q part of a fused qkv projection viewed as (B, S, H, head_dim)). Outputs are contiguous.

Triton binds and specializes every argument of every launch on the host, so a kernel takes only
what the call uses: an absent residual, sum or rstd is None, and so is the row layout of a
contiguous input (its rows are then addressed as `row * D`).
"""

import contextlib
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..triton_helpers import round_to

# One pass holds the whole row in registers up to this width; wider rows take the looped kernel.
MAX_ONE_PASS_D = 16384
# The backward keeps x, dy, w and the dweight accumulator of a row in registers.
MAX_BACKWARD_D = 8192
SUM_BLOCK_ROWS, SUM_BLOCK_D = 32, 64  # tile of the dweight reduction over the backward's partials


@triton.jit
def _row_start(row, layout):
    """Offset of row `row` of a tensor whose rows are (outer, inner), layout = (inner, stride_outer,
    stride_inner) (see row_layout)."""
    return (row // layout[0]) * layout[1] + (row % layout[0]) * layout[2]


@triton.jit(do_not_specialize=["n_rows", "eps"])
def _forward_one_pass(
    X, R, W, Y, S, RSTD, n_rows, D, eps, x_rows, r_rows,
    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, FULL_ROW: tl.constexpr,
):
    """BLOCK_ROWS rows per program, each held whole in registers. R (the residual) and S (the sum
    written out) are None without a residual; RSTD is None unless the backward needs it. x_rows,
    r_rows: the row layout (row_layout) of a strided x or residual, None where it is a plain
    (rows, D) tensor, addressed without the layout's 64-bit divisions.
    FULL_ROW: D == BLOCK_D, so no column mask and a row stride known at compile time (fewer
    instructions per element, which shows in kernels of ~20-40 us)."""
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < n_rows
    if FULL_ROW:
        mask = tl.broadcast_to(row_ok[:, None], (BLOCK_ROWS, BLOCK_D))
        out_rows = rows[:, None] * BLOCK_D + cols[None, :]
        w = tl.load(W + cols).to(tl.float32)
    else:
        mask = row_ok[:, None] & (cols < D)[None, :]
        out_rows = rows[:, None] * D + cols[None, :]
        w = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
    if x_rows is None:
        x = tl.load(X + out_rows, mask=mask, other=0.0)
    else:
        x = tl.load(X + _row_start(rows, x_rows)[:, None] + cols[None, :], mask=mask, other=0.0)
    if R is not None:
        if r_rows is None:
            res = tl.load(R + out_rows, mask=mask, other=0.0)
        else:
            res = tl.load(R + _row_start(rows, r_rows)[:, None] + cols[None, :], mask=mask, other=0.0)
        # The sum is rounded to its dtype, as `residual + hidden_states` is in the HF decoder.
        x = round_to(x.to(tl.float32) + res.to(tl.float32), S.dtype.element_ty)
        tl.store(S + out_rows, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)
    if RSTD is not None:
        tl.store(RSTD + rows, rstd, mask=row_ok)
    # x has the dtype of the row being normalized (the sum's, with a residual), HF's rounding dtype.
    normalized = round_to(xf * rstd[:, None], x.dtype).to(tl.float32)
    tl.store(Y + out_rows, round_to(normalized * w[None, :], Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["eps"])
def _forward_looped(
    X, R, W, Y, S, RSTD, eps, x_rows, r_rows,
    D: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One row per program, two passes over it in BLOCK_D chunks: sum of squares, then normalize.
    Pass one asks L2 to keep the row (evict_last) so that pass two re-reads it from cache.
    D is compiled in, as Inductor does (its loop bounds are then constants); a model has one or
    two widths this wide, so few compiles. Arguments as _forward_one_pass's."""
    row = tl.program_id(0).to(tl.int64)
    out_row = row * D
    if x_rows is None:
        x_row = X + out_row
    else:
        x_row = X + _row_start(row, x_rows)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, D, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        ok = cols < D
        x = tl.load(x_row + cols, mask=ok, other=0.0, eviction_policy="evict_last")
        if R is not None:
            if r_rows is None:
                r_row = R + out_row
            else:
                r_row = R + _row_start(row, r_rows)
            res = tl.load(r_row + cols, mask=ok, other=0.0, eviction_policy="evict_first")
            x = round_to(x.to(tl.float32) + res.to(tl.float32), S.dtype.element_ty)
            tl.store(S + out_row + cols, x, mask=ok)
        xf = x.to(tl.float32)
        acc += xf * xf
    rstd = tl.rsqrt(tl.sum(acc, axis=0) / D + eps)
    if RSTD is not None:
        tl.store(RSTD + row, rstd)
    for start in range(0, D, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        ok = cols < D
        if R is not None:
            x = tl.load(S + out_row + cols, mask=ok, other=0.0, eviction_policy="evict_first")
        else:
            x = tl.load(x_row + cols, mask=ok, other=0.0, eviction_policy="evict_first")
        normalized = round_to(x.to(tl.float32) * rstd, x.dtype).to(tl.float32)
        w = tl.load(W + cols, mask=ok, other=0.0, eviction_policy="evict_last").to(tl.float32)
        tl.store(Y + out_row + cols, round_to(normalized * w, Y.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["n_rows", "rows_per_program"])
def _backward(
    DY, X, W, RSTD, DS, DX, DW_PARTIAL, n_rows, D, rows_per_program, x_rows,
    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """dx and per-program fp32 partial sums of dweight for a contiguous range of rows.

    Follows autograd through HF's module: the gradient reaching the normalized value is
    dy * w rounded to y's dtype (the multiply's backward runs in that dtype); dweight is
    sum(dy * normalized_rounded) accumulated in fp32. DS, where not None, is the gradient of the
    residual-sum output of the fused op (the sum also feeds the next residual branch), added to dx.
    x_rows: x's row layout, None where contiguous.
    """
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    for start in range(first, last, BLOCK_ROWS):
        rows = start + tl.arange(0, BLOCK_ROWS)
        row_ok = rows < last
        mask = row_ok[:, None] & col_ok[None, :]
        out_rows = rows[:, None] * D + cols[None, :]
        if x_rows is None:
            x = tl.load(X + out_rows, mask=mask, other=0.0).to(tl.float32)
        else:
            x = tl.load(X + _row_start(rows, x_rows)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + out_rows, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        normalized = x * rstd[:, None]
        dw += tl.sum(dy * round_to(normalized, X.dtype.element_ty).to(tl.float32), axis=0)
        dn = round_to(dy * w[None, :], DY.dtype.element_ty).to(tl.float32)
        mean_dn_n = tl.sum(dn * normalized, axis=1) / D
        dx = (dn - normalized * mean_dn_n[:, None]) * rstd[:, None]
        if DS is not None:
            dx += tl.load(DS + out_rows, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + out_rows, round_to(dx, DX.dtype.element_ty), mask=mask)
    tl.store(DW_PARTIAL + pid * D + cols, dw, mask=col_ok)


@triton.jit(do_not_specialize=["n_partials"])
def _sum_partials(PARTIAL, DW, n_partials, D, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """dweight: the (n_partials, D) fp32 partial sums of _backward added in a fixed order (so the
    result is deterministic for a given shape) and rounded once to the weight's dtype."""
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    acc = tl.zeros([BLOCK_ROWS, BLOCK_D], dtype=tl.float32)
    for start in range(0, n_partials, BLOCK_ROWS):
        rows = start + tl.arange(0, BLOCK_ROWS)
        mask = (rows < n_partials)[:, None] & col_ok[None, :]
        acc += tl.load(PARTIAL + rows[:, None] * D + cols[None, :], mask=mask, other=0.0)
    tl.store(DW + cols, round_to(tl.sum(acc, axis=0), DW.dtype.element_ty), mask=col_ok)


# ----------------------------------------------------------------------------- launch configs


@dataclass(frozen=True)
class OnePass:
    """`rows` whole rows per program, held in registers (_forward_one_pass)."""
    rows: int
    warps: int


@dataclass(frozen=True)
class Looped:
    """One row per program, read in `chunk`-wide pieces twice, the second time from L2 (_forward_looped)."""
    chunk: int
    warps: int


# Forward launch per padded row size in bytes, measured on the H200 under do_bench's L2 flush
# (docs/benchmarks/rmsnorm-notes.md). Rows up to 1 KiB are packed 2 KiB to a program, 4 warps.
FORWARD_LAUNCHES = {
    2048: OnePass(rows=2, warps=2),  # one 2 KiB row per program moves too few bytes to hide latency
    4096: OnePass(rows=1, warps=4),
    # Plain rows of 8-32 KiB: a row held in registers takes so many that few warps fit on an SM;
    # two passes with the second from L2 keep more loads in flight, as Inductor's kernels do.
    8192: Looped(chunk=2048, warps=8),
    16384: Looped(chunk=4096, warps=16),
    32768: Looped(chunk=4096, warps=16),
    65536: OnePass(rows=1, warps=16),  # fp32 D = 16384: here one pass measured faster than two
}
# The fused add keeps 8-32 KiB rows in one pass, with configs from its own sweeps.
FUSED_ADD_LAUNCHES = {
    **FORWARD_LAUNCHES,
    8192: OnePass(rows=2, warps=2),
    16384: OnePass(rows=4, warps=16),
    32768: OnePass(rows=1, warps=16),
}
WIDE_ROWS = Looped(chunk=4096, warps=8)  # rows of more than MAX_ONE_PASS_D elements


def _cdiv(a: int, b: int) -> int:
    """ceil(a / b). Triton's cdiv and next_power_of_2 are constexpr functions, slow to call from
    the host, and these run on every call."""
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@functools.cache
def forward_launch(D: int, elem_size: int, residual: bool) -> OnePass | Looped:
    """The forward's launch for rows of D elements of elem_size bytes (cached: called per norm)."""
    block_d = _next_power_of_2(D)
    if block_d > MAX_ONE_PASS_D:
        return WIDE_ROWS
    row_bytes = block_d * elem_size
    if row_bytes <= 1024:
        return OnePass(rows=2048 // row_bytes, warps=4)
    return (FUSED_ADD_LAUNCHES if residual else FORWARD_LAUNCHES)[row_bytes]


@dataclass(frozen=True)
class BackwardLaunch:
    block_d: int
    rows: int  # per step of a program's loop over its run of rows
    warps: int
    max_programs: int


@functools.cache
def backward_launch(D: int, device: torch.device) -> BackwardLaunch:
    """~8K elements per step of a program, 2 programs per SM (4 for rows up to 1024): measured on
    the H200 (docs/benchmarks/rmsnorm-notes.md). The CPU interpreter runs as if on 2 SMs."""
    block_d = _next_power_of_2(D)
    rows = max(1, min(32, 8192 // block_d))
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    return BackwardLaunch(block_d, rows, min(16, max(4, rows * block_d // 1024)),
                          sm_count * (4 if block_d <= 1024 else 2))


def backward_grid(n_rows: int, block_rows: int, max_programs: int) -> tuple[int, int]:
    """(programs, rows per program): equal runs of whole row blocks. dweight's partial sums follow
    this split, so it fixes their order for a given shape."""
    programs = min(max_programs, _cdiv(n_rows, block_rows))
    rows_per_program = _cdiv(_cdiv(n_rows, programs), block_rows) * block_rows
    return _cdiv(n_rows, rows_per_program), rows_per_program


# ----------------------------------------------------------------------------- launches


def row_layout(x: torch.Tensor) -> tuple[int, int, int] | None:
    """(inner, stride_outer, stride_inner) addressing the rows of x (..., D), last dim unit-stride,
    or None when the leading dims do not collapse into two strides."""
    groups: list[list[int]] = []  # [size, stride], innermost first
    for size, stride in zip(reversed(x.shape[:-1]), reversed(x.stride()[:-1])):
        if size == 1:
            continue
        if groups and groups[-1][0] * groups[-1][1] == stride:
            groups[-1][0] *= size
        else:
            groups.append([size, stride])
    if not groups:
        return 1, 0, 0
    if len(groups) == 1:
        return groups[0][0], 0, groups[0][1]
    if len(groups) == 2:
        return groups[0][0], groups[1][1], groups[0][1]
    return None


def _readable_rows(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int] | None]:
    """x itself with its row layout (None: contiguous, rows of D), or a contiguous copy when the
    layout can't be addressed in place (a strided last dim, or leading dims needing more than two
    strides)."""
    if x.is_contiguous():  # the common case, without looking at strides
        return x, None
    layout = row_layout(x) if x.stride(-1) == 1 or x.shape[-1] == 1 else None
    if layout is None:
        return x.contiguous(), None
    return x, layout


def _empty(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous uninitialized tensor of x's shape. Each keyword argument adds host time to
    empty_like, and x's own dtype and a contiguous x need none."""
    if x.is_contiguous():
        return torch.empty_like(x) if dtype == x.dtype else torch.empty_like(x, dtype=dtype)
    return torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)


_CURRENT_DEVICE = contextlib.nullcontext()


def _device_of(x: torch.Tensor):
    """Triton launches on the current CUDA device: a guard that makes it x's where it is not."""
    if x.is_cuda and x.get_device() != torch.cuda.current_device():
        return torch.cuda.device(x.device)
    return _CURRENT_DEVICE


def forward(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
            store_rstd: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Launch the forward kernel on inputs validated by ops: returns (y, the sum or None, rstd).
    The sum has torch's dtype for `x + residual`, y the promotion of the normalized input's dtype
    with the weight's; rstd is fp32 per row (flat), empty unless store_rstd."""
    D = x.shape[-1]
    n_rows = x.numel() // D
    in_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    summed = None if residual is None else _empty(x, in_dtype)
    y = _empty(x, in_dtype if weight.dtype == in_dtype else torch.promote_types(in_dtype, weight.dtype))
    rstd = x.new_empty(n_rows if store_rstd else 0, dtype=torch.float32)
    if n_rows == 0:
        return y, summed, rstd
    x, x_rows = _readable_rows(x)
    r_rows = None
    if residual is not None:
        residual, r_rows = _readable_rows(residual)
    args = (x, residual, weight.contiguous(), y, summed, rstd if store_rstd else None)
    launch = forward_launch(D, x.element_size(), residual is not None)
    with _device_of(x):
        if isinstance(launch, OnePass):
            block_d = _next_power_of_2(D)
            _forward_one_pass[(_cdiv(n_rows, launch.rows),)](
                *args, n_rows, D, eps, x_rows, r_rows,
                BLOCK_ROWS=launch.rows, BLOCK_D=block_d, FULL_ROW=D == block_d, num_warps=launch.warps)
        else:
            _forward_looped[(n_rows,)](
                *args, eps, x_rows, r_rows, D=D, BLOCK_D=launch.chunk, num_warps=launch.warps)
    return y, summed, rstd


def backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
             d_sum: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) for y = rms_norm(x) (plus d_sum, the gradient reaching the fused op's sum)."""
    D = x.shape[-1]
    if D > MAX_BACKWARD_D:
        raise ValueError(f"the triton RMSNorm backward supports D <= {MAX_BACKWARD_D}, got D={D}")
    dx = _empty(x, x.dtype)
    n_rows = x.numel() // D
    if rstd.numel() != n_rows:  # a forward called with store_rstd=False left none to read
        raise ValueError(f"the RMSNorm backward needs rstd of every row ({n_rows}), got {rstd.numel()} values")
    if n_rows == 0:
        return dx, torch.zeros_like(weight)
    x, x_rows = _readable_rows(x)
    launch = backward_launch(D, x.device)
    programs, rows_per_program = backward_grid(n_rows, launch.rows, launch.max_programs)
    partial = x.new_empty(programs * D, dtype=torch.float32)  # flat: a 1-D size is the cheapest to allocate
    dw = torch.empty_like(weight)
    with _device_of(x):
        _backward[(programs,)](
            dy.contiguous(), x, weight.contiguous(), rstd.contiguous(), None if d_sum is None else d_sum.contiguous(),
            dx, partial, n_rows, D, rows_per_program, x_rows,
            BLOCK_ROWS=launch.rows, BLOCK_D=launch.block_d, num_warps=launch.warps)
        _sum_partials[(_cdiv(D, SUM_BLOCK_D),)](
            partial, dw, programs, D, BLOCK_ROWS=SUM_BLOCK_ROWS, BLOCK_D=SUM_BLOCK_D, num_warps=4)
    return dx, dw


# ----------------------------------------------------------------------------- ops and autograd


# The ops are declared with torch.library.define and given a kernel per device and a fake, so that
# torch.compile sees one opaque node per norm: what @torch.library.custom_op registers, without
# the Python layers its wrapper adds to every call (a dynamo guard, an output aliasing check).
SCHEMAS = {
    "rms_norm": "(Tensor x, Tensor weight, float eps, bool store_rstd) -> (Tensor, Tensor)",
    "fused_add_rms_norm": "(Tensor x, Tensor residual, Tensor weight, float eps, bool store_rstd)"
                          " -> (Tensor, Tensor, Tensor)",
    "rms_norm_backward": "(Tensor dy, Tensor x, Tensor weight, Tensor rstd, Tensor? d_sum) -> (Tensor, Tensor)",
}
for _name, _schema in SCHEMAS.items():
    torch.library.define(f"qwen3_ops::{_name}", _schema, tags=(torch.Tag.pt2_compliant_tag,))
rms_norm_op = torch.ops.qwen3_ops.rms_norm.default  # (y, rstd); rstd is empty unless store_rstd
fused_add_rms_norm_op = torch.ops.qwen3_ops.fused_add_rms_norm.default  # (y, x + residual, rstd)
rms_norm_backward_op = torch.ops.qwen3_ops.rms_norm_backward.default  # (dx, dweight)
DEVICES = ("cuda", "cpu")  # cpu: Triton's interpreter (TRITON_INTERPRET=1)


@torch.library.impl("qwen3_ops::rms_norm", DEVICES)
def _(x, weight, eps, store_rstd):
    y, _, rstd = forward(x, weight, eps, store_rstd=store_rstd)
    return y, rstd


@torch.library.impl("qwen3_ops::fused_add_rms_norm", DEVICES)
def _(x, residual, weight, eps, store_rstd):
    return forward(x, weight, eps, residual=residual, store_rstd=store_rstd)


torch.library.impl("qwen3_ops::rms_norm_backward", DEVICES, backward)


def _fake_outputs(x: torch.Tensor, weight: torch.Tensor, store_rstd: bool) -> tuple[torch.Tensor, torch.Tensor]:
    y = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    return y, x.new_empty(x.numel() // x.shape[-1] if store_rstd else 0, dtype=torch.float32)


@torch.library.register_fake("qwen3_ops::rms_norm")
def _(x, weight, eps, store_rstd):
    return _fake_outputs(x, weight, store_rstd)


@torch.library.register_fake("qwen3_ops::fused_add_rms_norm")
def _(x, residual, weight, eps, store_rstd):
    summed = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype))
    y, rstd = _fake_outputs(summed, weight, store_rstd)
    return y, summed, rstd


@torch.library.register_fake("qwen3_ops::rms_norm_backward")
def _(dy, x, weight, rstd, d_sum):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


# Autograd: one autograd.Function per norm around its op, as in Liger and Triton's layer-norm
# tutorial; torch.compile traces the Functions into graphs of the opaque ops, forward and backward.
# The ops have no autograd formula of their own (called directly, they are not differentiable):
# the Functions ask the forward for rstd and call the backward op. The backward is not itself
# differentiable: once_differentiable makes a second derivative an error instead of zeros.


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = rms_norm_op(x, weight, eps, True)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward_op(dy, x, weight, rstd, None)
        return dx, dw, None


class _FusedAddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        y, summed, rstd = fused_add_rms_norm_op(x, residual, weight, eps, True)
        # The backward is the norm's, of its input: the sum.
        ctx.save_for_backward(summed, weight, rstd)
        ctx.input_dtypes = (x.dtype, residual.dtype)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not zeros to read
        return y, summed

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy, d_sum):
        summed, weight, rstd = ctx.saved_tensors
        if dy is None:  # only the sum was used
            dy = summed.new_zeros(summed.shape, dtype=torch.promote_types(summed.dtype, weight.dtype))
        d_summed, dw = rms_norm_backward_op(dy, summed, weight, rstd, d_sum)
        x_dtype, residual_dtype = ctx.input_dtypes
        return d_summed.to(x_dtype), d_summed.to(residual_dtype), dw, None


# The public calls, on inputs validated by ops: through the Function where autograd records the
# call, else straight to the op (a Function costs host time even where it records nothing).


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps)
    return rms_norm_op(x, weight, eps, False)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if torch.is_grad_enabled() and (x.requires_grad or residual.requires_grad or weight.requires_grad):
        return _FusedAddRMSNorm.apply(x, residual, weight, eps)
    y, summed, _ = fused_add_rms_norm_op(x, residual, weight, eps, False)
    return y, summed
