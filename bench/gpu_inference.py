"""Inference on one CUDA GPU: densefit's encoder at fp32, fp16 and bf16 against
``SentenceTransformer.encode`` at fp32 and fp16, in one process, and where the time goes.

    python bench/gpu_inference.py              # about a minute; bench/gpu.sh runs it
    python bench/gpu_inference.py --device cpu --docs 64 --queries 8 --name smoke

all-MiniLM-L6-v2 embeds the same ``--docs`` SciFact documents (a seeded sample, 256 tokens,
batch ``--batch-size``) with each variant, after a warm-up on a part of them; each is timed
``--repeats`` times (CUDA synchronised) and its best time is reported as documents/s, with
the allocator's peak. Every variant's vectors are compared with densefit fp32's: cosine per
document (mean, min) and the top-10 overlap of ``--queries`` test queries (embedded by the
same variant). Variants:

- ``densefit-fp32`` / ``-fp16`` / ``-bf16``: :func:`~densefit.retrieval.encode.encode_texts`
  with ``--precision`` (the pipeline: tokenizer threads, pinned non-blocking copies,
  token-sized batches, one synchronisation per window; the half precisions from a cast copy
  of the transformer, scaled-dot-product attention);
- ``st-fp32`` / ``st-fp16``: ``SentenceTransformer.encode(batch_size=...)`` on the model as
  loaded and on a ``.half()`` copy.

The profile (``--profile-docs`` documents through densefit fp32 and fp16, torch.profiler):
wall time against the GPU's kernel time (how much of the wall the GPU computes), the host
time per batch, the CPU ops and CUDA kernels that take the most time, written to
bench/results/inference_gpu_profile.txt.

Issue 37's targets are checked (``targets``): fp16 at least 1.5x densefit fp32 and at least
``st-fp16``, at a cosine >= 0.999 to fp32; fp32 at least ``st-fp32``. Exits non-zero, saying
why, when a variant gives non-finite vectors. Writes bench/results/inference_gpu.json
(``--name`` replaces ``inference_gpu``).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time

from _runner import DATASETS, RESULTS, ROOT, command_line, environment

sys.path.insert(0, str(ROOT))

MODEL = "all-MiniLM-L6-v2"
MIN_COSINE = 0.999
VARIANTS = ("densefit-fp32", "densefit-fp16", "densefit-bf16", "st-fp32", "st-fp16")


def fail(message: str) -> None:
    print(f"gpu_inference: FAILED: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def sample(n_docs: int, n_queries: int):
    import random

    from densefit.data.corpus import load_beir

    beir = load_beir(DATASETS / "scifact", "test")
    docs = [d.text for d in beir.corpus.values()]
    docs = random.Random(0).sample(docs, min(n_docs, len(docs)))
    queries = [beir.queries[q] for q in sorted(beir.qrels)[:n_queries]]
    return docs, queries


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def encoder(name: str, model, args):
    """``encode(texts)`` of variant ``name``: normalised float32 vectors."""
    import numpy as np

    from densefit.retrieval.encode import configure_model, encode_texts

    if name.startswith("densefit"):
        configure_model(model, precision=name.split("-")[1])
        return lambda texts: encode_texts(model, texts, batch_size=args.batch_size, normalize=True)
    st = model if name == "st-fp32" else copy.deepcopy(model).half()
    return lambda texts: np.asarray(
        st.encode(texts, batch_size=args.batch_size, normalize_embeddings=True), dtype=np.float32
    )


def run_variant(name: str, model, docs, queries, args) -> dict:
    import numpy as np
    import torch

    encode = encoder(name, model, args)
    encode(docs[: max(args.batch_size * 4, len(docs) // 4)])  # warm-up: kernels, widths, copies
    synchronize(args.device)
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        vectors = encode(docs)
        synchronize(args.device)
        times.append(time.perf_counter() - started)
    query_vectors = encode(queries)
    if not (np.isfinite(vectors).all() and np.isfinite(query_vectors).all()):
        fail(f"{name}: non-finite embeddings")
    row = {
        "variant": name,
        "docs_per_second": round(len(docs) / min(times), 1),
        "seconds": [round(t, 3) for t in times],
        "_vectors": vectors,
        "_queries": query_vectors,
    }
    if args.device.startswith("cuda"):
        row["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    if name.startswith("densefit"):
        from densefit.retrieval.runtimes import resolve_runtime

        runner = resolve_runtime(model, "torch")
        row["runtime"] = runner.source.describe()
        row["attention"] = runner.record.get(
            "attention", model[0].auto_model.config._attn_implementation
        )
    return row


def agreement(rows: list[dict], reference: dict) -> None:
    """Each row's cosine to the reference's vectors and its top-10 overlap, in place."""
    import numpy as np

    top = np.argsort(-(reference["_queries"] @ reference["_vectors"].T), axis=1)[:, :10]
    for row in rows:
        cosine = np.sum(row["_vectors"] * reference["_vectors"], axis=1)
        ours = np.argsort(-(row["_queries"] @ row["_vectors"].T), axis=1)[:, :10]
        overlap = [len(set(a) & set(b)) / 10 for a, b in zip(ours, top, strict=True)]
        row["cosine_mean_vs_fp32"] = round(float(cosine.mean()), 6)
        row["cosine_min_vs_fp32"] = round(float(cosine.min()), 6)
        row["top10_overlap_vs_fp32"] = round(float(np.mean(overlap)), 4)
        row["speed_vs_densefit_fp32"] = round(
            row["docs_per_second"] / reference["docs_per_second"], 3
        )


def targets(by: dict) -> dict:
    """Issue 37's inference targets on the rows: True / False (None: a row is missing)."""

    def ratio(a: str, b: str) -> float | None:
        if a in by and b in by:
            return round(by[a]["docs_per_second"] / by[b]["docs_per_second"], 3)
        return None

    fp16 = by.get("densefit-fp16", {})
    found = {
        "fp16_vs_fp32": ratio("densefit-fp16", "densefit-fp32"),
        "fp16_vs_st_fp16": ratio("densefit-fp16", "st-fp16"),
        "fp32_vs_st_fp32": ratio("densefit-fp32", "st-fp32"),
        "fp16_cosine_min": fp16.get("cosine_min_vs_fp32"),
    }
    met = {
        "fp16_at_least_1.5x_fp32": None if found["fp16_vs_fp32"] is None else found["fp16_vs_fp32"] >= 1.5,
        "fp16_at_least_st_fp16": None if found["fp16_vs_st_fp16"] is None else found["fp16_vs_st_fp16"] >= 1.0,
        "fp16_cosine_at_least_0.999": None if found["fp16_cosine_min"] is None else found["fp16_cosine_min"] >= MIN_COSINE,
        "fp32_at_least_st_fp32": None if found["fp32_vs_st_fp32"] is None else found["fp32_vs_st_fp32"] >= 1.0,
    }  # fmt: skip
    return {"ratios": found, "met": met}


def profile(model, docs, args) -> str:
    """Where densefit's time goes at fp32 and fp16: GPU kernel time against the wall, and
    the top CPU ops and CUDA kernels (torch.profiler)."""
    import torch
    from torch.profiler import ProfilerActivity

    from densefit.retrieval.encode import configure_model, encode_texts

    cuda = args.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    texts = docs[: args.profile_docs]
    sections = []
    for precision in ("fp32", "fp16"):
        configure_model(model, precision=precision)
        encode_texts(model, texts, batch_size=args.batch_size)  # warm
        synchronize(args.device)
        with torch.profiler.profile(activities=activities) as prof:
            started = time.perf_counter()
            encode_texts(model, texts, batch_size=args.batch_size)
            synchronize(args.device)
            wall = time.perf_counter() - started
        events = prof.key_averages()
        on_gpu = getattr(torch.autograd, "DeviceType", None)
        kernel_us = sum(
            e.self_device_time_total
            for e in events
            if on_gpu is not None and e.device_type == on_gpu.CUDA
        )
        sort = "self_device_time_total" if cuda else "self_cpu_time_total"
        sections.append(
            f"== densefit {precision}: {len(texts)} documents, wall {wall:.3f} s, GPU kernels "
            f"{kernel_us / 1e6:.3f} s ({kernel_us / 1e6 / wall:.0%} of the wall)\n\n"
            + events.table(sort_by="self_cpu_time_total", row_limit=18)
            + ("\n" + events.table(sort_by=sort, row_limit=12) if cuda else "")
        )
    configure_model(model, precision="fp32")
    return "\n\n".join(sections)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--docs", type=int, default=4096)
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--max-seq-length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--profile-docs", type=int, default=1024)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--name", default="inference_gpu")
    args = parser.parse_args(argv)
    import torch

    from densefit.models import load_model

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        fail("no CUDA device (torch.cuda.is_available() is False)")
    docs, queries = sample(args.docs, args.queries)
    model = load_model(MODEL, device=args.device, max_seq_length=args.max_seq_length)
    RESULTS.mkdir(exist_ok=True)
    payload = {
        "command": command_line("gpu_inference.py", argv),
        "model": MODEL,
        "documents": len(docs),
        "max_seq_length": args.max_seq_length,
        "batch_size": args.batch_size,
        "environment": environment(),
        "rows": [],
    }
    rows = []
    for name in args.variants:
        rows.append(run_variant(name, model, docs, queries, args))
        shown = {k: v for k, v in rows[-1].items() if not k.startswith("_")}
        print(json.dumps(shown), flush=True)
    by = {r["variant"]: r for r in rows}
    agreement(rows, by.get("densefit-fp32", rows[0]))
    payload["rows"] = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
    payload["targets"] = targets(by)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    print("targets:", json.dumps(payload["targets"]), flush=True)
    if args.profile_docs:
        text = profile(model, docs, args)
        (RESULTS / f"{args.name}_profile.txt").write_text(text + "\n")
        print(text.split("\n", 1)[0], flush=True)


if __name__ == "__main__":
    main()
