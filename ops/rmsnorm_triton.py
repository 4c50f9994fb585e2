"""Triton RMSNorm: forward, fused residual add, backward, and their torch.library ops.

Arithmetic is Hugging Face's Qwen3RMSNorm (see rmsnorm_torch.py): squares summed in fp32,
the normalized row rounded to the input dtype, then multiplied by the weight in fp32 and
rounded once to the promoted output dtype. (A product of two 16-bit floats is exact in fp32,
so this rounds exactly as torch's `weight * normalized` does.)

Rows are addressed as `(r // inner) * stride_outer + (r % inner) * stride_inner`, so any
(..., D) tensor whose leading dims collapse into at most two strides is read in place:
a column slice, or the q part of a fused qkv projection viewed as (B, S, H, head_dim).
Outputs are always contiguous and allocated with torch.empty (never zero-filled).
"""

import functools
import os
import warnings

import torch
import triton
import triton.language as tl

try:
    from triton import knobs
except ImportError:  # Triton < 3.4: every launch takes Triton's own path
    knobs = None

# One pass holds the whole row in registers up to this width; wider rows take the looped kernel.
MAX_ONE_PASS_D = 16384
# The backward keeps x, dy, w and the dweight accumulator of a row in registers.
MAX_BACKWARD_D = 8192
LOOPED_BLOCK_D = 4096
SUM_BLOCK_ROWS, SUM_BLOCK_D = 32, 64  # tile of the dweight reduction over the backward's partials
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent from CPU builds of torch
_current_device = getattr(torch._C, "_cuda_getDevice", None)
_data_ptr = torch.Tensor.data_ptr


@triton.jit
def _round(x, dtype: tl.constexpr):
    """fp32 x rounded to nearest-even in dtype. Triton's CPU interpreter truncates fp32 -> bf16
    where the GPU rounds; round the bits by hand there so the CPU tests check GPU arithmetic."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = tl.where(x == x, bits.to(tl.float32, bitcast=True), x)  # leave NaN payloads alone
    return x.to(dtype)


@triton.jit(do_not_specialize=["n_rows", "eps", "x_inner", "r_inner"])
def _forward_one_pass(
    X, R, W, Y, S, RSTD,
    n_rows, D, eps,
    x_inner, x_stride_outer, x_stride_inner,
    r_inner, r_stride_outer, r_stride_inner,
    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, STORE_RSTD: tl.constexpr, CONTIGUOUS: tl.constexpr, FULL_ROW: tl.constexpr,
):
    """BLOCK_ROWS rows per program, each held whole in registers. CONTIGUOUS: x and the residual
    are plain (rows, D) tensors, addressed without the 64-bit divisions of the general layout.
    FULL_ROW: D == BLOCK_D, so no column mask and a row stride known at compile time, as in
    inductor's kernels (2% at fp32 16384 x 1024; rmsnorm-notes.md, item 17)."""
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
    if CONTIGUOUS:
        x = tl.load(X + out_rows, mask=mask, other=0.0)
    else:
        x_rows = (rows // x_inner) * x_stride_outer + (rows % x_inner) * x_stride_inner
        x = tl.load(X + x_rows[:, None] + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        if CONTIGUOUS:
            res = tl.load(R + out_rows, mask=mask, other=0.0)
        else:
            r_rows = (rows // r_inner) * r_stride_outer + (rows % r_inner) * r_stride_inner
            res = tl.load(R + r_rows[:, None] + cols[None, :], mask=mask, other=0.0)
        # The sum is rounded to x's dtype, as `residual + hidden_states` is in the HF decoder.
        x = _round(x.to(tl.float32) + res.to(tl.float32), S.dtype.element_ty)
        tl.store(S + out_rows, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)
    if STORE_RSTD:
        tl.store(RSTD + rows, rstd, mask=row_ok)
    normalized = _round(xf * rstd[:, None], S.dtype.element_ty).to(tl.float32)
    tl.store(Y + out_rows, _round(normalized * w[None, :], Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_rows", "eps", "x_inner", "r_inner"])
def _forward_looped(
    X, R, W, Y, S, RSTD,
    n_rows, eps,
    x_inner, x_stride_outer, x_stride_inner,
    r_inner, r_stride_outer, r_stride_inner,
    D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_RESIDUAL: tl.constexpr, STORE_RSTD: tl.constexpr,
):
    """One row per program, two passes over it in BLOCK_D chunks: sum of squares, then normalize.
    Pass one asks L2 to keep the row (evict_last) so that pass two re-reads it from cache.
    D is compiled in, as Inductor does: fp32 16384 x 8192 took 252.4 us against 256.3 with D
    passed at run time (rmsnorm-notes.md, item 11). Wide rows come in few widths per model."""
    row = tl.program_id(0).to(tl.int64)
    x_row = X + (row // x_inner) * x_stride_outer + (row % x_inner) * x_stride_inner
    r_row = R + (row // r_inner) * r_stride_outer + (row % r_inner) * r_stride_inner
    out_row = row * D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, D, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        ok = cols < D
        x = tl.load(x_row + cols, mask=ok, other=0.0, eviction_policy="evict_last")
        if HAS_RESIDUAL:
            res = tl.load(r_row + cols, mask=ok, other=0.0, eviction_policy="evict_first")
            x = _round(x.to(tl.float32) + res.to(tl.float32), S.dtype.element_ty)
            tl.store(S + out_row + cols, x, mask=ok)
        xf = x.to(tl.float32)
        acc += xf * xf
    rstd = tl.rsqrt(tl.sum(acc, axis=0) / D + eps)
    if STORE_RSTD:
        tl.store(RSTD + row, rstd)
    for start in range(0, D, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        ok = cols < D
        if HAS_RESIDUAL:
            x = tl.load(S + out_row + cols, mask=ok, other=0.0, eviction_policy="evict_first")
        else:
            x = tl.load(x_row + cols, mask=ok, other=0.0, eviction_policy="evict_first")
        normalized = _round(x.to(tl.float32) * rstd, S.dtype.element_ty).to(tl.float32)
        w = tl.load(W + cols, mask=ok, other=0.0, eviction_policy="evict_last").to(tl.float32)
        tl.store(Y + out_row + cols, _round(normalized * w, Y.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["n_rows", "rows_per_program", "x_inner"])
def _backward(
    DY, X, W, RSTD, DS, DX, DW_PARTIAL,
    n_rows, D, rows_per_program,
    x_inner, x_stride_outer, x_stride_inner,
    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, HAS_DS: tl.constexpr, CONTIGUOUS: tl.constexpr,
):
    """dx and per-program fp32 partial sums of dweight for a contiguous range of rows.

    Follows autograd through HF's module: the gradient reaching the normalized value is
    dy * w rounded to y's dtype (the multiply's backward runs in that dtype); dweight is
    sum(dy * normalized_rounded) accumulated in fp32. HAS_DS adds the gradient of the
    residual-sum output of the fused op (the sum also feeds the next residual branch).
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
        if CONTIGUOUS:
            x = tl.load(X + out_rows, mask=mask, other=0.0).to(tl.float32)
        else:
            x_rows = (rows // x_inner) * x_stride_outer + (rows % x_inner) * x_stride_inner
            x = tl.load(X + x_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + out_rows, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        normalized = x * rstd[:, None]
        dw += tl.sum(dy * _round(normalized, X.dtype.element_ty).to(tl.float32), axis=0)
        dn = _round(dy * w[None, :], DY.dtype.element_ty).to(tl.float32)
        mean_dn_n = tl.sum(dn * normalized, axis=1) / D
        dx = (dn - normalized * mean_dn_n[:, None]) * rstd[:, None]
        if HAS_DS:
            dx += tl.load(DS + out_rows, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + out_rows, _round(dx, DX.dtype.element_ty), mask=mask)
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
    tl.store(DW + cols, _round(tl.sum(acc, axis=0), DW.dtype.element_ty), mask=col_ok)


# ----------------------------------------------------------------------------- launch logic


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


def _cdiv(a: int, b: int) -> int:
    """ceil(a / b). triton.cdiv is a ConstexprFunction since Triton 3.4, ~2 us per host call."""
    return -(-a // b)


def _int_class(v: int) -> tuple[bool, bool, bool]:
    """How Triton specializes an int argument: equal to 1, divisible by 16, beyond 32 bits."""
    return v == 1, v % 16 == 0, not -(2**31) <= v < 2**31


def _layout_key(layout: tuple[int, int, int]) -> tuple:
    """The specialization-relevant part of a row layout (inner is not specialized, only sized).
    Callers key contiguous rows (layout None) as None: their layout follows from n_rows and D."""
    inner, stride_outer, stride_inner = layout
    return inner >= 2**31, _int_class(stride_outer), _int_class(stride_inner)


def _hooks_active() -> bool:
    """Whether a profiler (proton) registered a Triton launch hook; launches then take Triton's
    own path, which reports them. Triton 3.6 keeps hooks in a HookChain, earlier ones a callable."""
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


# torch's C++ launcher for Triton-compiled kernels (Inductor's, absent from CPU builds): one C call
# that parses the arguments by a type string and calls cuLaunchKernel. 6.6 us per launch against
# 9.2 for Triton's launcher on the H200's host (docs/benchmarks/launch-host-h200.log).
_static_launch = getattr(getattr(torch._C, "_StaticCudaLauncher", None), "_launch_kernel", None)
_STATIC_ARG_TYPES = {"i32": "i", "i64": "l", "fp32": "f"}  # Triton's types of our scalar arguments


def _static_plan(compiled, n_args: int) -> tuple | None:
    """(function, warps, shared memory, argument types, trailing null arguments) to launch a compiled
    kernel through torch's static launcher; None where it can't take it (no such launcher, scratch
    memory, a cooperative or cluster launch, a run-time argument specialized to a constant) and
    Triton's own launcher runs it instead."""
    source = getattr(compiled, "src", None)
    if _static_launch is None or source is None:
        return None
    meta = compiled.metadata
    types = list(source.signature.values())
    runtime = types[:n_args]
    plain_launch = not any(getattr(meta, name, 0) for name in (
        "global_scratch_size", "profile_scratch_size", "launch_cooperative_grid", "launch_pdl"))
    # Signature: the run-time arguments, then the declared constexprs (Triton >= 3.3 lists them).
    signature_ok = len(types) >= n_args and "constexpr" not in runtime and set(types[n_args:]) <= {"constexpr"}
    if not plain_launch or getattr(meta, "num_ctas", 1) != 1 or not signature_ok:
        return None
    codes = "".join("O" if t[0] == "*" else _STATIC_ARG_TYPES.get(t, "?") for t in runtime)
    if "?" in codes:
        return None
    # Triton >= 3.3 appends scratch-buffer pointers to every kernel's parameters; null when unused.
    scratch = (None,) * (hasattr(meta, "global_scratch_size") + hasattr(meta, "profile_scratch_size"))
    return compiled.function, meta.num_warps, meta.shared, codes + "O" * len(scratch), scratch


# (kernel, device, warps, constexprs, key) -> (compiled kernel, static launch plan or None). The key
# is built by the caller from what Triton specializes on: each tensor's dtype and 16-byte alignment
# and each int's class (_int_class, or the int itself); the device is in it, as a compiled function
# belongs to one device.
_compiled: dict[tuple, tuple] = {}


def _launch(kernel, key: tuple, programs: int, tensors: tuple, scalars: tuple, constexprs: tuple,
            num_warps: int) -> tuple | None:
    """kernel[(programs,)](*tensors, *scalars, *constexprs), with Triton's per-call argument
    binding, cache lookup and hook bookkeeping (tens of microseconds of host time) done only the
    first time a specialization is seen. Later launches pass raw pointers (ops validated the
    tensors; Triton would re-check each pointer with the driver) on the current stream of the
    tensors' device to torch's static launcher, or else to the compiled kernel's own C launcher,
    whose signature (grid, stream, function, metadata, launch metadata, two hooks, args) was read
    in Triton 3.6 and 3.9. Returns the kernel's static launch plan, or None where there is none."""
    if INTERPRETED:
        kernel[(programs,)](*tensors, *scalars, *constexprs, num_warps=num_warps)
        return None
    device = tensors[0].get_device()
    key = (id(kernel), device, num_warps, constexprs, key)  # id: a JITFunction hashes in Python
    entry = _compiled.get(key)
    # A compiled function runs in its device's context, and a launch goes to the current one: tensors
    # on another device than the current take Triton's own path, under a device guard.
    if entry is None or knobs is None or _hooks_active() or device != _current_device():
        with torch.cuda.device(device):
            compiled = kernel[(programs,)](*tensors, *scalars, *constexprs, num_warps=num_warps)
        plan = _static_plan(compiled, len(tensors) + len(scalars))
        _compiled[key] = compiled, plan
        return plan
    compiled, plan = entry
    if plan is None:
        compiled.run(programs, 1, 1, _current_stream(device), compiled.function, compiled.packed_metadata, None,
                     None, None, *map(_data_ptr, tensors), *scalars, *constexprs)
        return None
    function, warps, shared, types, scratch = plan
    _static_launch(function, programs, 1, 1, warps, shared, types, (*map(_data_ptr, tensors), *scalars, *scratch),
                   _current_stream(device))
    return plan


# The C++ launcher (rmsnorm_launcher.cpp): its `forward`, once the first plan is registered.
_cpp_forward = None


@functools.cache
def _cpp_launcher():
    """The C++ launcher extension, built by torch on first use (15-30 s) and cached on disk; None,
    with a warning, where it cannot be built: every call then takes the Python path."""
    from torch.utils.cpp_extension import load

    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rmsnorm_launcher.cpp")
    try:
        return load("qwen3_rmsnorm_launcher", [source], extra_cflags=["-O2"], extra_ldflags=["-ldl"])
    except Exception as error:  # no C++ compiler or ninja: slower host path, same kernels and results
        warnings.warn(f"the C++ launcher of the Triton RMSNorm could not be built ({error}); "
                      "calls take the Python launch path", RuntimeWarning, stacklevel=2)
        return None


def _registered(add_plan, *args) -> bool:
    """add_plan(*args) on the C++ launcher. A kernel whose parameters it does not expect (from
    another Triton version) stays on the Python path, with a warning, instead of failing the call."""
    try:
        add_plan(*args)
    except ValueError as error:
        warnings.warn(f"the C++ launcher cannot take a Triton RMSNorm kernel ({error}); calls of its shape take "
                      "the Python launch path", RuntimeWarning, stacklevel=3)
        return False
    return True


def _register_forward(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, store_rstd: bool,
                      plan: tuple, block_rows: int) -> None:
    """Hand the forward kernel just launched on these contiguous inputs to the C++ launcher."""
    global _cpp_forward
    launcher = _cpp_launcher()
    if launcher is not None and _registered(launcher.add_forward_plan, x, residual, weight, store_rstd, *plan[:4],
                                            block_rows):
        _cpp_forward = launcher.forward


# Bytes of one (padded) row -> (rows per program, warps) of the one-pass kernel: the best or
# near-best of scripts/sweep_rmsnorm.py on the H200 for the plain and the fused-add forward
# (docs/benchmarks/rmsnorm-notes.md). Rows up to 1 KiB are packed into 2 KiB programs.
# 8 and 16 KiB were re-swept for contiguous addressing, under which (2, 16) lost 16%. The 2 KiB
# entry and the 16 KiB one (reached only with a residual: plain 16 KiB rows are looped) come from
# side-by-side probes under do_bench's L2 flush since FULL_ROW (item 18).
_FORWARD_TABLE = {2048: (2, 2), 4096: (1, 4), 8192: (2, 2), 16384: (4, 16), 32768: (1, 16), 65536: (1, 16)}
# Plain rows of 8 to 32 KiB -> (BLOCK_D, warps) of the looped kernel. Two passes, the second
# re-reading the row from L2, beat holding the row in registers there: fp32 16384 x 2048 65.2 us
# against 67.0, bf16 16384 x 8192 127.4 against 130.0, bf16 16384 x 16384 257.8 against 283.2
# (rmsnorm-notes.md, items 11-12). 32 KiB rows want 4096-wide chunks in both dtypes: fp32 x 8192
# 252.7 us against 257.7 for 2048. At 64 KiB rows the one-pass kernel wins again (520 against 580).
_LOOPED_TABLE = {8192: (2048, 8), 16384: (4096, 16), 32768: (4096, 16)}


@functools.cache
def forward_config(D: int, elem_size: int, residual: bool) -> tuple[int, int, int]:
    """(BLOCK_D, BLOCK_ROWS, num_warps) for the one-pass kernel; BLOCK_ROWS == 0 means looped.
    Cached per (D, dtype size, residual), so decode steps never recompute it."""
    block_d = triton.next_power_of_2(D)
    if block_d > MAX_ONE_PASS_D:
        return LOOPED_BLOCK_D, 0, 8
    row_bytes = block_d * elem_size
    if not residual and row_bytes in _LOOPED_TABLE:
        looped_d, num_warps = _LOOPED_TABLE[row_bytes]
        return looped_d, 0, num_warps
    if row_bytes <= 1024:
        return block_d, 2048 // row_bytes, 4
    block_rows, num_warps = _FORWARD_TABLE[row_bytes]
    return block_d, block_rows, num_warps


@functools.cache
def backward_config(D: int, device_index: int) -> tuple[int, int, int, int]:
    """(BLOCK_D, BLOCK_ROWS, num_warps, most programs) for the backward, from the same sweep: ~8K
    elements per step of a program, 2 programs per SM (4 for narrow rows)."""
    block_d = triton.next_power_of_2(D)
    block_rows = max(1, min(32, 8192 // block_d))
    num_warps = min(16, max(4, block_rows * block_d // 1024))
    # The interpreter (device_index -1) runs few programs, each over many rows.
    sm_count = torch.cuda.get_device_properties(device_index).multi_processor_count if device_index >= 0 else 2
    return block_d, block_rows, num_warps, sm_count * (4 if block_d <= 1024 else 2)


def backward_grid(n_rows: int, block_rows: int, max_programs: int) -> tuple[int, int]:
    """(programs, rows per program): equal runs of whole row blocks. rmsnorm_launcher.cpp computes
    the same, and must, as dweight's partial sums follow this split."""
    programs = min(max_programs, _cdiv(n_rows, block_rows))
    rows_per_program = _cdiv(_cdiv(n_rows, programs), block_rows) * block_rows
    return _cdiv(n_rows, rows_per_program), rows_per_program


def _empty(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous uninitialized tensor of x's shape. empty_like is the cheapest allocator call, and
    each keyword argument adds to its host time: x's own dtype and contiguous x need neither."""
    if x.is_contiguous():
        return torch.empty_like(x) if dtype == x.dtype else torch.empty_like(x, dtype=dtype)
    return torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)


def forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    store_rstd: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Launch the forward kernel: returns (y, sum or None, rstd or None). Inputs are validated
    by ops.rms_norm. The sum has torch's dtype for `x + residual`, y the promotion of the
    normalized input's dtype with the weight's, rstd is fp32 per row (flat)."""
    if _cpp_forward is not None and not _hooks_active():  # a profiler's hooks see Triton's launches
        launched = _cpp_forward(x, residual, weight, eps, store_rstd)
        if launched is not None:
            return launched
    D = x.shape[-1]
    n_rows = x.numel() // D
    in_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    summed = None if residual is None else _empty(x, in_dtype)
    y = _empty(x, in_dtype if weight.dtype == in_dtype else torch.promote_types(in_dtype, weight.dtype))
    # rstd is flat (n_rows,): allocating from a torch.Size costs over twice as much host time.
    rstd = x.new_empty(n_rows, dtype=torch.float32) if store_rstd else None
    if n_rows == 0:
        return y, summed, rstd
    x, x_layout = _readable_rows(x)
    weight = weight.contiguous()
    # The key holds what Triton specializes on (D itself stands for its int class); y, the sum and
    # rstd are fresh allocations, always aligned, and their dtypes follow from x's and the weight's.
    key = (x.dtype, weight.dtype, x.data_ptr() % 16, weight.data_ptr() % 16, D, n_rows >= 2**31,
           x_layout and _layout_key(x_layout))
    if residual is None:  # R and S are x, never read; S's dtype is the one the normalized row is rounded to
        residual, r_layout, s = x, x_layout, x
    else:
        residual, r_layout = _readable_rows(residual)
        s = summed
        key += (residual.dtype, residual.data_ptr() % 16, r_layout and _layout_key(r_layout))
    block_d, block_rows, num_warps = forward_config(D, x.element_size(), summed is not None)
    tensors = (x, residual, weight, y, s, y if rstd is None else rstd)
    x_default = (n_rows, 0, D)
    layouts = (*(x_layout or x_default), *(r_layout or x_default))
    flags = (summed is not None, store_rstd)
    contiguous = x_layout is None and r_layout is None
    if block_rows:
        plan = _launch(_forward_one_pass, key, _cdiv(n_rows, block_rows), tensors, (n_rows, D, eps, *layouts),
                       (block_rows, block_d, *flags, contiguous, D == block_d), num_warps)
    else:
        plan = _launch(_forward_looped, key, n_rows, tensors, (n_rows, eps, *layouts), (D, block_d, *flags), num_warps)
    if plan is not None and contiguous and knobs is not None:
        _register_forward(x, None if summed is None else residual, weight, store_rstd, plan, block_rows)
    return y, summed, rstd


def backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    d_sum: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) for y = rms_norm(x) (plus d_sum, the gradient reaching the fused op's sum)."""
    D = x.shape[-1]
    if D > MAX_BACKWARD_D:
        raise ValueError(f"the triton RMSNorm backward supports D <= {MAX_BACKWARD_D}, got D={D}")
    dx = _empty(x, x.dtype)
    n_rows = x.numel() // D
    if n_rows == 0:
        return dx, torch.zeros_like(weight)
    x, x_layout = _readable_rows(x)
    block_d, block_rows, num_warps, max_programs = backward_config(D, x.get_device())
    programs, rows_per_program = backward_grid(n_rows, block_rows, max_programs)
    partial = x.new_empty(programs * D, dtype=torch.float32)  # flat: a 1-D size is the cheapest to allocate
    has_ds = d_sum is not None
    dy, weight, rstd = dy.contiguous(), weight.contiguous(), rstd.contiguous()
    d_sum = d_sum.contiguous() if has_ds else dy
    tensors = (dy, x, weight, rstd, d_sum, dx, partial)
    scalars = (n_rows, D, rows_per_program, *(x_layout or (n_rows, 0, D)))
    key = (dy.dtype, x.dtype, weight.dtype, d_sum.dtype, dy.data_ptr() % 16, x.data_ptr() % 16,
           weight.data_ptr() % 16, rstd.data_ptr() % 16, d_sum.data_ptr() % 16,
           D, n_rows >= 2**31, x_layout and _layout_key(x_layout))
    rows_plan = _launch(_backward, key, programs, tensors, scalars, (block_rows, block_d, has_ds, x_layout is None),
                        num_warps)
    # dweight: the partials summed in a fixed order (deterministic for a given shape) and cast in one launch.
    dw = torch.empty_like(weight)
    sum_programs = _cdiv(D, SUM_BLOCK_D)
    sum_plan = _launch(_sum_partials, (weight.dtype, D), sum_programs, (partial, dw), (programs, D),
                       (SUM_BLOCK_ROWS, SUM_BLOCK_D), 4)
    launcher = _cpp_launcher() if rows_plan and sum_plan and x_layout is None and knobs is not None else None
    if launcher is not None:  # later calls like this one launch from C++
        _registered(launcher.add_backward_plan, dy, x, weight, rstd, d_sum if has_ds else None, rows_plan[:4],
                    sum_plan[:4], block_rows, max_programs, sum_programs)
    return dx, dw


# -------------------------------------------------------------------------- autograd and ops
# Eager autograd goes through the C++ launcher's autograd nodes. Under torch.compile, and where the
# launcher is not built or a profiler hooks launches, the calls go through the custom_ops below
# and their registered autograd instead (more host time per call than the C++ nodes), so a
# compiled graph holds one opaque node per norm (fullgraph, CUDA-graph friendly). custom_op rather
# than triton_op: it passes every torch.library.opcheck test under TRITON_INTERPRET=1 on CPU,
# where the test suite runs.


def _autograd_in_cpp():
    """The C++ launcher, whose autograd nodes cost the least host time; None while a profiler's
    launch hooks are set (they must see every launch, which C++ launches skip), or where it cannot
    be built."""
    return None if knobs is not None and _hooks_active() else _cpp_launcher()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Triton RMSNorm on validated inputs, by the cheapest path that serves the caller."""
    if torch.compiler.is_compiling():
        return rms_norm_op(x, weight, eps)[0]
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        nodes = _autograd_in_cpp()
        return rms_norm_op(x, weight, eps)[0] if nodes is None else nodes.rms_norm(x, weight, eps)
    return forward(x, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if torch.compiler.is_compiling():
        return fused_add_rms_norm_op(x, residual, weight, eps)[:2]
    if torch.is_grad_enabled() and (x.requires_grad or residual.requires_grad or weight.requires_grad):
        nodes = _autograd_in_cpp()
        if nodes is None:
            return fused_add_rms_norm_op(x, residual, weight, eps)[:2]
        return nodes.fused_add_rms_norm(x, residual, weight, eps)
    return forward(x, weight, eps, residual=residual)[:2]


@torch.library.custom_op("qwen3_ops::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    y, _, rstd = forward(x, weight, eps, store_rstd=True)
    return y, rstd


@torch.library.custom_op("qwen3_ops::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, summed, rstd = forward(x, weight, eps, residual=residual, store_rstd=True)
    return y, summed, rstd


@torch.library.custom_op("qwen3_ops::rms_norm_backward", mutates_args=())
def rms_norm_backward_op(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, d_sum: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    return backward(dy, x, weight, rstd, d_sum)


def _fake_outputs(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    return y, x.new_empty(x.numel() // x.shape[-1], dtype=torch.float32)


@rms_norm_op.register_fake
def _(x, weight, eps):
    return _fake_outputs(x, weight)


@fused_add_rms_norm_op.register_fake
def _(x, residual, weight, eps):
    summed = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype))
    y, rstd = _fake_outputs(summed, weight)
    return y, summed, rstd


@rms_norm_backward_op.register_fake
def _(dy, x, weight, rstd, d_sum):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    x, weight = inputs[0], inputs[-2]
    ctx.input_dtypes = [t.dtype for t in inputs[:-2]]
    # The fused op's backward needs the normalized input, which is its sum output.
    ctx.save_for_backward(output[1] if len(output) == 3 else x, weight, output[-1])


def _rms_norm_grad(ctx, dy, d_rstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_backward_op(dy, x, weight, rstd, None)
    return dx, dw, None


def _fused_add_rms_norm_grad(ctx, dy, d_sum, d_rstd):
    summed, weight, rstd = ctx.saved_tensors
    d_summed, dw = rms_norm_backward_op(dy, summed, weight, rstd, d_sum)
    x_dtype, residual_dtype = ctx.input_dtypes
    return d_summed.to(x_dtype), d_summed.to(residual_dtype), dw, None


rms_norm_op.register_autograd(_rms_norm_grad, setup_context=_setup_context)
fused_add_rms_norm_op.register_autograd(_fused_add_rms_norm_grad, setup_context=_setup_context)
