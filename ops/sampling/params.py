"""The per-row sampling parameters as the kernels read them: a float32 table [rows, len(PARAMS)],
one column per parameter in this order (top_k as a float: exact up to 2^24, far past any vocabulary)."""

PARAMS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty")
# Each parameter's value that changes nothing (a row that is never set samples plainly).
NEUTRAL = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0)
