"""Inference runtimes: ONNX Runtime (fp32, int8) against torch, the export and its check, and
the store's rule for vectors made by different runtimes."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from densefit.data.types import Document  # noqa: E402
from densefit.models import load_model  # noqa: E402
from densefit.retrieval.encode import configure_model, encode_texts  # noqa: E402
from densefit.retrieval.export import (  # noqa: E402
    CheckTexts,
    ExportCheckError,
    check_texts,
    export_model,
    file_name,
)
from densefit.retrieval.index import open_store  # noqa: E402
from densefit.retrieval.index.indexing import index_documents  # noqa: E402
from densefit.retrieval.index.searching import search_batch  # noqa: E402
from densefit.retrieval.index.types import SettingsMismatchError  # noqa: E402
from densefit.retrieval.runtimes import (  # noqa: E402
    MANIFEST,
    Runtime,
    RuntimeUnavailableError,
    VectorSource,
    openvino_properties,
    resolve_runtime,
)
from densefit.testing import tiny_model  # noqa: E402

WORDS = "cells divide genes python function memory batch vaccine dose store query search".split()


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 40)))) for _ in range(n)]


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


CALIBRATION = CheckTexts(_texts(30, seed=1), _texts(120, seed=2), "test texts")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A saved tiny model (Normalize) with its onnx and onnx-int8 exports, checked."""
    root = tmp_path_factory.mktemp("exported")
    tiny_model(root / "build", normalize=True).save(str(root / "model"))
    report = export_model(
        load_model(root / "model", device="cpu"), ["onnx", "onnx-int8"], calibration=CALIBRATION
    )
    return root / "model", report


# ----------------------------------------------------------------------------- fp32 == torch


@pytest.mark.parametrize("normalize", [True, False], ids=["normalize", "no-normalize"])
@pytest.mark.parametrize(
    "prompt, dim", [(None, None), ("query: ", None), (None, 16), ("query: ", 8)]
)
def test_onnx_fp32_equals_torch(tmp_path, normalize, prompt, dim):
    """Every text's vector from ONNX Runtime fp32 equals torch's to 1e-5 cosine, through the
    one encoder: length-sorted batches of several widths, duplicates, prompts, Matryoshka."""
    model = tiny_model(tmp_path / "m", normalize=normalize)
    configure_model(model, query_prompt=prompt, dim=dim)
    texts = _texts(37) + ["cells divide"] * 3
    torch_vectors = encode_texts(model, texts, batch_size=8, prompt_name="query", runtime="torch")
    onnx_vectors = encode_texts(model, texts, batch_size=8, prompt_name="query", runtime="onnx")
    assert onnx_vectors.shape == (len(texts), dim or 32)
    assert _cosines(torch_vectors, onnx_vectors).min() >= 1 - 1e-5
    np.testing.assert_allclose(onnx_vectors, torch_vectors, atol=1e-5)
    if normalize:
        np.testing.assert_allclose(np.linalg.norm(onnx_vectors, axis=1), 1, atol=1e-5)
    else:  # no Normalize module: the raw mean-pooled vectors (a Matryoshka cut keeps the
        # full vector's norm: densefit.losses.matryoshka.truncate), not unit length
        assert np.abs(np.linalg.norm(onnx_vectors, axis=1) - 1).max() > 1e-2


def test_exported_file_equals_torch(exported):
    folder, _ = exported
    model = load_model(folder, device="cpu")
    runtime = resolve_runtime(model, "onnx")
    assert runtime.source.file == "onnx/model.onnx"  # the file, not an in-memory export
    texts = _texts(25)
    a = encode_texts(model, texts, batch_size=4, runtime="torch")
    b = encode_texts(model, texts, batch_size=4, runtime=runtime)
    assert _cosines(a, b).min() >= 1 - 1e-5


# ----------------------------------------------------------------------------- the export


def test_export_layout_loads_in_onnxruntime(exported):
    """sentence-transformers' layout and optimum's names: onnx/model.onnx and
    onnx/model_qint8_<isa>.onnx, inputs from the tokenizer, output last_hidden_state, batch
    and length dynamic; the manifest records each file's check."""
    import onnxruntime as ort

    folder, report = exported
    manifest = json.loads((folder / "onnx" / MANIFEST).read_text())
    assert set(manifest["files"]) == {"model.onnx", file_name("onnx-int8")}
    assert file_name("onnx-int8").startswith("model_qint8_")
    for name in manifest["files"]:
        session = ort.InferenceSession(str(folder / "onnx" / name))
        inputs = [i.name for i in session.get_inputs()]
        assert inputs == ["input_ids", "attention_mask", "token_type_ids"]
        assert [o.name for o in session.get_outputs()] == ["last_hidden_state"]
        for batch, length in ((1, 3), (4, 17)):
            feed = {k: np.ones((batch, length), dtype=np.int64) for k in inputs}
            assert session.run(None, feed)[0].shape == (batch, length, 32)
    fp32, int8 = manifest["files"]["model.onnx"], manifest["files"][file_name("onnx-int8")]
    assert fp32["passed"] and fp32["family"] == "fp32" and fp32["check"]["cosine_min"] >= 1 - 1e-5
    assert int8["passed"] and int8["family"].startswith("int8:")
    assert int8["quantization"]["weights"] == "int8, per output channel"
    assert {"cosine_mean", "top10_overlap", "top10_overlap_mixed"} <= set(int8["check"])
    assert report.exports["onnx-int8"]["sha256"] == int8["sha256"]


def test_int8_ranks_like_torch(exported):
    """int8 vectors keep each text's direction and the top 10 of a retrieval."""
    folder, _ = exported
    model = load_model(folder, device="cpu")
    queries, docs = _texts(20, seed=5), _texts(200, seed=6)
    top, vectors = {}, {}
    for runtime in ("torch", "onnx-int8"):
        q = encode_texts(model, queries, prompt_name="query", runtime=runtime)
        vectors[runtime] = encode_texts(model, docs, prompt_name="document", runtime=runtime)
        top[runtime] = np.argsort(-(q @ vectors[runtime].T), axis=1)[:, :10]
    assert _cosines(vectors["torch"], vectors["onnx-int8"]).mean() >= 0.99
    overlap = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(*top.values(), strict=True)])
    assert overlap >= 0.8


def test_int8_top_k_agreement_on_real_texts(exported, shared_datasets):
    """On real SciFact texts (a sample), int8's top 10 per query overlaps torch's."""
    from densefit.data.corpus import load_beir

    folder, _ = exported
    model = load_model(folder, device="cpu")
    beir = load_beir(shared_datasets / "scifact", "test")
    queries = [beir.queries[q] for q in sorted(beir.qrels)[:30]]
    docs = [d.text for d in list(beir.corpus.values())[:300]]
    top = []
    for runtime in ("torch", "onnx-int8"):
        q = encode_texts(model, queries, prompt_name="query", runtime=runtime)
        d = encode_texts(model, docs, prompt_name="document", runtime=runtime)
        top.append(np.argsort(-(q @ d.T), axis=1)[:, :10])
    assert np.mean([len(set(a) & set(b)) / 10 for a, b in zip(*top, strict=True)]) >= 0.8


def _bad_quantizer(source, path, **recipe):
    """A "quantization" that ruins the weights: each initializer gets 50% noise."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(source))
    rng = np.random.default_rng(0)
    for init in graph.graph.initializer:
        array = numpy_helper.to_array(init)
        if array.dtype == np.float32 and array.size > 64:
            noisy = array + 0.5 * array.std() * rng.standard_normal(array.shape).astype("f4")
            init.CopyFrom(numpy_helper.from_array(noisy.astype(np.float32), init.name))
    onnx.save(graph, str(path))
    return {"method": "noise (test)"}


def test_check_refuses_a_bad_quantization(tmp_path, monkeypatch):
    import densefit.retrieval.export as export

    tiny_model(tmp_path / "build", normalize=True).save(str(tmp_path / "model"))
    model = load_model(tmp_path / "model", device="cpu")
    monkeypatch.setattr(export, "_quantize_onnx", _bad_quantizer)
    with pytest.raises(ExportCheckError, match=r"cosine_mean 0\.\d+.*top10_overlap"):
        export_model(model, "onnx-int8", calibration=CALIBRATION)
    assert not (tmp_path / "model" / "onnx" / file_name("onnx-int8")).exists()
    manifest = json.loads((tmp_path / "model" / "onnx" / MANIFEST).read_text())
    assert set(manifest["files"]) == {"model.onnx"}  # the fp32 file passed and stays
    assert resolve_runtime(model, "auto").name == "onnx"

    with pytest.warns(UserWarning, match="kept, recorded as failed"):
        report = export_model(model, "onnx-int8", calibration=CALIBRATION, on_check_failure="warn")
    assert report.exports["onnx-int8"]["passed"] is False
    assert len(report.exports["onnx-int8"]["recipes_tried"]) == 2  # both recipes were tried
    assert resolve_runtime(load_model(tmp_path / "model", device="cpu"), "auto").name == "onnx"
    with pytest.raises(RuntimeUnavailableError, match="its check failed"):
        resolve_runtime(load_model(tmp_path / "model", device="cpu"), "onnx-int8")


def test_quantized_export_needs_held_out_texts(tmp_path):
    model = tiny_model(tmp_path / "m")
    with pytest.raises(ValueError, match="--calibration"):
        export_model(model, "onnx-int8", folder=tmp_path / "out")
    with pytest.raises(ValueError, match="--to onnx-fp16"):
        export_model(model, "onnx-fp16", folder=tmp_path / "out")
    with pytest.raises(ValueError, match="not loaded from a folder"):
        export_model(model, "onnx")


def test_check_texts_from_training_rows_and_corpus(tmp_path):
    rows = [{"query": f"q {i}", "positive": f"positive {i}"} for i in range(12)]
    texts = check_texts(rows)
    assert len(texts.queries) == 12 and len(texts.documents) == 12
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(json.dumps({"_id": str(i), "text": f"doc {i} " * 20}) + "\n" for i in range(20))
    )
    texts = check_texts(corpus)
    assert len(texts.documents) == 20 and len(texts.queries) == 4
    assert all(len(q.split()) <= 12 for q in texts.queries)


# ----------------------------------------------------------------------------- auto, weights


def test_auto_picks_the_checked_int8_export_and_drops_it_when_weights_change(exported):
    import torch

    folder, _ = exported
    model = load_model(folder, device="cpu")
    assert resolve_runtime(model, "auto").name == "onnx-int8"
    with torch.no_grad():
        next(model.parameters()).add_(0.01)  # as an optimizer step would
    assert resolve_runtime(model, "auto").name == "torch"  # the export is of other weights
    with pytest.raises(RuntimeUnavailableError, match="current weights"):
        resolve_runtime(model, "onnx-int8")
    onnx = resolve_runtime(model, "onnx")  # fp32: exported again, in memory
    assert onnx.source.file is None
    texts = _texts(10)
    a, b = (encode_texts(model, texts, runtime=r) for r in ("torch", onnx))
    assert _cosines(a, b).min() >= 1 - 1e-5


def test_fastest_runtime_times_each_and_picks_the_fastest(tmp_path):
    """Every candidate is timed on one query per call and the fastest is picked, wherever it
    stands in the list (a runtime made 30 ms slower per call is never picked: well above what
    a second busy worker adds to a median of five calls, a few ms)."""
    import time

    from densefit.retrieval.encode import fastest_runtime

    model = tiny_model(tmp_path / "m")
    onnx = resolve_runtime(model, "onnx")

    def slow_session(features):
        time.sleep(0.03)
        return onnx.session(features)

    slow = Runtime("slow", onnx.source, slow_session)
    best, timings = fastest_runtime(model, [slow, onnx], calls=5, warmup=1)
    assert best is onnx
    assert set(timings) == {"slow", "onnx"}
    assert timings["slow"] > timings["onnx"] + 20
    assert fastest_runtime(model, [slow]) == (slow, {})  # one: nothing to time


def test_serve_auto_embeds_queries_by_the_fastest_candidate(exported):
    """``densefit serve --runtime auto`` times every runtime auto may use against the store
    (the checked exports and torch), serves queries with the fastest and lets the others'
    sessions go; a named runtime is taken as it is, untimed."""
    pytest.importorskip("fastapi")
    from densefit.retrieval import runtimes
    from densefit.retrieval.runtimes import auto_candidates
    from densefit.serve.swap import query_runtime_for

    folder, _ = exported
    model = load_model(folder, device="cpu")
    store = open_store(None, model)  # fp32 documents: every checked export may query them
    names = [r.name for r in auto_candidates(model, stored=store.settings.source)]
    assert names == ["onnx-int8", "onnx", "torch"]
    runner, timings = query_runtime_for(store, model, "auto", threads=1)
    assert set(timings) == set(names)
    assert runner.name == min(timings, key=timings.get)
    opened = {name for name, explicit in runtimes._RUNTIMES.get(model, {}) if not explicit}
    assert opened <= {runner.name}
    assert query_runtime_for(store, model, "torch") == (runtimes.TORCH, {})


def test_unknown_runtime_lists_the_choices(tmp_path):
    with pytest.raises(ValueError, match="auto, torch, onnx, onnx-int8"):
        resolve_runtime(tiny_model(tmp_path / "m"), "tensorrt")


# ----------------------------------------------------------------------------- the store rule


def _docs(n: int) -> list[Document]:
    return [Document(f"d{i}", t) for i, t in enumerate(_texts(n, seed=9))]


def test_store_records_the_runtime_and_searches_across_fp32(exported):
    folder, _ = exported
    model = load_model(folder, device="cpu")
    store = open_store(None, model)
    report = index_documents(store, model, _docs(40), runtime="torch")
    assert report.runtime == "torch" and store.settings.source.family == "fp32"
    queries = _texts(5, seed=3)
    by_torch = search_batch(store, model, queries, runtime="torch")
    by_onnx = search_batch(store, model, queries, runtime="onnx")  # same family: allowed
    assert [[h.id for h in q] for q in by_torch] == [[h.id for h in q] for q in by_onnx]
    # auto on an fp32 store never picks int8 for documents beside fp32 ones...
    more = [Document("new", "cells divide genes")]
    assert index_documents(store, model, more, runtime="auto").runtime.startswith("onnx (")
    # ... and explicit int8 is refused like other settings
    with pytest.raises(SettingsMismatchError, match="runtime=.torch.*--runtime torch"):
        index_documents(store, model, [Document("x", "memory batch")], runtime="onnx-int8")


def test_an_empty_store_takes_the_runtime_of_its_first_write(exported):
    folder, _ = exported
    model = load_model(folder, device="cpu")
    store = open_store(None, model)
    index_documents(store, model, _docs(30), runtime="auto")
    assert store.settings.source.runtime == "onnx-int8"
    assert store.info()["runtime"].startswith("onnx-int8 (onnx/model_qint8_")
    # its check found int8 agrees with fp32: torch queries may search it
    hits = search_batch(store, model, ["cells divide"], runtime="torch")
    assert hits[0]
    assert store.check_settings(model, resolve_runtime(model, "onnx-int8")) is None
    with pytest.raises(SettingsMismatchError, match="runtime"):
        store.check_settings(model, resolve_runtime(model, "torch"))
    index_documents(store, model, _docs(30), runtime="torch", reembed=True)
    assert store.settings.source.runtime == "torch"


def test_queries_from_another_runtime_are_refused_unless_the_check_agreed(exported):
    folder, _ = exported
    model = load_model(folder, device="cpu")
    for agrees in (False, True):
        store = open_store(None, model)
        quantized = VectorSource("onnx-int8", "int8:0123", "onnx/model_qint8_x.onnx", agrees)
        assert store.adopt_runtime(quantized)
        store.write(_docs(5), encode_texts(model, [d.text for d in _docs(5)]))
        if agrees:
            assert search_batch(store, model, ["cells"], runtime="torch")[0]
        else:
            with pytest.raises(SettingsMismatchError, match="did not find that its vectors"):
                search_batch(store, model, ["cells"], runtime="torch")
            # auto finds no runtime of that family here and falls back to the refusal too
            with pytest.raises(SettingsMismatchError, match="--runtime onnx-int8"):
                search_batch(store, model, ["cells"], runtime="auto")
        assert not store.adopt_runtime(VectorSource())  # it holds vectors: no longer adopts


def test_store_without_a_recorded_runtime_reads_as_torch():
    assert VectorSource.from_json(None) == VectorSource()
    source = VectorSource("onnx-int8", "int8:ab", "onnx/x.onnx", True)
    assert VectorSource.from_json(source.to_json()) == source


# ----------------------------------------------------------------------------- callers


def test_retriever_evaluate_and_mine_take_the_runtime(exported):
    from densefit.api import Retriever
    from densefit.data.types import TrainingExample
    from densefit.evaluate import evaluate
    from densefit.mine import mine_hard_negatives

    folder, _ = exported
    docs = _docs(30)
    hits = {}
    for runtime in ("torch", "onnx"):
        retriever = Retriever(str(folder), device="cpu", runtime=runtime)
        retriever.index(docs)
        hits[runtime] = [h.id for h in retriever.retrieve("cells divide genes", top_k=5)]
        assert retriever.store.settings.source.runtime == runtime
        queries = {"q1": "cells divide", "q2": "python memory"}
        result = evaluate(
            retriever.model, retriever.store, queries=queries,
            qrels={"q1": {"d1": 1}, "q2": {"d2": 1}}, runtime=runtime,
        )  # fmt: skip
        assert result.info["runtime"].startswith(runtime)
    assert hits["torch"] == hits["onnx"]
    pairs = [TrainingExample(f"query {t}", d.text) for t, d in zip(_texts(6), docs, strict=False)]
    options = dict(num_negatives=2, range_min=0, range_max=10, show_progress=False)
    mined = {
        runtime: mine_hard_negatives(
            pairs,
            docs,
            method="dense",
            model=load_model(folder, device="cpu"),
            runtime=runtime,
            **options,
        )  # fmt: skip
        for runtime in ("torch", "onnx")
    }
    assert mined["onnx"][1].runtime.startswith("onnx")
    assert [m.negatives for m in mined["torch"][0]] == [m.negatives for m in mined["onnx"][0]]
    with pytest.raises(RuntimeUnavailableError):
        Retriever(tiny_model(), runtime="onnx-int8")  # no export: fails at construction


@pytest.mark.slow
def test_minilm_onnx_equals_torch_and_int8_keeps_the_ranking(tmp_path, shared_datasets):
    """all-MiniLM-L6-v2 on real SciFact texts: fp32 to 1e-5 cosine, int8 (checked on the
    train split, tested on held-out test queries) keeps the top 10."""
    from densefit.data.corpus import load_beir

    model = load_model("all-MiniLM-L6-v2", device="cpu", max_seq_length=128)
    train = check_texts(shared_datasets / "scifact")
    calibration = CheckTexts(train.queries[:40], train.documents[:160], "scifact train")
    report = export_model(
        model, ["onnx", "onnx-int8"], folder=tmp_path / "minilm", calibration=calibration
    )
    assert report.exports["onnx-int8"]["check"]["cosine_mean"] >= 0.99
    exported = load_model(tmp_path / "minilm", device="cpu", max_seq_length=128)
    beir = load_beir(shared_datasets / "scifact", "test")
    queries = [beir.queries[q] for q in sorted(beir.qrels)[:25]]
    docs = [d.text for d in list(beir.corpus.values())[:150]]
    out = {}
    for runtime in ("torch", "onnx", "onnx-int8"):
        q = encode_texts(exported, queries, prompt_name="query", runtime=runtime)
        d = encode_texts(exported, docs, prompt_name="document", runtime=runtime)
        out[runtime] = (q, d, np.argsort(-(q @ d.T), axis=1)[:, :10])
    assert _cosines(out["torch"][1], out["onnx"][1]).min() >= 1 - 1e-5
    assert _cosines(out["torch"][1], out["onnx-int8"][1]).mean() >= 0.99
    overlap = np.mean(
        [len(set(a) & set(b)) / 10 for a, b in zip(out["torch"][2], out["onnx-int8"][2])]
    )
    assert overlap >= 0.85


def test_openvino_fp32_equals_torch_and_int8_is_checked(tmp_path):
    pytest.importorskip("openvino")
    pytest.importorskip("nncf")
    tiny_model(tmp_path / "build", normalize=True).save(str(tmp_path / "model"))
    model = load_model(tmp_path / "model", device="cpu")
    report = export_model(
        model, ["openvino", "openvino-int8"], calibration=CALIBRATION, on_check_failure="warn"
    )
    assert (tmp_path / "model" / "openvino" / "openvino_model.xml").is_file()
    assert (tmp_path / "model" / "openvino" / "openvino_model_qint8_quantized.bin").is_file()
    assert report.exports["openvino"]["passed"]
    assert "cosine_mean" in report.exports["openvino-int8"]["check"]
    texts = _texts(20)
    a = encode_texts(model, texts, runtime="torch")
    b = encode_texts(model, texts, runtime="openvino")
    assert _cosines(a, b).min() >= 1 - 1e-5


def test_openvino_calls_from_several_threads_run_side_by_side_and_agree(tmp_path):
    """Unpinned, a stream per caller's threads, an infer request per thread: two threads on
    one session get what one thread gets (bench/openvino_streams.py measures the speed)."""
    pytest.importorskip("openvino")
    tiny_model(tmp_path / "build", normalize=True).save(str(tmp_path / "model"))
    model = load_model(tmp_path / "model", device="cpu")
    export_model(model, ["openvino"])
    runtime = resolve_runtime(model, "openvino")
    compiled = runtime.session.compiled
    assert compiled.get_property("ENABLE_CPU_PINNING") is False
    wanted = openvino_properties(torch.get_num_threads())
    assert compiled.get_property("NUM_STREAMS") == wanted["NUM_STREAMS"]
    assert compiled.get_property("INFERENCE_NUM_THREADS") == wanted["INFERENCE_NUM_THREADS"]
    texts = [_texts(12)[i::3] for i in range(3)]
    alone = [encode_texts(model, t, runtime=runtime) for t in texts]
    together: dict = {}

    def embed(i: int) -> None:
        together[i] = [encode_texts(model, texts[i], runtime=runtime) for _ in range(5)]

    workers = [threading.Thread(target=embed, args=(i,)) for i in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for i in range(3):
        for got in together[i]:
            assert np.abs(got - alone[i]).max() < 1e-6


def test_serve_refuses_writes_that_would_mix_runtime_families(exported):
    pytest.importorskip("fastapi")
    from densefit.serve.swap import document_encoder as _document_encoder

    folder, _ = exported
    model = load_model(folder, device="cpu")
    store = open_store(None, model)
    store.adopt_runtime(VectorSource("onnx-int8", "int8:0123", "onnx/x.onnx", True))
    with pytest.raises(SettingsMismatchError, match="cannot add documents"):
        _document_encoder(store, model)(["cells divide"])
    fp32_store = open_store(None, model)  # a torch store: written by its own family
    assert _document_encoder(fp32_store, model)(["cells divide"]).shape == (1, 32)


def test_evaluation_during_training_runs_the_chosen_runtime(tmp_path):
    """The Evaluator's runtime: onnx exports the current weights at each evaluation (they
    change every step) and scores as torch does; auto finds no export of them: torch."""
    import torch

    from densefit.config import TrainConfig
    from densefit.errors import OptionError
    from densefit.training.evaluation import Evaluator

    beir = tmp_path / "beir"
    (beir / "qrels").mkdir(parents=True)
    topics = ["cell", "python", "river", "music", "engine", "bread"]
    docs = [
        {"_id": f"{t}{i}", "text": f"{t} fact {i} about the {t}"} for t in topics for i in (0, 1)
    ]
    (beir / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    queries = [{"_id": f"{t}-q", "text": f"a question on {t}"} for t in topics]
    (beir / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    judged = "".join(f"{t}-q\t{t}1\t1\n" for t in topics)
    (beir / "qrels" / "dev.tsv").write_text("query-id\tcorpus-id\tscore\n" + judged)
    model = tiny_model(tmp_path / "m", normalize=True)
    records = {}
    for runtime in ("torch", "onnx", "auto"):
        config = TrainConfig(eval_every=1, eval_split="dev", eval_runtime=runtime)
        evaluator = Evaluator(beir, config)
        records[runtime] = [evaluator.run(model, 0)["eval"]]
        with torch.no_grad():
            next(model.parameters()).mul_(1.5)  # a training step
        records[runtime].append(evaluator.run(model, 1)["eval"])
        with torch.no_grad():
            next(model.parameters()).div_(1.5)
    assert records["onnx"] == records["torch"] == records["auto"]
    assert records["torch"][0] != records["torch"][1]  # the weights did change
    with pytest.raises(OptionError, match="eval_runtime must be one of auto, torch, onnx"):
        TrainConfig(eval_runtime="onnx-int8")  # weights that change every step: fp32 only
