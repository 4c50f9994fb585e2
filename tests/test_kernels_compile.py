"""Every decode-step Triton kernel compiles for Hopper (sm_90, the H100/H200) on this CPU machine.

The CPU tests run the kernels in Triton's interpreter, which executes them as numpy and does
not apply the compiler's typing rules (a variable re-typed inside a branch, a loop bound of the
wrong type): such a kernel passes every CPU test and fails to compile on the GPU. Compiling for
an explicit target needs no GPU, so these tests catch that here. The interpreter replaces every
@triton.jit function once TRITON_INTERPRET=1 is set (conftest sets it), so a child process with
TRITON_INTERPRET=0 compiles the cases, one child for each half of them (so that no test's set-up
takes a minute), and each test reads its case's result.
"""

import inspect
import itertools
import json
import os
import subprocess
import sys
import traceback

import pytest

DTYPES = ("bf16", "fp32")


_compiled: dict[tuple[str, ...], dict[str, str | None]] = {}  # each half's results, once per module


@pytest.fixture
def compiled(kernels) -> dict[str, str | None]:
    """{"kernels:dtype": None, or the compile error's traceback}: every case of the half of CASES that
    `kernels` is in, compiled in one child process with the real compiler (made once per half)."""
    half = next(half for half in HALVES if kernels in half)
    if half not in _compiled:
        here = os.path.dirname(os.path.abspath(__file__))
        root = os.path.dirname(here)
        env = {**os.environ, "TRITON_INTERPRET": "0",
               "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
        code = f"import json, test_kernels_compile as t; print(json.dumps(t.compile_every_case({half!r})))"
        result = subprocess.run([sys.executable, "-c", code], env=env, cwd=here, capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        _compiled[half] = json.loads(result.stdout.splitlines()[-1])
    return _compiled[half]


def compile_every_case(names: tuple[str, ...]) -> dict[str, str | None]:
    """In the child process: each named case of CASES in each dtype, compiled; its traceback if it failed."""
    errors = {}
    for name in names:
        compile_case = CASES[name]
        for dtype in DTYPES:
            try:
                compile_case(dtype)
                errors[f"{name}:{dtype}"] = None
            except Exception:
                errors[f"{name}:{dtype}"] = traceback.format_exc()[-3000:]
    return errors


def compile_for_hopper(kernel, pointers: dict[str, str], constexprs: dict, floats=(), **options) -> None:
    """Compile `kernel` with the named pointer arguments typed as given, `floats` as fp32, every
    other runtime argument as i32, the constexprs bound, and compile `options` (num_stages=...)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name in floats else "i32"
    triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                   options=options)


def compile_qk_norm_rope_kernel(dtype: str) -> None:
    from ops.attention import qk_norm_rope

    pointers = {name: f"*{dtype}" for name in ("QKV", "QW", "KW", "Q_OUT", "K_OUT", "K_CACHE", "V_CACHE")}
    pointers |= {"COS": "*fp32", "SIN": "*fp32", "POS": "*i64", "SLOTS": "*i64"}
    for has_cache, block_h in ((True, 1), (True, 8), (False, 8)):  # decode: a head per program; prefill: 8
        compile_for_hopper(qk_norm_rope._qk_norm_rope_kernel, pointers,
                           dict(N_HEADS=16, N_KV=8, HD=128, BLOCK_HALF=64, BLOCK_H=block_h, HAS_CACHE=has_cache,
                                PDL=True), floats=("eps",))


def compile_decode_attention_kernels(dtype: str) -> None:
    from ops.attention import decode_attention

    pointers = {"Q": f"*{dtype}", "K": f"*{dtype}", "V": f"*{dtype}", "OUT": f"*{dtype}", "SEQ_LENS": "*i64",
                "O_PART": "*fp32", "LSE_PART": "*fp32"}
    pointers["BLOCK_TABLE"] = "*i64"  # the engine's block tables are int64
    # rows of one cache tensor or blocks of a paged cache; slices to merge, or one slice per row
    for paged, splits in ((False, 32), (True, 32), (False, 1), (True, 1)):
        compile_for_hopper(decode_attention._split_kernel, pointers,
                           dict(PAGED=paged, PAGE=16, N_KV=8, GROUP=2, BLOCK_G=16, HD=128, BLOCK_HD=128, SPLITS=splits,
                                BLOCK_N=64, FP32=dtype == "fp32", PDL=True), floats=("scale",), num_stages=2)
    compile_for_hopper(decode_attention._merge_kernel, pointers, dict(SPLITS=32, BLOCK_SPLITS=32, HD=128,
                                                                      BLOCK_HD=128, PDL=True))


def compile_gemv_and_silu_mul_kernels(dtype: str) -> None:
    from ops.linear import gemv, silu_mul

    pointers = {name: f"*{dtype}" for name in ("X", "R", "NW", "S", "W", "B", "Y", "GATE_UP", "OUT")}
    pointers["WS"] = "*fp32"
    # (gated, norm, residual): the gated gate/up projection with the norm in front at batch 1, the others;
    # each with a weight in the activations' dtype and an FP8 one (block scales of 128 x 128)
    variants = ((True, True, True), (True, False, False), (False, False, False), (False, True, True),
                (False, True, False))
    for (gated, norm, residual), fp8 in itertools.product(variants, (False, True)):
        scales = dict(SCALED=True, SCALE_N=128, SCALE_K=128) if fp8 else dict(SCALED=False, SCALE_N=1, SCALE_K=1)
        compile_for_hopper(gemv._gemv_kernel, pointers | ({"W": "*fp8e4nv"} if fp8 else {}),
                           dict(HAS_BIAS=not norm, GATED=gated, NORM=norm, HAS_RESIDUAL=residual,
                                BLOCK_N=(8 if gated else 4) if fp8 else (2 if gated else 4),
                                BLOCK_K=512 if fp8 else 1024, PDL=True, **scales),
                           floats=("eps",))
    compile_for_hopper(silu_mul._silu_mul_kernel, pointers, dict(BLOCK=1024))


def compile_skinny_gemm_kernels(dtype: str) -> None:
    from ops.linear import skinny_gemm

    pointers = {name: f"*{dtype}" for name in ("X", "W", "B", "Y")} | {"PARTIAL": "*fp32", "WS": "*fp32",
                                                                        "XS": "*fp32"}
    # as launched: 4 stages, 32 or 64 outputs a program (16 or 32 gated), partial sums or not; weights
    # in the activations' dtype, FP8 weights (weight-only), FP8 weights and activations (w8a8)
    for bias, gated, partial, block_m, block_n in ((True, False, False, 16, 64), (False, False, True, 64, 32),
                                                   (False, True, False, 64, 32), (True, True, True, 32, 16)):
        for scaled, a8 in ((False, False), (True, False), (True, True)):
            fp8 = {"W": "*fp8e4nv"} | ({"X": "*fp8e4nv"} if a8 else {})
            compile_for_hopper(skinny_gemm._skinny_kernel, pointers | (fp8 if scaled else {}),
                               dict(HAS_BIAS=bias, GATED=gated, STORE_PARTIAL=partial, SCALED=scaled, A8=a8,
                                    SCALE_N=128 if scaled else 1, SCALE_K=128 if scaled else 1, BLOCK_M=block_m,
                                    BLOCK_N=block_n, BLOCK_K=128, IEEE=dtype == "fp32", PDL=True), num_stages=4)
    for gated in (False, True):
        compile_for_hopper(skinny_gemm._sum_splits_kernel, pointers,
                           dict(HAS_BIAS=True, GATED=gated, SPLIT=4, BLOCK=1024, PDL=True))


def compile_fused_moe_kernels(dtype: str) -> None:
    from ops.moe import fused_moe

    pointers = {name: f"*{dtype}" for name in ("X", "W13", "H", "W2", "TOPK_WEIGHTS", "Y", "OUT")}
    pointers |= {name: "*i32" for name in ("ORDER", "TILE_EXPERT", "TILE_ROW0", "TILE_ROW_END")}
    pointers |= {"TOPK_IDS": "*i64", "S13": "*fp32", "S2": "*fp32"}
    for fp8 in (False, True):  # experts in the activations' dtype, FP8 experts (blocks of 128 x 128)
        weights = pointers | ({"W13": "*fp8e4nv", "W2": "*fp8e4nv"} if fp8 else {})
        scales = dict(SCALED=True, SCALE_N=128, SCALE_K=128) if fp8 else dict(SCALED=False, SCALE_N=1, SCALE_K=1)
        blocks = dict(IEEE=dtype == "fp32", BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, **scales)
        compile_for_hopper(fused_moe._gate_up_kernel, weights, dict(TOP_K=8, **blocks))
        compile_for_hopper(fused_moe._down_kernel, weights, blocks)
        compile_for_hopper(fused_moe._gate_up_pair_kernel, weights,
                           dict(TOP_K=8, BLOCK_N=8, BLOCK_K=128 if fp8 else 512, PDL=True, **scales))
        compile_for_hopper(fused_moe._down_combine_pair_kernel, weights,
                           dict(TOP_K=8, K_POW2=8, BLOCK_N=8, BLOCK_K=128, PDL=True, **scales))
    compile_for_hopper(fused_moe._combine_kernel, pointers, dict(TOP_K=8, K_POW2=8, BLOCK_D=1024))
    from ops.moe import moe_route

    route = {"LOGITS": f"*{dtype}", "WEIGHTS": f"*{dtype}", "IDS": "*i64"}
    compile_for_hopper(moe_route._route_kernel, route, dict(TOP_K=8, K_POW2=8, BLOCK_E=128, NORM=True, PDL=True))


def compile_fp8_kernels(dtype: str) -> None:
    from ops.linear import fp8

    pointers = {"Q": "*fp8e4nv", "S": "*fp32", "W": f"*{dtype}", "X": f"*{dtype}"}
    compile_for_hopper(fp8._dequantize_kernel, pointers, dict(SCALE_N=128, SCALE_K=128, BLOCK_N=32, BLOCK_K=128))
    compile_for_hopper(fp8._quantize_groups_kernel, pointers, dict(GROUP=128))


def compile_sampling_kernels(dtype: str) -> None:
    from ops.sampling import candidates, rejection, scale

    pointers = {"LOGITS": f"*{dtype}", "X": "*fp32", "VALS": "*fp32", "PARAMS": "*fp32", "MAX": "*fp32",
                "SUM": "*fp32", "RACE": "*fp32", "LSE": "*fp32", "SEEN": "*i1", "OVERFLOW": "*i1", "ACTIVE": "*i1"}
    pointers |= {name: "*i64" for name in ("ROWS", "SEEDS", "STEPS", "ARGMAX", "WINNER", "IDX", "OUT", "BEST",
                                           "FIRST")}
    columns = dict(T=0, TOP_K=1, TOP_P=2, MIN_P=3)
    for has_seen in (True, False):
        compile_for_hopper(scale._scale_kernel, pointers, dict(HAS_SEEN=has_seen, T=0, REPETITION=4, PRESENCE=5,
                                                               BLOCK=scale.BLOCK))
    compile_for_hopper(candidates._candidates_kernel, pointers, dict(K=128, CP=64, **columns))
    compile_for_hopper(rejection._rejection_kernel, pointers, dict(TOP_K=1, TOP_P=2, MIN_P=3, BLOCK=rejection.BLOCK))


CASES = {
    "qk_norm_rope_kernel": compile_qk_norm_rope_kernel,
    "decode_attention_kernels": compile_decode_attention_kernels,
    "gemv_and_silu_mul_kernels": compile_gemv_and_silu_mul_kernels,
    "skinny_gemm_kernels": compile_skinny_gemm_kernels,
    "fused_moe_kernels": compile_fused_moe_kernels,
    "fp8_kernels": compile_fp8_kernels,
    "sampling_kernels": compile_sampling_kernels,
}
HALVES = (("qk_norm_rope_kernel", "decode_attention_kernels", "sampling_kernels", "fp8_kernels"),
          ("gemv_and_silu_mul_kernels", "skinny_gemm_kernels", "fused_moe_kernels"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernels", list(CASES))
def test_kernels_compile_for_hopper(compiled, kernels, dtype):
    error = compiled[f"{kernels}:{dtype}"]
    assert error is None, error
