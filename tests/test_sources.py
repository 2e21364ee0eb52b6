"""Several training sources: same-source steps, the three interleavings, what a run reports
per source, and the learning rate and warning of a batch larger than the data (issue 23)."""

from __future__ import annotations

import json
import warnings
from collections import Counter
from itertools import islice

import pytest

from densefit import TrainConfig, TrainingExample, train
from densefit.data.batching import (
    effective_batch_size,
    epoch_steps,
    no_duplicate_batches,
    planned_batches,
    row_keys,
    step_groups,
    steps_per_epoch,
    total_steps,
)
from densefit.data.sources import (
    TrainingData,
    load_training_data,
    load_training_examples,
    source_names,
)
from densefit.testing import tiny_model
from densefit.training.setup import setup_run


def rows(name: str, n: int, *, dupes: bool = False) -> list[TrainingExample]:
    """``n`` rows of one source; with ``dupes`` every five rows share their positive."""
    return [
        TrainingExample(
            f"what is {name} {i}",
            f"the {name} protein {i // 5 if dupes else i}",
            (f"a {name} virus {i}",) if i % 3 == 0 else (),
            origin=f"{name}:{i}",
        )
        for i in range(n)
    ]


def data(*sizes: int) -> TrainingData:
    names = "abcdefgh"
    return TrainingData([(names[k], rows(names[k], n), None) for k, n in enumerate(sizes)])


def source_of_rows(examples: TrainingData, group) -> set[int]:
    return {examples.source_of(i) for i in group.rows}


SETTINGS = [
    dict(batch_size=4),
    dict(batch_size=5, drop_last=True),
    dict(batch_size=8, gradient_accumulation_steps=2),
    dict(batch_size=3, no_duplicates=True),
]


@pytest.mark.parametrize("sampling", ["proportional", "round_robin", "temperature"])
@pytest.mark.parametrize("setting", SETTINGS)
def test_same_source_steps_never_mix_sources(sampling, setting):
    examples = data(13, 7, 30)
    config = TrainConfig(source_sampling=sampling, show_progress=False, **setting)
    steps = list(islice(step_groups(examples, config), steps_per_epoch(examples, config) * 3))
    assert len(steps) == steps_per_epoch(examples, config) * 3 > 0
    for group in steps:
        assert source_of_rows(examples, group) == {group.source}, group
        assert sum(map(len, group.micro_batches)) <= config.batch_size
        assert len(group.micro_batches) <= config.gradient_accumulation_steps
    # Each source's rows are used pass after pass: within a pass every row once, the next
    # pass starts only when the previous one is used up (whatever the interleaving).
    micro = config.batch_size // config.gradient_accumulation_steps
    for k, source in enumerate(examples.sources):
        used = [i for g in steps if g.source == k for i in g.rows]
        per_pass = source.rows // micro * micro if config.drop_last else source.rows
        for start in range(0, len(used) - per_pass + 1, per_pass):
            window = used[start : start + per_pass]
            assert len(set(window)) == per_pass, (k, start)
            assert set(window) <= set(range(source.start, source.start + source.rows))


def test_proportional_is_one_pass_of_every_source_per_epoch_in_a_seeded_order():
    examples = data(13, 7, 30)
    config = TrainConfig(batch_size=4, show_progress=False)
    for epoch in range(3):
        steps = epoch_steps(examples, config, epoch)
        used = sorted(i for _, micro in steps for b in micro for i in b)
        assert used == list(range(len(examples)))  # every row exactly once per epoch
        assert Counter(s for s, _ in steps) == {0: 4, 1: 2, 2: 8}  # ceil(rows / 4) each
    order = [s for s, _ in epoch_steps(examples, config, 0)]
    assert order != sorted(order)  # interleaved, not one source after the other
    assert order == [s for s, _ in epoch_steps(examples, config, 0)]  # seeded
    other = TrainConfig(batch_size=4, seed=7, show_progress=False)
    assert [s for s, _ in epoch_steps(examples, other, 0)] != order
    assert [s for s, _ in epoch_steps(examples, config, 1)] != order  # a new order each epoch


def test_round_robin_takes_one_step_of_each_source_in_turn_until_the_smallest_is_used_up():
    examples = data(13, 7, 30)  # 4, 2 and 8 steps of 4 rows a pass
    config = TrainConfig(batch_size=4, source_sampling="round_robin", show_progress=False)
    assert steps_per_epoch(examples, config) == 6
    groups = list(islice(step_groups(examples, config), 6 * 4))
    assert [g.source for g in groups] == [0, 1, 2] * 8
    # The largest source goes on where it stopped: its 8 steps of a pass span 4 epochs.
    third = [i for g in groups if g.source == 2 for i in g.rows]
    assert sorted(third[:30]) == list(range(20, 50))  # its first pass: every row once


def test_temperature_draws_sources_by_rows_to_the_power_one_over_t_seeded():
    examples = data(900, 100)  # batch 1: 900 and 100 steps a pass
    counts = {}
    for temperature in (1.0, 1e6):
        config = TrainConfig(
            batch_size=1, source_sampling="temperature", source_temperature=temperature,
            show_progress=False,
        )  # fmt: skip
        order = [s for s, _ in epoch_steps(examples, config, 0)]
        assert len(order) == 1000  # as long as a proportional epoch
        assert order == [s for s, _ in epoch_steps(examples, config, 0)]  # seeded
        counts[temperature] = Counter(order)[1]
    # P(small source): 0.1 at T=1, ~0.5 as T grows; 1000 draws, 5 standard deviations.
    assert abs(counts[1.0] - 100) < 5 * (1000 * 0.1 * 0.9) ** 0.5
    assert abs(counts[1e6] - 500) < 5 * (1000 * 0.25) ** 0.5
    # Oversampled, the small source cycles through new passes; every pass is a permutation.
    config = TrainConfig(batch_size=1, source_sampling="temperature", source_temperature=1e6)
    small = [i for g in islice(step_groups(examples, config), 3000) if g.source == 1
             for i in g.rows]  # fmt: skip
    assert len(small) > 300
    for start in range(0, len(small) - 99, 100):
        assert sorted(small[start : start + 100]) == list(range(900, 1000))


def test_mixed_batches_of_several_sources_are_the_plain_shuffle_of_all_rows():
    examples = data(13, 7, 30)
    plain = [
        ex for source in ("a", "b", "c") for ex in rows(source, {"a": 13, "b": 7, "c": 30}[source])
    ]
    config = TrainConfig(batch_size=4, source_batches="mixed", show_progress=False)
    mixed = list(islice(step_groups(examples, config), 30))
    reference = list(islice(step_groups(plain, config), 30))
    assert [g.micro_batches for g in mixed] == [g.micro_batches for g in reference]
    assert {g.source for g in mixed} == {None}
    assert any(len(source_of_rows(examples, g)) > 1 for g in mixed)


def test_sources_from_lists_mappings_and_paths_and_what_is_refused(tmp_path):
    path = tmp_path / "faq.jsonl"
    path.write_text('{"question": "q1", "pos_doc": "d1"}\n{"question": "q2", "pos_doc": "d2"}\n')
    several = load_training_data([str(path), [{"anchor": "a", "positive": "p"}]])
    assert several.names == ["faq.jsonl", "source 2"] and len(several) == 3
    assert several[2].origin == "source 2:0" and several.source_of(2) == 1
    named = load_training_data({"faq": path, "manual": rows("m", 2)})
    assert named.names == ["faq", "manual"] and named[0].origin == f"{path}:1"
    one = load_training_data([{"anchor": "a", "positive": "p"}])
    assert one.names == ["data"] and len(one.sources) == 1
    with pytest.raises(ValueError, match="mixes rows .* and sources"):
        load_training_data([{"anchor": "a", "positive": "p"}, str(path)])
    with pytest.raises(ValueError, match="mapping of sources is empty"):
        load_training_data({})
    with pytest.raises(ValueError, match="two training sources are named 'x'"):
        TrainingData([("x", rows("x", 1), None), ("x", rows("y", 1), None)])
    with pytest.raises(ValueError, match="source 'faq': a single dict is one row"):
        load_training_data({"faq": {"anchor": "a", "positive": "p"}})


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    tiny_model(root / "build").save(str(root / "base"))
    return str(root / "base")


def load(folder):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu")


SOURCES = {
    "faq": rows("faq", 10, dupes=True),
    "manual": rows("manual", 6),
    "code": rows("code", 14),
}


def test_a_run_on_several_sources_logs_and_reports_each_source(base, tmp_path):
    config = TrainConfig(batch_size=4, epochs=2, learning_rate=1e-3, show_progress=False)
    out = tmp_path / "out"
    result = train(load(base), SOURCES, config, output_dir=out)
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    examples = load_training_data(SOURCES)
    groups = list(islice(step_groups(examples, config), result.steps))
    assert [r["source"] for r in log] == [examples.names[g.source] for g in groups]
    assert result.steps == 2 * (3 + 2 + 4)
    for name, source in result.sources.items():
        mine = [r for r in log if r["source"] == name]
        assert source["rows"] == len(SOURCES[name])
        assert source["steps"] == len(mine) and source["trained_rows"] == 2 * len(SOURCES[name])
        assert source["mean_loss"] == pytest.approx(
            sum(r["loss"] for r in mine) / len(mine), abs=1e-6
        )
        assert source["last_loss"] == pytest.approx(mine[-1]["loss"], abs=1e-6)
    # masking and batch health work per step as before: faq's ten rows have two positives,
    # so three faq rows always repeat one; the other sources repeat no text
    assert all(
        r["masked_duplicates"] > 0 for r in log if r["source"] == "faq" and r["examples"] > 2
    )
    assert all(r["masked_duplicates"] == 0 for r in log if r["source"] != "faq")
    assert all("pos_score" in r and "unique_candidates" in r for r in log)
    saved = json.loads((out / "densefit_config.json").read_text())
    assert saved["sources"] == result.sources
    card = (out / "README.md").read_text()
    assert "## Training sources" in card and "interleaved `proportional`" in card
    for name in SOURCES:
        assert f"| {name} | `{name}` | {len(SOURCES[name])} |" in card
    mixed = train(
        load(base), SOURCES, TrainConfig(**{**config.to_dict(), "source_batches": "mixed"})
    )
    assert mixed.sources["faq"]["steps"] is None
    assert sum(s["trained_rows"] for s in mixed.sources.values()) == 60


@pytest.mark.parametrize(
    "memory", [dict(memory="cache", chunk_size=2), dict(memory="checkpoint"),
               dict(memory="cache", chunk_size=1, keep_graphs=0)]
)  # fmt: skip
def test_every_memory_strategy_gives_the_plain_losses_with_several_sources(base, memory):
    """Dropout on (invariant dropout, the default): same losses as plain, step by step."""
    config = dict(batch_size=4, max_steps=6, learning_rate=1e-3, show_progress=False,
                  source_sampling="temperature")  # fmt: skip
    plain = train(load(base), SOURCES, TrainConfig(memory="plain", **config))
    other = train(load(base), SOURCES, TrainConfig(**memory, **config))
    assert other.losses == pytest.approx(plain.losses, abs=1e-5)
    assert [s["steps"] for s in other.sources.values()] == [
        s["steps"] for s in plain.sources.values()
    ]


def test_lr_auto_follows_the_batch_a_step_really_has_and_a_bigger_batch_warns(tiny, tmp_path):
    one = rows("x", 64)
    with pytest.warns(UserWarning, match=r"batch_size 1,000,000,000 is larger than the data "
                      r"\(64 rows\): every step trains on at most 64 rows; learning_rate auto "
                      r"follows 64: 4e-05"):  # fmt: skip
        run = setup_run(tiny, one, TrainConfig(batch_size=10**9, show_progress=False))
    assert run.config.learning_rate == pytest.approx(4e-5)  # not 2e-4, the requested batch's
    assert run.optimizer.param_groups[0]["initial_lr"] == pytest.approx(4e-5)
    assert run.report()["learning_rate"] == pytest.approx(4e-5)
    # same-source batches: a step has at most the largest source's rows
    two = TrainingData([("small", rows("s", 40), None), ("large", rows("l", 100), None)])
    config = TrainConfig(batch_size=1000, show_progress=False)
    assert effective_batch_size(two, config) == 100
    assert effective_batch_size(two, TrainConfig(batch_size=1000, source_batches="mixed")) == 140
    with pytest.warns(UserWarning, match=r"\(100 rows in its largest source, large\).*6.25e-05"):
        run = setup_run(tiny, two, config)
    assert run.config.learning_rate == pytest.approx(6.25e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a batch the data fills: no warning, the rule as is
        run = setup_run(tiny, rows("x", 64), TrainConfig(batch_size=32, show_progress=False))
    assert run.config.learning_rate == pytest.approx(2e-5)
    # a given learning rate is kept, and only the warning says the batch is smaller
    with pytest.warns(UserWarning, match="larger than the data") as caught:
        run = setup_run(tiny, one, TrainConfig(batch_size=128, learning_rate=1e-4))
    assert run.config.learning_rate == 1e-4 and "learning_rate auto" not in str(caught[0].message)


def test_a_cli_rerun_of_the_same_options_is_not_refused_before_the_data_is_read(base, tmp_path):
    """The CLI checks the output folder before it reads the data or loads the model: options
    that resolve from them (learning_rate auto from the batch a step has, similarity from the
    model) are left to the check that knows them; a changed option is still refused."""
    from typer.testing import CliRunner

    from densefit.cli import app

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"anchor": f"q {i}", "positive": f"p {i}"}) + "\n"
                            for i in range(8)))  # fmt: skip
    args = ["train", str(data), "-m", base, "-o", str(tmp_path / "out"), "--no-progress",
            "--batch-size", "1000000000"]  # fmt: skip
    runner = CliRunner()
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert "larger than the data (8 rows)" in " ".join(first.output.split())
    again = runner.invoke(app, args)
    assert again.exit_code == 0, again.output
    assert (tmp_path / "out" / "train_log.1.jsonl").is_file()  # the old log, kept
    saved = json.loads((tmp_path / "out" / "densefit_config.json").read_text())
    assert saved["learning_rate"] == pytest.approx(5e-6)  # batch 8, not 1e9
    changed = runner.invoke(app, [*args, "--lr", "1e-4"])
    assert changed.exit_code == 2
    assert "learning_rate=5e-06 (now 0.0001)" in " ".join(changed.output.split())


def test_densefit_train_on_two_files_trains_same_source_batches_and_reports_each(base, tmp_path):
    """``densefit train a.jsonl faq=b.jsonl``: two sources (the second named), every step's
    rows from one source; the start line, the log and the summary report each source."""
    from typer.testing import CliRunner

    from densefit.cli import app

    for name, n in (("a", 6), ("b", 10)):
        (tmp_path / f"{name}.jsonl").write_text(
            "".join(
                json.dumps({"anchor": f"{name} question {i}", "positive": f"{name} answer {i}"})
                + "\n"
                for i in range(n)
            )
        )
    out = tmp_path / "out"
    args = ["train", str(tmp_path / "a.jsonl"), f"faq={tmp_path / 'b.jsonl'}", "-m", base,
            "-o", str(out), "--no-progress", "--batch-size", "4"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "training on 16 rows from 2 sources (a.jsonl 6 rows, faq 10 rows), same-source " \
        "batches (proportional)" in said  # fmt: skip
    assert "per source: a.jsonl: 6 rows, 2 steps, 6 rows trained" in said
    assert "faq: 10 rows, 3 steps, 10 rows trained" in said
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["source"] for r in log].count("faq") == 3 and len(log) == 5
    for record in log:  # a step of faq holds only faq's rows: its size says so
        assert record["examples"] <= 4
    examples = load_training_data({"a.jsonl": str(tmp_path / "a.jsonl"),
                                   "faq": str(tmp_path / "b.jsonl")})  # fmt: skip
    config = TrainConfig(batch_size=4)
    for group, record in zip(step_groups(examples, config), log):
        assert source_of_rows(examples, group) == {group.source}
        assert record["source"] == examples.names[group.source]
    mixed = CliRunner().invoke(app, [*args, "-o", str(tmp_path / "mixed"), "--source-batches",
                                     "mixed"])  # fmt: skip
    assert mixed.exit_code == 0, mixed.output
    assert "mixed batches" in " ".join(mixed.output.split())
    log = (tmp_path / "mixed" / "train_log.jsonl").read_text().splitlines()
    assert all("rows_by_source" in json.loads(line) for line in log)


# -- what mutation testing showed unreached (bench/results/mutation.md) ----------------------


def test_training_data_indexes_as_a_list_does():
    examples = data(2, 3)
    everything = list(examples)
    assert len(everything) == 5
    for i in range(-5, 5):
        assert examples[i] == everything[i], i
    assert examples[1:4] == everything[1:4] and examples[::-2] == everything[::-2]
    for i, shown in ((5, 5), (-6, -1)):
        with pytest.raises(IndexError, match=f"^row {shown} of 5$"):
            examples[i]
    with pytest.raises(ValueError, match="^no training data: give at least one source$"):
        TrainingData([])
    with pytest.raises(ValueError, match="^two training sources are named 'b': name each once$"):
        TrainingData([("b", rows("b", 1), None), ("a", rows("a", 1), None), ("b", [], None)])


def test_describe_gives_files_rows_and_skipped_rows_and_each_source_when_several(tmp_path):
    path = tmp_path / "faq.jsonl"
    path.write_text('{"question": "q1", "pos_doc": "d1"}\n{"question": "q2"}\n')
    with pytest.warns(UserWarning) as warned:
        one = load_training_data(path, on_bad_row="skip")
    # the caller's line, not densefit's (mutation testing's trampoline adds a frame of its own)
    callers = [w.filename for w in warned]
    assert callers == [__file__] or "mutmut" in callers[0], callers
    assert one.describe() == {"files": [str(path)], "rows": 1, "skipped_rows": 1}
    odd = [TrainingExample("q", "p", origin="C:/data/x.jsonl:12"), TrainingExample("q", "p")]
    with pytest.warns(UserWarning):
        both = load_training_data({"faq": path, "odd": odd}, on_bad_row="skip")
    assert both.describe() == {
        "files": sorted([str(path), "C:/data/x.jsonl"]),
        "rows": 3,
        "skipped_rows": None,  # the rows given as they are say nothing of skipped rows
        "sources": [
            {"name": "faq", "files": [str(path)], "rows": 1, "skipped_rows": 1},
            {"name": "odd", "files": ["C:/data/x.jsonl"], "rows": 2, "skipped_rows": None},
        ],
    }
    with pytest.warns(UserWarning):
        twice = load_training_data({"a": path, "b": path}, on_bad_row="skip")
    assert twice.describe()["skipped_rows"] == 2


def test_each_source_is_read_with_the_split_and_the_bad_row_rule_given(tmp_path):
    beir = tmp_path / "beir"
    (beir / "qrels").mkdir(parents=True)
    (beir / "corpus.jsonl").write_text(
        "".join(json.dumps({"_id": f"c{i}", "text": f"doc {i}"}) + "\n" for i in range(3))
    )
    (beir / "queries.jsonl").write_text(
        "".join(json.dumps({"_id": f"q{i}", "text": f"query {i}"}) + "\n" for i in range(3))
    )
    for split, pairs in (("train", ["q0\tc0\t1", "q1\tc1\t1"]), ("dev", ["q2\tc2\t1"])):
        (beir / "qrels" / f"{split}.tsv").write_text(
            "query-id\tcorpus-id\tscore\n" + "\n".join(pairs) + "\n"
        )
    assert [r.query for r in load_training_data(beir)] == ["query 0", "query 1"]
    assert [r.query for r in load_training_data(beir, split="dev")] == ["query 2"]
    assert [r.query for r in load_training_data({"x": beir}, split="dev")] == ["query 2"]
    assert [r.query for r in load_training_examples(beir, split="dev")] == ["query 2"]
    assert [r.query for r in load_training_examples(beir)] == ["query 0", "query 1"]
    assert load_training_data(beir).describe()["files"] == [str(beir)]  # the folder read
    with pytest.raises(ValueError) as error:
        load_training_data({})
    assert str(error.value) == "no training data: the mapping of sources is empty"
    listed = [{"anchor": "a", "positive": "p"}, {"anchor": "b"}]
    with pytest.raises(ValueError, match="positive"):
        load_training_data({"faq": listed})
    with pytest.warns(UserWarning, match="^faq: 1 rows read, 1 bad rows skipped"):
        skipped = load_training_data({"faq": listed}, on_bad_row="skip")
    assert [r.query for r in skipped] == ["a"]
    assert load_training_data(listed[:1])[0].origin == "<list>:0"
    assert load_training_data({"faq": listed[:1]})[0].origin == "faq:0"


def test_hugging_face_datasets_are_sources_read_with_their_split_and_name():
    datasets = pytest.importorskip("datasets")
    train = datasets.Dataset.from_dict({"anchor": ["a"], "positive": ["p"]})
    dev = datasets.Dataset.from_dict({"anchor": ["b", "c"], "positive": ["q", "r"]})
    both = load_training_data([train, dev])
    assert both.names == ["source 1", "source 2"] and len(both) == 3
    splits = datasets.DatasetDict({"train": train, "dev": dev})
    assert [r.query for r in load_training_data({"hf": splits}, split="dev")] == ["b", "c"]
    bad = datasets.Dataset.from_dict({"anchor": ["a", ""], "positive": ["p", "q"]})
    with pytest.raises(ValueError, match="^hf:row 1"):
        load_training_data({"hf": bad})


def test_sources_are_named_once_and_wrong_ones_refused_saying_where():
    assert source_names(["a/faq.jsonl", "b/faq.jsonl", [], "c/faq.jsonl", "x"]) == [
        "faq.jsonl",
        "faq.jsonl #2",
        "source 3",
        "faq.jsonl #3",
        "x",
    ]
    single = load_training_data([{"anchor": "a", "positive": "p"}])
    nested = load_training_data({"inner": single})
    assert nested.names == ["inner"] and nested[0] == single[0]
    assert load_training_data(single) is single
    with pytest.raises(ValueError) as error:
        load_training_data({"outer": data(1, 1)})
    assert str(error.value) == "source 'outer': holds several sources itself; list them instead"
    expected = (
        "{}: expected a path, a datasets.Dataset, a list of dicts or of TrainingExamples, or "
        "several of those; got int"
    )
    for given, where in (({"n": 5}, "source 'n'"), (5, "training data")):
        with pytest.raises(ValueError) as error:
            load_training_data(given)
        assert str(error.value) == expected.format(where)
    with pytest.raises(ValueError) as error:
        load_training_data([{"anchor": "a", "positive": "p"}, "faq.jsonl"])
    assert str(error.value) == (
        "the training data mixes rows (dicts) and sources (paths, datasets, lists) in one "
        "list: give a list of rows, or a list (or a mapping) of sources"
    )


def test_the_earlier_name_reads_as_load_training_data(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"anchor": "a", "positive": "p"}\n{"anchor": "b"}\n')
    with pytest.raises(ValueError, match="positive"):
        load_training_examples(path)
    with pytest.warns(UserWarning):
        read = load_training_examples(path, on_bad_row="skip")
    assert read.names == ["pairs.jsonl"] and [r.query for r in read] == ["a"]


# -- the step plan's invariants (what mutation testing of densefit/data/batching.py showed
# unchecked: bench/results/mutation.md) ----------------------------------------------------

PLANS = [
    dict(batch_size=bs, gradient_accumulation_steps=acc, drop_last=drop, source_batches=mode,
         source_sampling=sampling)
    for bs, acc in ((2, 1), (4, 2), (3, 3), (1, 2))
    for drop in (False, True)
    for mode, sampling in (("mixed", "proportional"), ("same", "proportional"),
                           ("same", "round_robin"), ("same", "temperature"))
]  # fmt: skip


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: "-".join(map(str, p.values())))
@pytest.mark.parametrize("sizes", [(7, 3), (1, 1), (9,)])
def test_every_epoch_has_the_counted_steps_and_a_step_resumes_where_it_says(plan, sizes):
    examples = data(*sizes) if len(sizes) > 1 else rows("only", sizes[0])
    config = TrainConfig(seed=3, **plan)
    per_epoch = steps_per_epoch(examples, config)
    micro = max(1, plan["batch_size"] // plan["gradient_accumulation_steps"])
    for epoch in range(3):
        steps = epoch_steps(examples, config, epoch)
        assert len(steps) == per_epoch, (epoch, steps)
        for source, micro_batches in steps:
            assert 1 <= len(micro_batches) <= plan["gradient_accumulation_steps"]
            assert all(1 <= len(b) <= micro for b in micro_batches)
            if plan["drop_last"]:
                assert all(len(b) == micro for b in micro_batches)
            if len(sizes) == 1:
                assert source == 0
            elif plan["source_batches"] == "mixed":
                assert source is None
            else:
                start = sum(sizes[:source])
                assert all(start <= i < start + sizes[source] for b in micro_batches for i in b)
    groups = list(islice(step_groups(examples, config), 3 * per_epoch))
    assert [g.epoch for g in groups] == [e for e in range(3) for _ in range(per_epoch)]
    assert [g.epoch_end for g in groups] == [k == per_epoch - 1 for _ in range(3) for k in range(per_epoch)]  # fmt: skip
    for now, after in zip(groups, groups[1:]):  # a checkpoint's position gives the next step
        resumed = next(step_groups(examples, config, epoch=now.next_epoch, batch=now.next_batch))
        assert (resumed.epoch, resumed.micro_batches) == (after.epoch, after.micro_batches)
    planned = planned_batches(examples, config)
    assert planned == [b for g in groups[: total_steps(examples, config)] for b in g.micro_batches]


def test_a_plan_with_no_step_is_empty():
    config = TrainConfig(batch_size=4, drop_last=True, source_batches="same",
                         source_sampling="round_robin")  # fmt: skip
    assert steps_per_epoch(data(2, 3), config) == 0 and epoch_steps(data(2, 3), config, 0) == []
    assert list(step_groups(data(2, 3), config)) == []
    assert effective_batch_size(rows("x", 5), TrainConfig(batch_size=1)) == 1
    assert effective_batch_size(data(2, 6), TrainConfig(batch_size=8, source_batches="same")) == 6
    assert effective_batch_size(data(2, 6), TrainConfig(batch_size=8, source_batches="mixed")) == 8


def test_orders_follow_the_seed_the_epoch_and_the_source():
    def order(examples, **options):
        config = TrainConfig(batch_size=2, **options)
        return [b for _, micro in epoch_steps(examples, config, options.pop("epoch", 0)) for b in micro]  # fmt: skip

    same = dict(source_batches="same")
    assert order(data(6, 6), seed=1, **same) != order(data(6, 6), seed=2, **same)
    first, second = order(data(6, 6), seed=1, **same), order(data(6, 6), seed=1, **same)
    assert first == second  # seeded: the same in every process and run
    by_source = {}
    for batch in first:
        by_source.setdefault(batch[0] // 6, []).extend(i % 6 for i in batch)
    assert by_source[0] != by_source[1]  # two sources of one size are not shuffled alike
    rr = dict(source_batches="same", source_sampling="temperature", source_temperature=2.0)
    schedules = {tuple(s for s, _ in epoch_steps(data(9, 3), TrainConfig(batch_size=2, seed=k, **rr), 0)) for k in range(6)}  # fmt: skip
    assert len(schedules) > 1  # the schedule follows the seed
    assert order(rows("x", 8), seed=1) != order(rows("x", 8), seed=2)


def test_a_leftover_duplicate_is_swapped_into_an_earlier_batch():
    """Rows 2 and 3 share a query and come last: row 3 trades places with a row of the
    batch before that holds none of batch 2's texts, even one holding row 3's other text
    (the swap moves that text out with it), or all its texts being that one."""
    for first in (TrainingExample("y", "h"), TrainingExample("h", "h")):
        examples = [first, TrainingExample("b", "pb"), TrainingExample("x", "p2"),
                    TrainingExample("x", "h")]  # fmt: skip
        assert no_duplicate_batches(examples, [[0, 1], [2, 3]]) == [[3, 1], [2, 0]]


@pytest.mark.parametrize("sampling", ["proportional", "round_robin", "temperature"])
def test_each_epoch_and_each_seed_shuffle_every_source_anew(sampling):
    def within(seed, epoch):  # each source's rows in the order the epoch takes them
        config = TrainConfig(batch_size=2, seed=seed, source_batches="same",
                             source_sampling=sampling)  # fmt: skip
        taken = {}
        for source, micro in epoch_steps(data(8, 8), config, epoch):
            taken.setdefault(source, []).extend(i for b in micro for i in b)
        return taken

    assert within(1, 0) != within(1, 1)  # a new pass of each source, not the last one again
    assert within(1, 0) != within(2, 0)
    assert within(1, 0) == within(1, 0)


def test_texts_that_are_not_valid_unicode_still_have_keys():
    lone = TrainingExample("\ud800 query", "positive")  # a lone surrogate, as JSON allows
    assert len(row_keys(lone)) == 2
    assert row_keys(lone) == row_keys(TrainingExample(lone.query, lone.positive))
