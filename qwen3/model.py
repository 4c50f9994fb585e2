"""Qwen3, top to bottom: decoder layers of attention and an MLP (or a MoE block), the model, the LM head.

Shapes: N tokens (a forward's, of all its sequences), B batch rows of T tokens (the plain call),
D hidden_size, H query heads, K key/value heads (H % K == 0: grouped-query attention), hd head_dim,
F intermediate_size, V vocab_size, P max_position_embeddings.

Checkpoint keys are Hugging Face's. q/k/v and gate/up are each one matmul here (FusedLinear),
whose rows the checkpoint's separate projections fill (`checkpoint_tensors`). A layer's MLP is
dense (qwen3/layers.py's MLP) or, in a Qwen3-MoE model, the sparse block of router + experts
(qwen3/moe.py); attention is qwen3/attention.py.

One forward: token ids, their positions and the attention metadata the runtime builds (where
each token's keys go, what each query attends to: runtime/metadata.py). The plain call
`model(input_ids)` is its special case of rows from position 0 with no cache.

With tensor parallelism (`tp`, qwen3/parallel.py) each rank holds its share of the heads, of F and
of V: H, K, F and V are then this rank's counts, attention and the MLP each return this rank's
partial sum of their output projection, and DecoderLayer adds the ranks' partial sums.

Two paths compute the same function (config.kernels picks one). The reference path is
transformers' operations one by one (the training path, and what runs on the CPU by default). The
fused path, for inference, runs a projection with the norm in front, attention's input step
(q/k-norm, RoPE, cache write), the one-token attention and SiLU-and-multiply as Triton kernels
(ops/), so that a decode step is a few large kernels per layer, which a CUDA graph then replays.
"""

import torch
from torch import nn

from ops import IMPLS, KERNELS, resolve_kernels
from runtime import metadata
from runtime.checks import check_in_vocab, check_input_ids
from runtime.metadata import AttentionMetadata

from .attention import Attention, TokenBatch, static_shapes, token_batch
from .config import Qwen3Config
from .layers import MLP, FusedLinear, RMSNorm, RotaryEmbedding
from .moe import Experts, SparseMoeBlock, is_sparse_layer
from .parallel import TensorParallel, VocabParallelEmbedding, all_reduce, gather_vocab


class DecoderLayer(nn.Module):
    """Pre-norm block. The residual add of each half is fused into the norm that follows it:
    (h, residual) in, (h, residual) out, the same arithmetic as HF's `residual + hidden_states`.
    With `tp`, attention and the MLP each end in a row-parallel projection: their outputs are
    the ranks' partial sums, added here by an all-reduce (two per layer)."""

    def __init__(self, config: Qwen3Config, layer_idx: int, tp: TensorParallel | None = None):
        super().__init__()
        self.tp = tp
        self.self_attn = Attention(config, layer_idx, tp)
        self.mlp = SparseMoeBlock(config) if is_sparse_layer(config, layer_idx) else MLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_impl)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_impl)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None,
                batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) [N, D] each: the layer's output before its residual add, and the stream."""
        h, residual = self.self_attn(h, batch, residual, self.input_layernorm)
        h, residual = self.mlp(all_reduce(h, self.tp), batch.fused, residual, self.post_attention_layernorm)
        return all_reduce(h, self.tp), residual


class Qwen3Model(nn.Module):
    def __init__(self, config: Qwen3Config, tp: TensorParallel | None = None):
        super().__init__()
        if tp is None:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        else:  # this rank's V/N rows; the lookup ends in an all-reduce
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_impl)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
        """Hidden states after the final norm: [N, D] for input_ids [N], or only at the tokens whose
        logits are wanted (batch.meta.logits_at): the final norm runs only there."""
        h = self.embed_tokens(input_ids)  # [N, D]
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, batch)
        if batch.meta.logits_at is not None:
            h, residual = h[batch.meta.logits_at], residual[batch.meta.logits_at]
        return self.norm(h, residual)[0]


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, config: Qwen3Config, tp: TensorParallel | None = None):
        """tp: this process's place in a tensor-parallel group (qwen3/parallel.py); the layers then
        hold its share of the weights (from_pretrained(tensor_parallel=True) builds and loads it)."""
        super().__init__()
        self.config = config
        self.tp = tp
        self.generation_config: dict = {}  # generation_config.json's defaults, set by the loader
        self.model = Qwen3Model(config, tp)
        # Key/value heads held here, what a KV cache stores: all, or this rank's share.
        self.kv_heads = tp.heads(config)[1] if tp else config.num_key_value_heads
        # With tp: this rank's V/N rows of the head; forward gathers the full logits.
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size // (tp.size if tp else 1), bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attention: AttentionMetadata | None = None) -> torch.Tensor:
        """Logits. The plain call: input_ids [B, T], positions [B, T] (default 0..T-1 in each row)
        -> [B, T, V], each token attending causally to its row; nothing is cached. The runtime's:
        input_ids [N] and positions [N] of the sequences `attention` lays out (its cache, slots,
        what each token attends to) -> [N, V], or [S, V] at attention.logits_at."""
        if attention is None:
            return self.plain_forward(input_ids, positions)
        fused = resolve_kernels(self.config.kernels, input_ids.device) == "fused" and not torch.is_grad_enabled()
        dtype = self.model.embed_tokens.weight.dtype
        batch = token_batch(attention, positions, self.model.rotary_emb, dtype, fused)
        return gather_vocab(self.lm_head(self.model(input_ids, batch)), self.tp)

    def plain_forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """forward's plain call, with its checks: token ids in the vocabulary (one read-back, not
        while a CUDA graph captures or torch.compile traces), positions within the model's."""
        check_input_ids(input_ids)
        B, T = input_ids.shape
        device, limit = input_ids.device, self.config.max_position_embeddings
        if not input_ids.numel():  # no rows, or rows of no token: no logits
            return self.lm_head.weight.new_empty(B, T, self.config.vocab_size)
        if not static_shapes(device):
            check_in_vocab(input_ids, self.config.vocab_size)
        if positions is None:
            if T > limit:
                raise ValueError(f"{T} positions exceed max_position_embeddings={limit}")
            positions = torch.arange(T, device=device).expand(B, T)
        elif positions.shape != (B, T) or positions.dtype != torch.long:
            raise ValueError(f"positions must be a LongTensor shaped like input_ids {(B, T)}")
        elif T and not static_shapes(device):
            low, high = torch.stack(torch.aminmax(positions)).tolist()
            if low < 0 or high >= limit:
                raise ValueError(f"positions must be in [0, max_position_embeddings={limit}), got {low} to {high}")
        # contiguous: T = 1 default positions reshape to a view of stride 0, which kernels cannot index
        logits = self(input_ids.reshape(-1), positions.reshape(-1).contiguous(), metadata.plain(B, T, device))
        return logits.view(B, T, -1)

    @property
    def fp8_block(self) -> tuple[int, int] | None:
        """The block size of the weights held in FP8 (qwen3/quantized.py), None when none is."""
        return next((m.weight_block for m in self.modules() if getattr(m, "weight_block", None)), None)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """{Hugging Face checkpoint key: the parameter, or the rows of a fused one, it fills}. The
        loader copies each checkpoint tensor into its entry; saving these gives a HF checkpoint."""
        fused = {name: module for name, module in self.named_modules() if isinstance(module, FusedLinear)}
        experts = {name: module for name, module in self.named_modules() if isinstance(module, Experts)}
        tensors = {}
        for name, param in self.named_parameters():  # tied weights are listed once
            module, _, kind = name.rpartition(".")
            if module in fused:
                parent = module.rpartition(".")[0]
                for part, rows in fused[module].part_rows(param).items():
                    tensors[f"{parent}.{part}.{kind}"] = rows
            elif module in experts:  # stacked experts: one checkpoint tensor per expert and projection
                for key, view in experts[module].checkpoint_views(kind, param).items():
                    tensors[f"{module}.{key}"] = view
            else:
                tensors[name] = param
        return tensors

    @classmethod
    def from_pretrained(
        cls,
        path,
        dtype: torch.dtype | str | None = None,
        device: str | torch.device = "cpu",
        norm_impl: str | None = None,
        progress: bool = True,
        tensor_parallel: bool = False,
        kernels: str | None = None,
        revision: str | None = None,
        quantization: str | None = None,
    ) -> "Qwen3ForCausalLM":
        """Load a Hugging Face Qwen3 checkpoint (config.json, model.safetensors or a sharded
        model.safetensors.index.json, optionally generation_config.json): `path` is its directory,
        or a Hugging Face repo id ("Qwen/Qwen3-8B") at `revision`, found in huggingface_hub's cache
        or downloaded into it (qwen3/hub.py; a directory that exists always wins).

        dtype: a torch dtype or its name ("bfloat16", "float32", "float16"), or "auto" for the
            checkpoint's; None: float32 on the CPU (where 16-bit matmuls run several times
            slower), the checkpoint's on a GPU.
        device: where the weights go ("cpu", "cuda", "cuda:1", a torch.device).
        norm_impl: "auto" | "torch" | "triton" | "cuda": the RMSNorm implementation of every norm
            ("auto": triton on CUDA, torch elsewhere; default: the config's, else "auto").
        kernels: "auto" | "fused" | "reference": the fused Triton kernels of inference steps or
            transformers' operations one by one ("auto": fused on CUDA, reference elsewhere;
            default: the config's, else "auto"). The fused kernels normalize inside themselves,
            with the norm's arithmetic; norm_impl picks every other norm.
        progress: a progress bar while loading takes long.
        tensor_parallel: split the model over the ranks of the initialized torch.distributed
            default process group (torchrun; NCCL on GPUs, gloo on the CPU), each process reading
            only its part of each tensor (qwen3/parallel.py has the layout). Every rank must call
            this, and then the forward and generate, with the same arguments; each gets the full
            logits and the same tokens. "cuda" means cuda:LOCAL_RANK. Inference only (the
            parameters do not require grad). A ValueError without a process group, for a model
            whose heads (or F, V) do not divide over the ranks, and for Qwen3-MoE checkpoints.
        revision: the branch, tag or commit of a repo id (default: its main branch).
        quantization: "fp8" quantizes the decoder's projections of a floating-point checkpoint
            as it loads, in Qwen's FP8 format (blocks of 128 x 128; qwen3/quantized.py). An FP8
            checkpoint (Qwen3-*-FP8) is FP8 whatever this says. FP8 weights stay FP8, read by
            the fused kernels at half bf16's bytes, on one GPU of compute capability 8.9 or
            newer; on the reference path they are dequantized to `dtype` (bf16's memory).

        Every tensor's name and shape is checked against the config before anything is copied;
        a mismatch raises a ValueError naming the file and the tensor.
        """
        from .hub import resolve_checkpoint
        from .loader import load_model
        from .quantized import check_quantization

        check_quantization(quantization)  # before a repo id downloads
        return load_model(cls, resolve_checkpoint(path, revision), dtype=dtype, device=device, norm_impl=norm_impl,
                          progress=progress, tensor_parallel=tensor_parallel, kernels=kernels,
                          quantization=quantization)

    def set_norm_impl(self, impl: str) -> None:
        """Switch every RMSNorm in the model (input, post-attention, q, k, final) to `impl`."""
        if impl not in IMPLS:
            raise ValueError(f"norm_impl must be one of {IMPLS}, got {impl!r}")
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.impl = impl
        self.config.norm_impl = impl

    def set_kernels(self, kernels: str) -> None:
        """Switch what computes inference steps: "fused" Triton kernels, "reference" operations, "auto"."""
        if kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
        self.config.kernels = kernels

    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int = 32,
        *,
        attention_mask: torch.Tensor | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        presence_penalty: float | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        seed: int | None = None,
        on_token=None,
        cuda_graph: bool | None = None,
    ) -> torch.Tensor:
        """Token ids [B, T + n]: each prompt row followed by its n <= max_new_tokens new tokens.

        input_ids [B, T]: prompts, padded on the left or the right when their lengths differ,
            with attention_mask [B, T] (1 = token, 0 = padding). Each row generates what it would
            alone (not with FP8 weights held on the fused path: a batch of 2-64 rows rounds its
            activations to FP8, a row alone does not; qwen3/quantized.py).
        temperature (0 = greedy), top_k (0 = off), top_p (1 = off), min_p (0 = off),
        repetition_penalty (1 = off), presence_penalty (0 = off): sampling, applied in
            transformers' order; unset ones come from the checkpoint's generation_config.json,
            else temperature 1 and the rest off.
        eos_token_id: stop ids (default: generation_config's, else the config's). A row stops at
            its first; it is padded with pad_token_id (default: the first eos id) until all stop.
        seed: reproducible sampling: every row draws from this seed's stream, so a row samples what its
            prompt samples alone (identical prompts, identical samples); None: each row a stream of its own.
        on_token: called with the new ids [B] of each step (a tensor on the host), in order, for streaming.
        cuda_graph: replay the decode step from a CUDA graph (default: on for CUDA, off otherwise).
        """
        from runtime.generate import generate

        tokens = generate(
            self, input_ids, max_new_tokens, attention_mask=attention_mask, temperature=temperature, top_k=top_k,
            top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
            eos_token_id=eos_token_id, pad_token_id=pad_token_id, seed=seed, on_token=on_token, cuda_graph=cuda_graph,
        )
        return tokens.clone()  # outside inference mode: a tensor autograd may use (to score the text, say)
