"""Decode tokens/s against batch size from a bench_generate.py result, one panel per model.

    python scripts/plot_decode.py docs/benchmarks/decode-h200.json docs/benchmarks/decode-h200.png
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit("usage: plot_decode.py RESULT.json OUT.png")
    data = json.loads(Path(sys.argv[1]).read_text())
    # one panel per architecture; its FP8 rows ("qwen3-8b-fp8": bench_generate.py --quantization fp8) beside
    models = sorted({r["model"].removesuffix("-fp8") for r in data["results"]})
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        lines = [(model, "ours", "ours"), (f"{model}-fp8", "ours", "ours, FP8 weights")]
        lines += [(model, engine, engine) for engine in ("ours_eager", "hf_static_compile", "hf_eager")]
        for name, engine, label in lines:
            rows = sorted((r["batch"], r["decode_tok_s"]) for r in data["results"]
                          if r["model"] == name and r["engine"] == engine and r.get("tp", 1) == 1)
            if rows:
                ax.plot(*zip(*rows), marker="o", label=label)
        ax.set(title=f"{model}, bf16 activations, {data['gpu']}", xlabel="batch", ylabel="decode tokens/s",
               xscale="log", yscale="log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    commits = sorted({r.get("commit", data["commit"]) for r in data["results"]})
    fig.suptitle(f"greedy decode, 128-token prompt, 256 new; commits {', '.join(commits)}, {data['date']}")
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)


if __name__ == "__main__":
    main()
