"""The model card (README.md) of every saved model: written from the run's own records."""

from __future__ import annotations

import json
import warnings

from densefit.config.options import declared_options
from densefit.config.train import TrainConfig
from densefit.data.readers import read_training_data
from densefit.testing import tiny_model
from densefit.training.loop import train
from densefit.training.model_card import model_card


def rows(n: int = 10) -> str:
    return "".join(
        json.dumps({"query": f"question {i}", "positive": f"answer number {i}"}) + "\n"
        for i in range(n)
    )


def test_the_card_holds_the_runs_own_numbers(tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text(rows() + "{not json\n")
    examples, report = read_training_data(data, on_bad_row="skip")
    config = TrainConfig(batch_size=4, epochs=2, scale=30.0, show_progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = train(tiny_model(), examples, config, output_dir=tmp_path / "m",
                       data_report=report)  # fmt: skip
    card = (tmp_path / "m" / "README.md").read_text()
    assert f"| `{data}` | 10 | 1 |" in card  # files, rows, skipped rows
    assert f"| {result.steps} | {result.examples} | {result.seconds:.1f} s |" in card
    assert f"{result.final_loss:.4f}" in card and "mnrl (scale=30.0" in card
    assert f"strategy {result.plan['strategy']}" in card
    assert "| `scale` | 30.0 |" in card and "| `epochs` | 2 |" in card
    assert "`learning_rate`" not in card  # at its default
    assert "Evaluation during training" not in card  # none ran
    assert f"SentenceTransformer({str(tmp_path / 'm')!r})" in card
    assert "SentenceTransformersDocumentEmbedder" in card


def test_every_option_that_differs_from_its_default_is_listed():
    changed = {}
    for f, opt in declared_options(TrainConfig):
        if not opt.cli:
            continue
        if f.type in ("bool", bool) or isinstance(f.default, bool):
            changed[f.name] = not f.default
        elif f.default is None and opt.ge is not None:
            changed[f.name] = 7
        elif isinstance(f.default, int) and not isinstance(f.default, bool):
            changed[f.name] = f.default + 1
    model, listed = tiny_model(), 0
    for name, value in changed.items():
        try:
            config = TrainConfig(**{name: value})
        except ValueError:  # needs another option set too: not this test's business
            continue
        card = model_card(model, config)
        assert f"| `{name}` |" in card, name
        assert card.count("| `") == 1, card  # that option only
        listed += 1
    assert listed >= 15


def test_prompts_stored_in_the_model_show_in_the_usage():
    model = tiny_model()
    model.prompts = {"query": "query: ", "document": "passage: "}
    card = model_card(model, TrainConfig(), location="out")
    assert 'prompt_name="query"' in card and "prefix='passage: '" in card


def test_a_model_saved_without_a_run_still_gets_a_card(tmp_path):
    from densefit import Retriever

    retriever = Retriever(tiny_model())
    retriever.save(tmp_path / "r")
    card = (tmp_path / "r" / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: sentence-transformers") and "## Usage" in card


def test_the_cards_usage_snippets_run(tmp_path):
    """Every Python example of the card runs as written: sentence-transformers loads the saved
    model, and Haystack 3's embedders (haystack_integrations) accept it."""
    import re

    import pytest

    pytest.importorskip("haystack_integrations.components.embedders.sentence_transformers")
    config = TrainConfig(batch_size=4, query_prompt="query: ", show_progress=False)
    examples, _ = read_training_data(_pairs(tmp_path), on_bad_row="error")
    train(tiny_model(), examples, config, output_dir=tmp_path / "m")
    card = (tmp_path / "m" / "README.md").read_text()
    snippets = re.findall(r"```python\n(.*?)```", card, flags=re.S)
    assert len(snippets) == 2 and "haystack_integrations" in snippets[1]
    for snippet in snippets:
        exec(compile(snippet, "README.md", "exec"), {})  # noqa: S102 - the card's own code


def _pairs(folder) -> object:
    path = folder / "pairs.jsonl"
    path.write_text(rows())
    return path
