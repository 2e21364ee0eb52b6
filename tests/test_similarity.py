"""One similarity vocabulary: what the loss trains with is what the saved model says and what
its store searches by (a dot model indexed and searched as cosine ranks differently)."""

import json

import numpy as np
import pytest

from densefit import TrainConfig, TrainingExample, train
from densefit.choices import SIMILARITIES
from densefit.data.types import Document
from densefit.models import load_model, model_similarity
from densefit.retrieval.encode import encode_texts
from densefit.retrieval.index.engines import open_store
from densefit.retrieval.index.indexing import index_documents
from densefit.retrieval.index.searching import search

ROWS = [
    TrainingExample("what is a cell", "the cell is a unit of life"),
    TrainingExample("python list", "a list is a python value"),
    TrainingExample("gene risk", "genes increase the risk of disease"),
    TrainingExample("blood pressure drug", "the drug lowers blood pressure"),
]
DOCS = [
    Document("short", "cell"),
    Document("long", "the cell is a unit of life and the cell divides in the cell cycle"),
    Document("other", "python function return value"),
]


@pytest.mark.parametrize("similarity", SIMILARITIES)
def test_trained_similarity_is_saved_and_searched_by(tiny, tmp_path, similarity):
    config = TrainConfig(batch_size=4, similarity=similarity, show_progress=False)
    train(tiny, ROWS, config, output_dir=tmp_path / "m")
    saved = json.loads((tmp_path / "m" / "config_sentence_transformers.json").read_text())
    assert saved["similarity_fn_name"] == similarity
    assert json.loads((tmp_path / "m" / "densefit_config.json").read_text())["similarity"] == (
        similarity
    )
    model = load_model(str(tmp_path / "m"))
    assert model_similarity(model) == similarity
    store = open_store(tmp_path / "store", model)
    index_documents(store, model, DOCS)
    assert store.similarity == similarity
    query = "the cell"
    hits = search(store, model, query, top_k=3)
    q = encode_texts(model, [query])[0]
    d = encode_texts(model, [doc.text for doc in DOCS])
    if similarity == "cosine":
        q, d = q / np.linalg.norm(q), d / np.linalg.norm(d, axis=1, keepdims=True)
    expected = d @ q
    np.testing.assert_allclose([h.score for h in hits], np.sort(expected)[::-1], rtol=1e-4)
    assert [h.id for h in hits] == [DOCS[i].id for i in np.argsort(-expected)]


def test_default_is_the_models_own_similarity(tiny, tmp_path):
    tiny.similarity_fn_name = "dot"
    result = train(tiny, ROWS, TrainConfig(batch_size=4, show_progress=False))
    assert result.plan is not None
    assert model_similarity(tiny) == "dot"


def test_a_similarity_densefit_does_not_train_is_refused(tiny):
    tiny.similarity_fn_name = "euclidean"
    with pytest.raises(ValueError, match="--similarity cosine or dot"):
        train(tiny, ROWS, TrainConfig(batch_size=4, show_progress=False))
