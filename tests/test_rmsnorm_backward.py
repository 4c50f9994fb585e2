"""Triton RMSNorm backward, its autograd and torch.library registration, against autograd
through transformers' Qwen3RMSNorm."""

import pytest
import torch
from conftest import DEVICE, requires_cuda
from tolerances import BACKWARD_16BIT_ERROR_SLACK, BACKWARD_FP32_RTOL, assert_matches_hf, relative_error
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from ops import fused_add_rms_norm, rms_norm
from ops.norm import rmsnorm_triton as tri
from runtime.graphs import warm_up_on

# Inductor on a GPU; on the CPU the traced graph runs eagerly (Inductor's CPU code is not what is tested).
COMPILE_BACKEND = "inductor" if DEVICE.type == "cuda" else "aot_eager"


def make_case(rows, D, dtype, seed=0, weight_dtype=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, D, generator=gen)
    w = torch.randn(D, generator=gen) * 0.5 + 1.0
    dy = torch.randn(rows, D, generator=gen)
    to = dict(device=DEVICE)
    return x.to(dtype=dtype, **to), w.to(dtype=weight_dtype or dtype, **to), dy.to(**to)


def hf_grads(x, w, dy, eps=1e-6, dtype=None):
    """(y, dx, dw) by autograd through the HF module, computed in `dtype` (default: the inputs')."""
    module = Qwen3RMSNorm(x.shape[-1], eps=eps).to(device=x.device, dtype=dtype or w.dtype)
    with torch.no_grad():
        module.weight.copy_(w)
    xx = x.detach().to(dtype or x.dtype).requires_grad_(True)
    y = module(xx)
    y.backward(dy.to(y.dtype))
    return y.detach(), xx.grad, module.weight.grad


def our_grads(x, w, dy, eps=1e-6):
    xx, ww = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    y = rms_norm(xx, ww, eps, impl="triton")
    y.backward(dy.to(y.dtype))
    return y.detach(), xx.grad, ww.grad


@pytest.mark.parametrize("D", [1, 7, 128, 1000, 4096])
def test_fp32_gradients_match_hf_autograd(D):
    x, w, dy = make_case(33, D, torch.float32)
    _, dx, dw = our_grads(x, w, dy)
    _, dx_hf, dw_hf = hf_grads(x, w, dy)
    torch.testing.assert_close(dx, dx_hf, rtol=BACKWARD_FP32_RTOL, atol=BACKWARD_FP32_RTOL)
    torch.testing.assert_close(dw, dw_hf, rtol=BACKWARD_FP32_RTOL, atol=BACKWARD_FP32_RTOL * 33)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 1024, 2176])
def test_16bit_gradients_no_worse_than_hf(dtype, D):
    """Against a float64 truth, our 16-bit gradients err no more than HF's own 16-bit autograd."""
    x, w, dy = make_case(300, D, dtype, seed=D)
    dy = dy.to(dtype)
    _, dx, dw = our_grads(x, w, dy)
    _, dx_hf, dw_hf = hf_grads(x, w, dy)
    _, dx_64, dw_64 = hf_grads(x.double(), w.double(), dy.double(), dtype=torch.float64)
    assert dx.dtype == dtype and dw.dtype == dtype
    assert relative_error(dx, dx_64) <= relative_error(dx_hf, dx_64) * BACKWARD_16BIT_ERROR_SLACK
    assert relative_error(dw, dw_64) <= relative_error(dw_hf, dw_64) * BACKWARD_16BIT_ERROR_SLACK


def test_bf16_input_fp32_weight_gradients():
    x, w, dy = make_case(40, 256, torch.bfloat16, weight_dtype=torch.float32)
    y, dx, dw = our_grads(x, w, dy)
    y_hf, dx_hf, dw_hf = hf_grads(x, w, dy)
    assert y.dtype == torch.float32 and dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    _, dx_64, dw_64 = hf_grads(x.double(), w.double(), dy.double(), dtype=torch.float64)
    assert relative_error(dx, dx_64) <= relative_error(dx_hf, dx_64) * BACKWARD_16BIT_ERROR_SLACK
    assert relative_error(dw, dw_64) <= relative_error(dw_hf, dw_64) * BACKWARD_16BIT_ERROR_SLACK


def test_dweight_is_deterministic():
    x, w, dy = make_case(1000, 512, torch.bfloat16)
    grads = [our_grads(x, w, dy)[2] for _ in range(3)]
    assert all(torch.equal(grads[0], g) for g in grads[1:])


def test_backward_on_strided_input():
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(6, 4, 3 * 64, generator=gen).to(DEVICE)
    x = base[..., 64:128]  # rows two strides apart, read in place
    w = (torch.randn(64, generator=gen) + 1).to(DEVICE)
    dy = torch.randn(6, 4, 64, generator=gen).to(DEVICE)
    _, dx, dw = our_grads(x, w, dy)
    _, dx_hf, dw_hf = hf_grads(x, w, dy)
    torch.testing.assert_close(dx, dx_hf, rtol=BACKWARD_FP32_RTOL, atol=BACKWARD_FP32_RTOL)
    torch.testing.assert_close(dw, dw_hf, rtol=BACKWARD_FP32_RTOL, atol=BACKWARD_FP32_RTOL * 24)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_gradients_match_hf_decoder(dtype):
    """s = residual + x; y = norm(s); both s (the next residual) and y carry gradient."""
    x, w, dy = make_case(50, 384, dtype, seed=1)
    residual, _, ds = make_case(50, 384, dtype, seed=2)
    dy, ds = dy.to(dtype), ds.to(dtype)

    def run(fn, x, residual, w):
        x, residual, w = (t.detach().clone().requires_grad_(True) for t in (x, residual, w))
        y, s = fn(x, residual, w)
        torch.autograd.backward([y, s], [dy.to(y.dtype), ds.to(s.dtype)])
        return x.grad, residual.grad, w.grad

    def hf(x, residual, w):
        module = Qwen3RMSNorm(x.shape[-1]).to(device=x.device, dtype=w.dtype)
        del module.weight
        module.weight = w  # HF's forward, with gradient flowing to our leaf
        s = residual + x
        return module(s), s

    ours = run(lambda x, r, w: fused_add_rms_norm(x, r, w, impl="triton"), x, residual, w)
    theirs = run(hf, x, residual, w)
    if dtype == torch.float32:
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=BACKWARD_FP32_RTOL, atol=BACKWARD_FP32_RTOL * 50)
    else:
        truth = run(hf, x.double(), residual.double(), w.double())
        for a, b, t in zip(ours, theirs, truth):
            assert relative_error(a, t) <= relative_error(b, t) * BACKWARD_16BIT_ERROR_SLACK


def test_fused_add_gradients_with_mixed_dtypes():
    """Autocast: bf16 branch output + fp32 residual stream, as the HF decoder adds them; the
    gradients come back in each input's dtype and match autograd through HF's module."""
    x, w, dy = make_case(20, 128, torch.bfloat16, seed=3, weight_dtype=torch.float32)
    residual = torch.randn(20, 128, generator=torch.Generator().manual_seed(4)).to(DEVICE)

    def grads(fn):
        a, r, ww = (t.detach().clone().requires_grad_(True) for t in (x, residual, w))
        y, s = fn(a, r, ww)
        torch.autograd.backward([y, s], [dy, dy])
        return a.grad, r.grad, ww.grad

    def hf(a, r, ww):
        module = Qwen3RMSNorm(a.shape[-1]).to(device=a.device)
        del module.weight
        module.weight = ww
        s = r + a
        return module(s), s

    for ours, ref in zip(grads(lambda a, r, ww: fused_add_rms_norm(a, r, ww, impl="triton")), grads(hf)):
        assert ours.dtype == ref.dtype
        torch.testing.assert_close(ours, ref, rtol=BACKWARD_FP32_RTOL, atol=BACKWARD_FP32_RTOL * 20)


def test_fused_add_gradients_when_one_output_is_unused():
    """The next residual (the sum) or the normalized output alone carries gradient: the other
    output's gradient is absent, not zero-filled, and the backward still follows HF's decoder."""
    x, w, dy = make_case(12, 64, torch.float32, seed=6)
    residual = torch.randn(12, 64, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    for used in (1, 0):
        ours = [t.detach().clone().requires_grad_(True) for t in (x, residual, w)]
        fused_add_rms_norm(*ours, impl="triton")[used].backward(dy)
        theirs = [t.detach().clone().requires_grad_(True) for t in (x, residual, w)]
        s = theirs[1] + theirs[0]
        (s if used else rms_norm(s, theirs[2], impl="torch")).backward(dy)
        for a, b in zip(ours, theirs):
            if b.grad is None:
                assert a.grad is None or not a.grad.any()
            else:
                torch.testing.assert_close(a.grad, b.grad, rtol=BACKWARD_FP32_RTOL, atol=BACKWARD_FP32_RTOL * 12)


def test_wide_rows_backward_is_refused():
    x = torch.randn(2, tri.MAX_BACKWARD_D + 1, device=DEVICE, requires_grad=True)
    w = torch.ones(x.shape[-1], device=DEVICE)
    y = rms_norm(x, w, impl="triton")
    with pytest.raises(ValueError, match=f"D <= {tri.MAX_BACKWARD_D}"):
        y.sum().backward()


@pytest.mark.parametrize(
    "op, args",
    [
        (tri.rms_norm_op, lambda x, w, store_rstd: (x, w, 1e-6, store_rstd)),
        (tri.fused_add_rms_norm_op, lambda x, w, store_rstd: (x, x.flip(0), w, 1e-5, store_rstd)),
    ],
)
@pytest.mark.parametrize("store_rstd", [True, False])
def test_opcheck(op, args, store_rstd):
    # The ops are differentiated through ops' autograd Functions, not by a formula of their own,
    # so they are checked on inputs without gradients. test_aot_dispatch_dynamic traces with
    # symbolic shapes into real kernels; it passes on CPU tensors through the interpreter because
    # these are registered ops, opaque to the tracer.
    x = torch.randn(8, 64, device=DEVICE)
    w = torch.randn(64, device=DEVICE)
    torch.library.opcheck(op, args(x, w, store_rstd))


def test_backward_opcheck():
    x, w, dy = make_case(8, 64, torch.float32)
    rstd = tri.rms_norm_op(x, w, 1e-6, True)[1]
    torch.library.opcheck(tri.rms_norm_backward_op, (dy, x, w, rstd, None))
    torch.library.opcheck(tri.rms_norm_backward_op, (dy, x, w, rstd, dy.flip(0)))


def test_backward_op_refuses_missing_rstd():
    """A forward told not to store rstd (store_rstd=False) leaves the backward nothing to read:
    the backward op says so instead of reading past the end of an empty tensor."""
    x, w, dy = make_case(4, 64, torch.float32)
    rstd = tri.rms_norm_op(x, w, 1e-6, False)[1]
    with pytest.raises(ValueError, match="rstd of every row"):
        tri.rms_norm_backward_op(dy, x, w, rstd, None)


def block(x, residual, w):
    """A decoder's norms: the fused add, then a norm of a function of its output."""
    y, s = fused_add_rms_norm(x, residual, w, impl="triton")
    return rms_norm(y * 2.0, w, impl="triton") + s


def test_compile_sees_one_node_without_graph_break():
    x, w, _ = make_case(16, 128, torch.float32)
    explanation = torch._dynamo.explain(block)(x, x.flip(0), w)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    compiled = torch.compile(block, fullgraph=True, backend=COMPILE_BACKEND)
    torch.testing.assert_close(compiled(x, x.flip(0), w), block(x, x.flip(0), w), rtol=0, atol=0)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_gradients_equal_eager(dynamic):
    """torch.compile(fullgraph=True) traces the autograd Functions: the backward op replaces the
    fused add's and the norm's backward, with the gradients of the eager calls bit for bit; with
    dynamic=True one graph serves two row counts (the ops' fakes take symbolic shapes)."""
    compiled = torch.compile(block, fullgraph=True, dynamic=dynamic, backend=COMPILE_BACKEND)
    for rows in (16, 24) if dynamic else (16,):
        x, w, dy = make_case(rows, 128, torch.float32, seed=rows)
        residual = x.flip(0)

        def grads(fn):
            leaves = [t.detach().clone().requires_grad_(True) for t in (x, residual, w)]
            fn(*leaves).backward(dy)
            return [t.grad for t in leaves]

        for got, want in zip(grads(compiled), grads(block)):
            assert torch.equal(got, want)


@pytest.mark.parametrize("dy_requires_grad", [False, True])
def test_second_derivative_is_refused(dy_requires_grad):
    """The backward is not differentiable: differentiating a gradient raises (the gradient has no
    graph, or a node that refuses) instead of returning zeros."""
    x, w, dy = make_case(4, 64, torch.float32)
    x.requires_grad_(True)
    dy.requires_grad_(dy_requires_grad)
    norms = (lambda a: rms_norm(a, w, impl="triton"), lambda a: fused_add_rms_norm(a, a.flip(0), w, impl="triton")[0])
    for norm in norms:
        (dx,) = torch.autograd.grad(norm(x), x, dy, create_graph=True)
        with pytest.raises(RuntimeError, match="does not require grad|once_differentiable"):
            dx.sum().backward()


@requires_cuda
def test_cuda_impl_refuses_gradients():
    """impl='cuda' has no backward: where autograd would record the call it raises instead of
    returning outputs cut off from the graph; under no_grad it runs and matches HF's module."""
    x, w, _ = make_case(8, 256, torch.bfloat16)
    residual = torch.randn_like(x)
    for needs_grad in (x, w, residual):
        needs_grad.requires_grad_(True)
        with pytest.raises(NotImplementedError, match="impl='cuda' has no backward"):
            fused_add_rms_norm(x, residual, w, impl="cuda")
        if needs_grad is not residual:
            with pytest.raises(NotImplementedError, match="impl='cuda' has no backward"):
                rms_norm(x, w, impl="cuda")
        needs_grad.requires_grad_(False)
    x.requires_grad_(True)
    module = Qwen3RMSNorm(256).to(device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(w)
        assert_matches_hf(rms_norm(x, w, impl="cuda"), x.detach(), module)
        y, s = fused_add_rms_norm(x, residual, w, impl="cuda")
        assert torch.equal(s, residual + x) and not y.requires_grad


@requires_cuda
def test_cuda_graph_replays_forward_on_new_inputs():
    x, w, _ = make_case(48, 256, torch.bfloat16)
    residual = torch.randn_like(x)
    static_x = x.clone()
    stream = torch.cuda.Stream()  # warmed and captured on one stream (runtime/graphs.py)
    warm_up_on(stream, lambda: fused_add_rms_norm(static_x, residual, w, impl="triton"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        static_y, static_s = fused_add_rms_norm(static_x, residual, w, impl="triton")
    for seed in (1, 2):
        static_x.copy_(make_case(48, 256, torch.bfloat16, seed=seed)[0])
        graph.replay()
        y, s = fused_add_rms_norm(static_x, residual, w, impl="triton")
        assert torch.equal(static_y, y) and torch.equal(static_s, s)


@requires_cuda
def test_cuda_graph_replays_forward_and_backward_on_new_inputs():
    """A whole training step (fused add, norm, backward) captured once, replayed on new data:
    the static gradients equal an eager step's on the same data."""
    x, w, dy = make_case(48, 256, torch.bfloat16)
    dy, residual = dy.to(torch.bfloat16), torch.randn_like(x)
    static_x, static_w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)

    def step(a, b):
        y, s = fused_add_rms_norm(a, residual, b, impl="triton")
        (rms_norm(y, b, impl="triton") + s).backward(dy)

    def fresh_step():
        static_x.grad = static_w.grad = None
        step(static_x, static_w)

    stream = torch.cuda.Stream()  # warmed and captured on one stream (runtime/graphs.py)
    warm_up_on(stream, fresh_step)
    static_x.grad = static_w.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step(static_x, static_w)
    for seed in (1, 2):
        with torch.no_grad():
            static_x.copy_(make_case(48, 256, torch.bfloat16, seed=seed)[0])
        graph.replay()
        eager_x, eager_w = (t.detach().clone().requires_grad_(True) for t in (static_x, static_w))
        step(eager_x, eager_w)
        assert torch.equal(static_x.grad, eager_x.grad) and torch.equal(static_w.grad, eager_w.grad)
