"""Attention's kernels: q/k norm + RoPE + cache write (qk_norm_rope), one token per row over its
cached keys (decode_attention)."""
