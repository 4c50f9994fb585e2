"""Linear layers of few rows: one row (gemv, with the norm in front: gemv_rms_norm), a few rows
(skinny_gemm), and SiLU-and-multiply (silu_mul)."""
