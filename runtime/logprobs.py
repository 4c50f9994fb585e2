"""Log-probabilities of the chosen tokens and of the most likely ones, as OpenAI's API returns them
(`logprobs`, `top_logprobs`).

    lp = token_logprobs(logits, tokens)      # on the device, nothing read back: a CUDA graph captures it
    host = lp.to_host()                      # queued behind the step (pinned memory on CUDA)
    host.tolist(k)                           # per row: (its token's log-prob, k top ids, k top log-probs)

The values are the model's own distribution: log_softmax of the raw logits in fp32, before the
penalties, temperature and top-k/top-p/min-p that chose the token (vLLM's default, its
`raw_logprobs`). A request's log-probabilities then say what the model thinks of its text, the
same whatever it was sampled with, and a greedy token's is the first of its top ones. Under a
grammar (structured output) the logits are the masked ones, as vLLM's: the tokens the grammar
does not allow have none.
"""

from dataclasses import dataclass

import torch

# The most top log-probabilities a request may ask for per token (OpenAI's bound for chat): every
# step that returns log-probabilities computes this many per row, and a row keeps the ones it asked.
MAX_LOGPROBS = 20

# One token's: its log-prob, then the ids and log-probs of the k most likely tokens, most likely first.
TokenLogprobs = tuple[float, list[int], list[float]]


@dataclass
class Logprobs:
    chosen: torch.Tensor  # [B] float32: each row's chosen token's log-prob
    top_values: torch.Tensor  # [B, MAX_LOGPROBS] float32, descending
    top_ids: torch.Tensor  # [B, MAX_LOGPROBS] int64

    def __getitem__(self, rows) -> "Logprobs":
        return Logprobs(self.chosen[rows], self.top_values[rows], self.top_ids[rows])

    def to_host(self) -> "Logprobs":
        """The values copied to the host, queued behind the work in flight (read them once it is done)."""
        if self.chosen.device.type != "cuda":
            return self
        return Logprobs(*(t.to("cpu", non_blocking=True) for t in (self.chosen, self.top_values, self.top_ids)))

    def tolist(self, k: int = MAX_LOGPROBS) -> list[TokenLogprobs]:
        """Every row's, with its k top ones (host tensors)."""
        return list(zip(self.chosen.tolist(), self.top_ids[:, :k].tolist(), self.top_values[:, :k].tolist()))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> Logprobs:
    """The log-probabilities of tokens [B] under logits [B, V], and the MAX_LOGPROBS most likely (see the module)."""
    x = logits.float()
    norm = torch.logsumexp(x, dim=-1, keepdim=True)
    top_values, top_ids = x.topk(min(MAX_LOGPROBS, x.shape[-1]), dim=-1)
    chosen = x.gather(-1, tokens[:, None]) - norm
    return Logprobs(chosen.squeeze(-1), top_values - norm, top_ids)


def keep(token: TokenLogprobs, k: int) -> TokenLogprobs:
    """A token's log-probs with its k top ones only, none of them impossible (a grammar's mask sets
    the tokens it does not allow to -inf: fewer than k may be left)."""
    logprob, ids, values = token
    kept = [i for i, v in enumerate(values[:k]) if v != float("-inf")]
    return logprob, [ids[i] for i in kept], [values[i] for i in kept]
