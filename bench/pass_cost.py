"""What one forward pass of the query encoder costs: a fixed part plus a part per token.

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python bench/pass_cost.py      # about 2 minutes

all-MiniLM-L6-v2, embedding queries as ``densefit serve`` does (``encode_texts``: tokenise,
forward pass without gradients, pool, copy out): for batches of 1, 2, 4, 8, 16 and 32 queries
of 8, 16, 32 and 48 tokens each, the median of ``--repeats`` timed passes (after one
untimed), then a least-squares fit

    seconds per pass = fixed + per_token x (rows x length)

over all passes and over passes of up to 512 tokens (the query batches a server forms: a
few to 32 queries of 5-40 tokens). The ratio ``fixed / per_token`` is the pass cost in
tokens of work that ``densefit.serve.app.PASS_COST_TOKENS`` splits query batches by
(:func:`densefit.retrieval.encode.padding_aware_cuts`). One torch thread, the setting of each
of the server's two query workers on a 2-core machine. Writes
bench/results/pass_cost.{json,csv,png}.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from _common import pyplot  # noqa: E402
from _runner import RESULTS, command_line, environment, loadavg  # noqa: E402

ROWS = (1, 2, 4, 8, 16, 32)
LENGTHS = (8, 16, 32, 48)


def query_texts(model, rows: int, length: int, seed: int) -> list[str]:
    """``rows`` distinct texts of exactly ``length`` tokens ([CLS] and [SEP] included): random
    whole words of the model's vocabulary (distinct, since identical texts are embedded once)."""
    import random

    vocab = [w for w in model.tokenizer.get_vocab() if w.isalpha() and len(w) >= 3]
    rng = random.Random(seed)
    texts = [" ".join(rng.sample(vocab, length - 2)) for _ in range(rows)]
    for text in texts:
        got = len(model.tokenizer(text)["input_ids"])
        if got != length:
            raise RuntimeError(f"a text of {got} tokens, wanted {length}: {text!r}")
    return texts


def time_pass(model, rows: int, length: int, repeats: int) -> float:
    """Median seconds of one :func:`~densefit.retrieval.encode.encode_texts` pass (tokenise,
    forward, pool, copy out) of ``rows`` distinct texts of ``length`` tokens, as the server
    runs it."""
    from densefit.retrieval.encode import encode_texts

    times = []
    for i in range(repeats + 1):
        texts = query_texts(model, rows, length, seed=i)
        started = time.perf_counter()
        encode_texts(model, texts, batch_size=rows)
        if i:  # the first pass is untimed
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def fit(points: list[dict]) -> tuple[float, float]:
    """Least-squares ``(fixed, per_token)`` of seconds = fixed + per_token x tokens."""
    xs = [p["tokens"] for p in points]
    ys = [p["seconds"] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    per_token = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    return my - per_token * mx, per_token


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()

    import torch

    from densefit.models import load_model

    load_before = loadavg()
    model = load_model("all-MiniLM-L6-v2", device="cpu").eval()
    points = []
    for rows in ROWS:
        for length in LENGTHS:
            seconds = time_pass(model, rows, length, args.repeats)
            points.append(
                {"rows": rows, "length": length, "tokens": rows * length, "seconds": seconds}
            )
            print(json.dumps(points[-1]), flush=True)
    fits = {}
    for name, limit in (("passes_up_to_512_tokens", 512), ("all_passes", None)):
        fixed, per_token = fit([p for p in points if limit is None or p["tokens"] <= limit])
        fits[name] = {
            "fixed_ms": round(fixed * 1e3, 3),
            "per_token_ms": round(per_token * 1e3, 4),
            "pass_cost_tokens": round(fixed / per_token, 1),
        }
    payload = {
        "command": command_line("pass_cost.py", sys.argv[1:]),
        "environment": environment() | {"torch_threads": torch.get_num_threads()},
        "loadavg_before": load_before,
        "loadavg_after": loadavg(),
        "repeats": args.repeats,
        "fits": fits,
        "points": points,
    }
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "pass_cost.json").write_text(json.dumps(payload, indent=2) + "\n")
    with open(args.results / "pass_cost.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["rows", "length", "tokens", "seconds"])
        writer.writeheader()
        writer.writerows(points)
    print(json.dumps(fits))
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 4))
        for length in LENGTHS:
            mine = [p for p in points if p["length"] == length]
            ax.plot([p["tokens"] for p in mine], [p["seconds"] * 1e3 for p in mine], "o",
                    label=f"{length} tokens a query")  # fmt: skip
        top = max(p["tokens"] for p in points)
        for (name, f), style in zip(fits.items(), ("k--", "k:"), strict=True):
            ax.plot([0, top], [f["fixed_ms"], f["fixed_ms"] + f["per_token_ms"] * top], style,
                    label=f"fit of {name.replace('_', ' ')}: {f['fixed_ms']:.1f} ms + "
                    f"{f['per_token_ms']:.3f} ms/token")  # fmt: skip
        ax.set_xlabel("tokens in the pass (rows x length)")
        ax.set_ylabel("ms per forward pass")
        ax.set_title("all-MiniLM-L6-v2 query pass, one CPU thread")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.results / "pass_cost.png", dpi=120)


if __name__ == "__main__":
    main()
