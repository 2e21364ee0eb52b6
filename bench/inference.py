"""Inference runtimes against torch: encoding throughput and ranking quality, each point in a
fresh process against its peer measured in the same run.

    # quality (load-independent): full test corpora, every runtime and int8 recipe vs torch
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nice -n 15 python bench/inference.py --section quality
    # throughput (on a quiet machine): docs/s at 1 and 2 threads, 128 and 256 tokens
    python bench/inference.py --section throughput
    # smoke test (seconds to minutes)
    python bench/inference.py --section throughput --docs 16 --datasets scifact --lengths 128 \
        --threads 1 --runtimes st-encode,onnx --repeats 1 --small-check \
        --export-dir /tmp/densefit-inference-smoke --name inference_smoke

First the model (all-MiniLM-L6-v2) is exported once into ``--export-dir`` with
:func:`densefit.retrieval.export.export_model`: ``onnx``, ``onnx-int8`` (the export's own recipe
ladder) and, when OpenVINO is installed, ``openvino`` and ``openvino-int8``, checked on
SciFact's train split (held out from every test split below); and, for the quality section,
one folder per other int8 recipe of :data:`densefit.retrieval.export.INT8_RECIPES` (the per-tensor
baselines), checked the same way and kept whatever their check says.

**Throughput** (``--section throughput``): documents/s of ``densefit index`` (documents read,
embedded by :func:`densefit.retrieval.index.indexing.index_documents` with ``runtime=R``, and
committed to a temporary store) for each runtime, and of ``SentenceTransformer.encode``
(torch fp32, batch 32: the peer, ``st-encode``), on ``--docs`` documents drawn (seeded) from
SciFact's and manpages' corpora at 128 and 256 tokens, at 1 and 2 threads (OMP/MKL and
torch's thread count; ONNX Runtime and OpenVINO take torch's). Each point is its own process
(the load average before and after is recorded) that times two passes over the sample: the
first meets each batch shape for the first time (``first_pass_docs_per_second``), the second
is the steady state of a long run, where shapes repeat (``docs_per_second``, the ratios).
``--repeats`` rounds, alternating the order of the points, and each configuration reports
its median. Writes
bench/results/NAME_throughput.{jsonl,csv,png} and NAME.json.

**Quality** (``--section quality``): nDCG@10 and Recall@100 of
:func:`densefit.evaluate.evaluate` on the test split over the full corpus of SciFact,
NFCorpus and manpages at the model's 256 tokens, for torch fp32 and each runtime and int8
recipe (the same files as the throughput section), with each file's check numbers (cosine
and top-10 overlap on SciFact train) beside its nDCG@10 difference to torch. Writes
bench/results/NAME_quality.{jsonl,csv,png} and NAME.json. A rerun skips finished points.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import time
from pathlib import Path

from _common import finished, pyplot
from _runner import DATASETS, RESULTS, ROOT, command_line, environment, run_child

sys.path.insert(0, str(ROOT))

from densefit.choices import INT8_RECIPES, RUNTIMES  # noqa: E402  (stdlib only, no framework)

MODEL = "all-MiniLM-L6-v2"
PEER = "st-encode"  # SentenceTransformer.encode, torch fp32
BASELINE_RECIPES = INT8_RECIPES[2:]  # the per-tensor ones: what the export's recipes beat
NAMES = {"scifact": "SciFact", "nfcorpus": "NFCorpus", "manpages": "manpages"}


# ----------------------------------------------------------------------------- exports


def openvino_installed() -> bool:
    try:
        import nncf  # noqa: F401
        import openvino  # noqa: F401
    except ImportError:
        return False
    return True


def prepare_exports(
    export_dir: Path, runtimes: list[str], recipes: list[str], small_check: bool = False
) -> dict:
    """The export folders (made once, reused): ``{"main": folder, recipe: folder}``."""
    from densefit.models import load_model
    from densefit.retrieval.export import (
        DEFAULT_INT8_RECIPES,
        CheckTexts,
        check_texts,
        export_model,
    )

    calibration = DATASETS / "scifact"  # its train split: held out from every test split
    # The baselines' checks on a fifth of those texts: their numbers only sit beside their nDCG.
    full = check_texts(calibration)
    small = CheckTexts(full.queries[:40], full.documents[:160], f"{full.source}, first 40/160")
    folders = {"main": export_dir / "minilm"}
    wanted = [r for r in runtimes if r not in ("torch", PEER)]
    jobs = [("main", wanted, DEFAULT_INT8_RECIPES)]
    jobs += [(recipe, ["onnx-int8"], (recipe,)) for recipe in recipes]
    for key, targets, ladder in jobs:
        folder = export_dir / ("minilm" if key == "main" else f"minilm-{key}")
        folders[key] = folder
        done = folder / "onnx" / "densefit_export.json"
        if not targets or (done.is_file() and _has_targets(folder, targets)):
            continue
        print(f"exporting {MODEL} to {folder} ({', '.join(targets)})", flush=True)
        report = export_model(
            load_model(MODEL, device="cpu"),
            targets,
            folder=folder,
            calibration=calibration if key == "main" and not small_check else small,
            on_check_failure="warn",
            int8_recipes=ladder,
            show_progress=True,
        )
        print("  " + report.summary(), flush=True)
    return folders


def _has_targets(folder: Path, targets: list[str]) -> bool:
    from densefit.retrieval.runtimes import exports_of

    return set(targets) <= set(exports_of(folder))


def export_record(folder: Path, runtime: str) -> dict:
    """The manifest record of ``runtime``'s file in ``folder`` (newest)."""
    from densefit.retrieval.runtimes import exports_of

    records = exports_of(folder).get(runtime) or [{}]
    return records[0]


# ----------------------------------------------------------------------------- points


def sample_texts(dataset: str, n: int, seed: int = 0) -> list[str]:
    import random

    from densefit.data.corpus import read_corpus

    docs, _ = read_corpus(DATASETS / dataset)
    texts = [d.text for d in docs]
    if n and n < len(texts):
        texts = random.Random(seed).sample(texts, n)
    return texts


def throughput_point(spec: dict) -> dict:
    """One method on one sample, timed in this (fresh) process."""
    import torch

    from densefit.data.types import Document
    from densefit.models import load_model
    from densefit.retrieval.index import open_store
    from densefit.retrieval.index.indexing import index_documents
    from densefit.retrieval.runtimes import resolve_runtime

    torch.set_num_threads(spec["threads"])
    model = load_model(spec["folder"], device="cpu", max_seq_length=spec["max_seq_length"])
    texts = sample_texts(spec["dataset"], spec["docs"])
    tokens = [len(x) for x in model.tokenizer(texts, truncation=True)["input_ids"]]
    out = {"torch_threads": torch.get_num_threads(), "real_tokens": int(sum(tokens))}
    if spec["method"] == PEER:

        def run(part):
            model.encode(part, batch_size=spec["batch_size"], show_progress_bar=False)
    else:
        started = time.perf_counter()
        runtime = resolve_runtime(model, spec["method"])
        out["load_seconds"] = round(time.perf_counter() - started, 3)
        out["file"] = runtime.source.describe()

        def run(part):
            with open_store(None, model) as store:
                docs = [Document(f"d{i}", t) for i, t in enumerate(part)]
                index_documents(store, model, docs, batch_size=spec["batch_size"], runtime=runtime)

    run(texts[:16])  # warm-up: the first calls initialise kernels and arenas
    # Two timed passes over the sample: the first meets each batch shape for the first time
    # (OpenVINO and ONNX Runtime set up kernels and buffers per shape), the second is the
    # steady state of a long indexing run, where the shapes repeat (docs_per_second).
    first = time.perf_counter()
    run(texts)
    started, cpu_started = time.perf_counter(), time.process_time()
    run(texts)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    out.update(
        seconds=round(seconds, 3),
        cpu_seconds=round(cpu, 3),
        docs_per_second=round(len(texts) / seconds, 2),
        first_pass_docs_per_second=round(len(texts) / (started - first), 2),
        documents=len(texts),
    )
    return out


def quality_point(spec: dict) -> dict:
    """nDCG@10 and Recall@100 on the dataset's test split, full corpus."""
    import torch

    from densefit.evaluate import evaluate
    from densefit.models import load_model
    from densefit.retrieval.runtimes import Runtime

    torch.set_num_threads(spec["threads"])
    model = load_model(spec["folder"], device="cpu", max_seq_length=spec["max_seq_length"])
    runtime = spec["runtime"]
    if spec.get("file"):  # a baseline recipe whose check may have failed: its file as it is
        runtime = Runtime.from_file("onnx-int8", spec["file"])
    from densefit.data.corpus import load_beir
    from densefit.evaluate import subsample_corpus

    beir = load_beir(DATASETS / spec["dataset"], "test")
    beir, corpus = subsample_corpus(beir, spec.get("distractors"), seed=0)
    started = time.perf_counter()
    result = evaluate(model, beir, split="test", runtime=runtime)
    return {
        "metrics": {k: round(v, 5) for k, v in result.metrics.items()},
        "queries": result.n_queries,
        "documents": result.info["documents"],
        "runtime_used": result.info["runtime"],
        "corpus": corpus,
        "max_seq_length": model.max_seq_length,
        "eval_s": round(time.perf_counter() - started, 1),
        "torch_threads": torch.get_num_threads(),
    }


def run_point(spec: dict, jsonl: Path) -> dict:
    """``spec`` in a fresh interpreter; its record appended to ``jsonl``."""
    pin = os.environ.get("DENSEFIT_BENCH_CPUS")
    child = run_child(
        Path(__file__),
        "--point",
        json.dumps(spec),
        threads=spec["threads"],
        prefix=["taskset", "-c", pin] if pin else [],
        timeout=spec.get("timeout"),
    )
    record = {**spec, "status": "ok" if child.ok else "failed"}
    if child.ok:
        record.update(child.result)
    else:
        record["error"] = (child.stderr or child.stdout)[-1500:]
    record.update(
        wall_s=child.wall_s,
        loadavg_before=child.loadavg_before,
        loadavg_after=child.loadavg_after,
        finished=child.finished,
    )
    with jsonl.open("a") as f:
        f.write(json.dumps(record) + "\n")
    return record


# ----------------------------------------------------------------------------- sections


def throughput(args, folders: dict) -> list[dict]:
    jsonl = RESULTS / f"{args.name}_throughput.jsonl"
    done = finished(jsonl)
    configs = [
        (dataset, length, threads)
        for dataset in args.datasets
        for length in args.lengths
        for threads in args.threads
    ]
    records = list(done.values())
    for repeat in range(args.repeats):
        for c, (dataset, length, threads) in enumerate(configs):
            methods = [PEER, *[r for r in args.runtimes if r != PEER]]
            if (repeat + c) % 2:
                methods.reverse()  # alternate who goes first: load drift hits all alike
            for method in methods:
                spec = {
                    "section": "throughput",
                    "method": method,
                    "dataset": dataset,
                    "max_seq_length": length,
                    "threads": threads,
                    "docs": args.docs,
                    "batch_size": args.batch_size,
                    "folder": str(folders["main"]),
                    "repeat": repeat,
                    "timeout": args.timeout,
                }
                spec["key"] = (
                    "|".join(
                        str(spec[k]) for k in ("method", "dataset", "max_seq_length", "threads")
                    )
                    + f"|{args.docs}|r{repeat}"
                )
                if spec["key"] in done or args.report_only:
                    continue
                record = run_point(spec, jsonl)
                records.append(record)
                print(
                    f"{spec['key']:<52} {record['status']:<7} "
                    f"{record.get('docs_per_second', '-')} docs/s "
                    f"load {record['loadavg_before'][0]}",
                    flush=True,
                )
    return [r for r in records if r.get("status") == "ok"]


def summarise_throughput(records: list[dict]) -> list[dict]:
    """Per configuration and method: median docs/s over repeats and the ratio to the peer."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault(
            (r["dataset"], r["max_seq_length"], r["threads"], r["method"]), []
        ).append(r)
    rows = []
    for (dataset, length, threads, method), group in sorted(groups.items()):
        rows.append(
            {
                "dataset": dataset,
                "max_seq_length": length,
                "threads": threads,
                "method": method,
                "docs_per_second": _median(group, "docs_per_second"),
                "first_pass_docs_per_second": _median(group, "first_pass_docs_per_second"),
                "repeats": len(group),
                "documents": group[0]["documents"],
                "load_1min_before_max": max(g["loadavg_before"][0] for g in group),
                "file": group[0].get("file", "SentenceTransformer.encode (torch fp32)"),
            }
        )
    peers = {
        (r["dataset"], r["max_seq_length"], r["threads"]): r for r in rows if r["method"] == PEER
    }
    for r in rows:
        peer = peers.get((r["dataset"], r["max_seq_length"], r["threads"]), {})
        for key, ratio in (
            ("docs_per_second", "vs_st_encode"),
            ("first_pass_docs_per_second", "first_pass_vs_st_encode"),
        ):
            mine, theirs = r.get(key), peer.get(key)
            r[ratio] = round(mine / theirs, 3) if mine and theirs else None
    return rows


def _median(group: list[dict], key: str) -> float | None:
    values = [g[key] for g in group if key in g]
    return round(statistics.median(values), 2) if values else None


def quality(args, folders: dict) -> list[dict]:
    jsonl = RESULTS / f"{args.name}_quality.jsonl"
    done = finished(jsonl)
    # torch needs no export: the packaged model itself (its folder is read-only)
    variants = [(r, folders["main"] if r != "torch" else MODEL, None) for r in args.runtimes]
    variants = [v for v in variants if v[0] != PEER]
    for recipe in args.recipes:
        folder = folders[recipe]
        path = folder / "onnx" / export_record(folder, "onnx-int8")["file"]
        variants.append((f"onnx-int8[{recipe}]", folder, str(path)))
    records = list(done.values())
    for dataset in args.datasets:
        for name, folder, path in variants:
            spec = {
                "section": "quality",
                "runtime": name if path is None else "onnx-int8",
                "variant": name,
                "dataset": dataset,
                "threads": args.threads[0],
                "max_seq_length": args.quality_length,
                "distractors": args.distractors,
                "folder": str(folder),
                "file": path,
                "timeout": args.timeout,
            }
            corpus = "full" if args.distractors is None else f"judged+{args.distractors}"
            spec["key"] = f"{name}|{dataset}|{args.quality_length}|{corpus}"
            if spec["key"] in done or args.report_only:
                continue
            print(f"{spec['key']} ...", flush=True)
            record = run_point(spec, jsonl)
            records.append(record)
            metrics = record.get("metrics", {})
            print(
                f"  {record['status']} nDCG@10 {metrics.get('ndcg@10')} "
                f"R@100 {metrics.get('recall@100')} {record.get('eval_s')}s",
                flush=True,
            )
    return [r for r in records if r.get("status") == "ok"]


def summarise_quality(records: list[dict], folders: dict, recipes: list[str]) -> list[dict]:
    torch_of = {r["dataset"]: r["metrics"] for r in records if r["variant"] == "torch"}
    checks = {}
    for name in RUNTIMES:
        checks[name] = export_record(folders["main"], name)
    for recipe in recipes:
        checks[f"onnx-int8[{recipe}]"] = export_record(folders[recipe], "onnx-int8")
    rows = []
    for r in sorted(records, key=lambda r: (r["dataset"], r["variant"])):
        base = torch_of.get(r["dataset"])
        record = checks.get(r["variant"], {})
        check = record.get("check", {})
        rows.append(
            {
                "dataset": r["dataset"],
                "variant": r["variant"],
                "ndcg@10": r["metrics"]["ndcg@10"],
                "recall@100": r["metrics"]["recall@100"],
                "ndcg@10_vs_torch": round(r["metrics"]["ndcg@10"] - base["ndcg@10"], 5)
                if base
                else None,
                "recall@100_vs_torch": round(r["metrics"]["recall@100"] - base["recall@100"], 5)
                if base
                else None,
                "check_cosine_mean": check.get("cosine_mean"),
                "check_cosine_min": check.get("cosine_min"),
                "check_top10_overlap": check.get("top10_overlap"),
                "check_top10_overlap_mixed": check.get("top10_overlap_mixed"),
                "check_passed": record.get("passed"),
                "recipe": (record.get("quantization") or {}).get("recipe"),
                "documents": r["documents"],
                "corpus": (r.get("corpus") or {}).get("kind"),
                "queries": r["queries"],
                "eval_s": r["eval_s"],
                "load_1min_before": r["loadavg_before"][0],
            }
        )
    return rows


# ----------------------------------------------------------------------------- output


def write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def plot_throughput(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None or not rows:
        return
    configs = sorted({(r["dataset"], r["max_seq_length"], r["threads"]) for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(configs)), 4))
    width = 0.8 / len(methods)
    for m, method in enumerate(methods):
        values = [
            next(
                (
                    r["vs_st_encode"] or 0
                    for r in rows
                    if (r["dataset"], r["max_seq_length"], r["threads"]) == c
                    and r["method"] == method
                ),
                0,
            )
            for c in configs
        ]
        ax.bar([i + m * width for i in range(len(configs))], values, width, label=method)
    ax.axhline(3, color="grey", linestyle="--", linewidth=1, label="target 3x")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(configs))])
    ax.set_xticklabels([f"{NAMES[d]}\n{n} tok, {t} thr" for d, n, t in configs], fontsize=8)
    ax.set_ylabel("docs/s vs SentenceTransformer.encode (fp32)")
    ax.set_title(f"Encoding throughput ({MODEL}, densefit index)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_quality(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None or not rows:
        return
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    variants = [v for v in dict.fromkeys(r["variant"] for r in rows) if v != "torch"]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(variants))
    for v, variant in enumerate(variants):
        values = [
            next(
                (
                    r["ndcg@10_vs_torch"] or 0
                    for r in rows
                    if r["dataset"] == d and r["variant"] == variant
                ),
                0,
            )
            for d in datasets
        ]
        ax.bar([i + v * width for i in range(len(datasets))], values, width, label=variant)
    ax.axhline(-0.005, color="grey", linestyle="--", linewidth=1, label="target -0.005")
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(datasets))])
    ax.set_xticklabels([NAMES[d] for d in datasets])
    ax.set_ylabel("nDCG@10 minus torch fp32's")
    ax.set_title(f"Ranking cost of each runtime ({MODEL}, full test corpora)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--section", choices=("throughput", "quality", "both"), default="both")
    parser.add_argument("--runtimes", default=None, help="comma list; default: every runtime here")
    parser.add_argument(
        "--recipes", default=",".join(BASELINE_RECIPES), help="int8 baselines (quality)"
    )
    parser.add_argument(
        "--datasets",
        default=None,
        help="default: scifact,manpages (throughput), +nfcorpus (quality)",
    )
    parser.add_argument("--lengths", default="128,256")
    parser.add_argument("--threads", default="1,2", help="throughput; quality runs at the first")
    parser.add_argument("--quality-length", type=int, default=256, help="tokens (quality)")
    parser.add_argument(
        "--distractors",
        type=int,
        default=None,
        help="quality on the judged documents + this many others (seeded); default: full corpus",
    )
    parser.add_argument("--docs", type=int, default=512, help="documents per throughput point")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--timeout", type=float, default=3600, help="seconds before a point is killed"
    )
    parser.add_argument(
        "--export-dir", default=os.environ.get("TMPDIR", "/tmp") + "/densefit-bench-inference"
    )
    parser.add_argument("--name", default="inference")
    parser.add_argument(
        "--small-check",
        action="store_true",
        help="check the exports on 40 queries / 160 documents (smoke tests)",
    )
    parser.add_argument(
        "--report-only", action="store_true", help="rebuild the files from the JSONL, run nothing"
    )
    parser.add_argument("--point", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.point:
        spec = json.loads(args.point)
        point = throughput_point if spec["section"] == "throughput" else quality_point
        print("RESULT " + json.dumps(point(spec)), flush=True)
        return
    available = [
        PEER,
        *[r for r in RUNTIMES if not r.startswith("openvino") or openvino_installed()],
    ]
    args.runtimes = args.runtimes.split(",") if args.runtimes else available
    unknown = set(args.runtimes) - set(available)
    if unknown:
        sys.exit(
            f"--runtimes {','.join(sorted(unknown))}: not available here (choose from {available})"
        )
    args.recipes = [r for r in args.recipes.split(",") if r]
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.threads = [int(x) for x in args.threads.split(",")]
    RESULTS.mkdir(exist_ok=True)
    sections = ("throughput", "quality") if args.section == "both" else (args.section,)
    recipes = args.recipes if "quality" in sections else []
    folders = prepare_exports(Path(args.export_dir), args.runtimes, recipes, args.small_check)
    summary_path = RESULTS / f"{args.name}.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    summary["environment"] = environment()
    summary["openvino"] = "installed" if openvino_installed() else "not installed here"
    summary["model"] = MODEL
    summary["exports"] = {
        name: {
            k: v for k, v in export_record(folders["main"], name).items() if k != "recipes_tried"
        }
        for name in RUNTIMES[1:]
        if export_record(folders["main"], name)
    }
    if "throughput" in sections:
        datasets = args.datasets.split(",") if args.datasets else ["scifact", "manpages"]
        run_args = argparse.Namespace(**{**vars(args), "datasets": datasets})
        rows = summarise_throughput(throughput(run_args, folders))
        write_csv(RESULTS / f"{args.name}_throughput.csv", rows)
        plot_throughput(rows, RESULTS / f"{args.name}_throughput.png")
        summary["throughput"] = {
            "command": command_line("inference.py", sys.argv[1:]),
            "rows": rows,
        }
        for r in rows:
            print(
                f"{r['dataset']:<9} {r['max_seq_length']:>4} tok {r['threads']} thr "
                f"{r['method']:<14} {r['docs_per_second']:>8} docs/s  {r['vs_st_encode']}x",
                flush=True,
            )
    if "quality" in sections:
        datasets = (
            args.datasets.split(",") if args.datasets else ["scifact", "nfcorpus", "manpages"]
        )
        run_args = argparse.Namespace(**{**vars(args), "datasets": datasets})
        rows = summarise_quality(quality(run_args, folders), folders, args.recipes)
        write_csv(RESULTS / f"{args.name}_quality.csv", rows)
        plot_quality(rows, RESULTS / f"{args.name}_quality.png")
        summary["quality"] = {"command": command_line("inference.py", sys.argv[1:]), "rows": rows}
        for r in rows:
            print(
                f"{r['dataset']:<9} {r['variant']:<34} nDCG@10 {r['ndcg@10']:.4f} "
                f"({r['ndcg@10_vs_torch']}) R@100 {r['recall@100']:.4f} "
                f"check cos {r['check_cosine_mean']} top10 {r['check_top10_overlap']}",
                flush=True,
            )
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
