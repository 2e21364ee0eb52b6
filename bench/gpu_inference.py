"""Inference on one CUDA GPU: torch fp16 against fp32 (and transformers' unpadded path where
it is offered), all-MiniLM-L6-v2 on SciFact documents, through densefit's encoder.

    python bench/gpu_inference.py            # ~1 minute; bench/gpu.sh runs it

Each variant embeds the same ``--docs`` documents (seeded sample, 256 tokens, batch
``--batch-size``) after a warm-up, timed with CUDA synchronised: docs/s, peak GPU memory, and
its agreement with fp32 (cosine per document, top-10 overlap of 100 test queries). Variants:

- ``fp32``: the model as loaded;
- ``fp16``: ``model.half()`` (weights and activations fp16);
- ``fp16-unpadded``: fp16 with ``attn_implementation="flash_attention_2"``, whose BERT path
  drops the padding tokens inside attention; only when the ``flash_attn`` package is
  installed (otherwise recorded as not offered, with the reason).

Fails (exit 1, a one-line reason) when there is no CUDA device, when a variant that runs
gives non-finite vectors, or when fp16 drifts below a mean cosine of 0.999 to fp32, rather
than writing a result that hides it. Writes bench/results/inference_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from _runner import DATASETS, RESULTS, ROOT, command_line, environment

sys.path.insert(0, str(ROOT))

MODEL = "all-MiniLM-L6-v2"
MIN_FP16_COSINE = 0.999


def fail(message: str) -> None:
    print(f"gpu_inference: FAILED: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def sample(n: int):
    import random

    from densefit.data.corpus import load_beir

    beir = load_beir(DATASETS / "scifact", "test")
    docs = [d.text for d in beir.corpus.values()]
    docs = random.Random(0).sample(docs, min(n, len(docs)))
    queries = [beir.queries[q] for q in sorted(beir.qrels)[:100]]
    return docs, queries


def run_variant(name: str, docs, queries, args) -> dict:
    import numpy as np
    import torch

    from densefit.models import load_model
    from densefit.retrieval.encode import encode_texts

    kwargs = {}
    if name == "fp16-unpadded":
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            return {
                "variant": name,
                "status": "not offered: the flash_attn package is not installed",
            }
        kwargs = {"attn_implementation": "flash_attention_2"}
    model = load_model(MODEL, device="cuda", max_seq_length=args.max_seq_length)
    if kwargs:
        from sentence_transformers import SentenceTransformer

        from densefit.models import resolve_model_path

        model = SentenceTransformer(
            resolve_model_path(MODEL),
            device="cuda",
            model_kwargs={**kwargs, "torch_dtype": torch.float16},
        )
        model.max_seq_length = args.max_seq_length
    if name.startswith("fp16"):
        model.half()
    encode = lambda texts: encode_texts(model, texts, batch_size=args.batch_size, normalize=True)  # noqa: E731
    encode(docs[: args.batch_size])  # warm-up: kernels, allocator
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    vectors = encode(docs)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    query_vectors = encode(queries)
    if not (np.isfinite(vectors).all() and np.isfinite(query_vectors).all()):
        fail(f"{name}: non-finite embeddings")
    return {
        "variant": name,
        "status": "ok",
        "docs_per_second": round(len(docs) / seconds, 1),
        "seconds": round(seconds, 3),
        "peak_gpu_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1),
        "_vectors": vectors,
        "_queries": query_vectors,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--docs", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--max-seq-length", type=int, default=256)
    args = parser.parse_args(argv)
    import numpy as np
    import torch

    if not torch.cuda.is_available():
        fail("no CUDA device (torch.cuda.is_available() is False)")
    docs, queries = sample(args.docs)
    rows = [run_variant(n, docs, queries, args) for n in ("fp32", "fp16", "fp16-unpadded")]
    base = rows[0]
    reference = base["_vectors"]
    top = np.argsort(-(base["_queries"] @ reference.T), axis=1)[:, :10]
    for row in rows:
        if row["status"] != "ok":
            continue
        cosine = np.sum(row["_vectors"] * reference, axis=1)
        ours = np.argsort(-(row["_queries"] @ row["_vectors"].T), axis=1)[:, :10]
        row["cosine_mean_vs_fp32"] = round(float(cosine.mean()), 6)
        row["cosine_min_vs_fp32"] = round(float(cosine.min()), 6)
        row["top10_overlap_vs_fp32"] = round(
            float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(ours, top, strict=True)])), 4
        )
        row["speedup_vs_fp32"] = round(row["docs_per_second"] / base["docs_per_second"], 3)
        del row["_vectors"], row["_queries"]
    payload = {
        "command": command_line("gpu_inference.py", sys.argv[1:]),
        "model": MODEL,
        "device": torch.cuda.get_device_name(),
        "documents": len(docs),
        "max_seq_length": args.max_seq_length,
        "batch_size": args.batch_size,
        "environment": environment(),
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "inference_gpu.json").write_text(json.dumps(payload, indent=2) + "\n")
    for row in rows:
        print(json.dumps(row), flush=True)
    fp16 = rows[1]
    if fp16["cosine_mean_vs_fp32"] < MIN_FP16_COSINE:
        fail(
            f"fp16 drifts from fp32: mean cosine {fp16['cosine_mean_vs_fp32']} < {MIN_FP16_COSINE}"
        )


if __name__ == "__main__":
    main()
