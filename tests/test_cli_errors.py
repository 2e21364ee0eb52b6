"""Every command, every bad option: exit status 2, one line on stderr, never a traceback.

In-process through typer's CliRunner (the app's own error handler runs there too), a
subprocess only for ``--debug``'s traceback and the unexpected-error line.
"""

import json
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from densefit.cli import app
from densefit.config.train import TrainConfig
from densefit.testing import tiny_model

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """A tiny model (position limit 128), training pairs, a BEIR folder and a plain file."""
    root = tmp_path_factory.mktemp("cli_errors")
    tiny_model(root / "model")
    rows = [{"question": f"what is cell {i}", "pos_doc": f"the cell protein {i}"} for i in range(8)]
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    beir = root / "beir"
    (beir / "qrels").mkdir(parents=True)
    (beir / "corpus.jsonl").write_text(
        "".join(
            json.dumps({"_id": f"d{i}", "text": f"the cell protein {i}"}) + "\n" for i in range(8)
        )
    )
    (beir / "queries.jsonl").write_text(
        "".join(json.dumps({"_id": f"q{i}", "text": f"what is cell {i}"}) + "\n" for i in range(8))
    )
    for split in ("train", "test"):
        lines = ["query-id\tcorpus-id\tscore"] + [f"q{i}\td{i}\t1" for i in range(8)]
        (beir / "qrels" / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    (root / "a_file").write_text("not a folder\n")
    return root


@pytest.fixture(autouse=True)
def no_progress_bars(monkeypatch):
    """transformers draws a 'Loading weights' bar on stderr: not ours, not counted."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    yield
    logging.enable_progress_bar()


def command(ws: Path, name: str) -> list[str]:
    """A valid command line of ``name`` over the workspace; each case adds one bad option."""
    m, out = str(ws / "model"), str(ws / "out")
    return {
        "train": ["train", str(ws / "pairs.jsonl"), "-m", m, "-o", out, "--max-steps", "1",
                  "--no-progress"],
        "plan": ["plan", str(ws / "pairs.jsonl"), "-m", m, "--batch-size", "4"],
        "mine": ["mine", str(ws / "beir"), "--corpus", str(ws / "beir"), "-o",
                 str(ws / "mined.jsonl"), "--no-progress"],
        "reembed": ["reembed", "--store", str(ws / "store"), "-m", m, "--no-progress"],
        "dense-mine": ["mine", str(ws / "beir"), "--corpus", str(ws / "beir"), "-o",
                       str(ws / "mined.jsonl"), "--no-progress", "--method", "dense", "-m", m],
        "index": ["index", str(ws / "beir"), "-m", m, "--store", str(ws / "store"),
                  "--no-progress"],
        "search": ["search", "cell", "--store", str(ws / "no-store")],
        "eval": ["eval", "--dataset", str(ws / "beir"), "-m", m, "--no-progress"],
        "run": ["run", "--data", str(ws / "beir"), "-m", m, "-o", str(ws / "run"),
                "--no-progress"],
        "serve": ["serve", "--store", str(ws / "no-store")],
        "export": ["export", m, "--no-progress"],
    }[name]  # fmt: skip


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")

# (command, extra arguments, a piece of the one error line); {ws}: the workspace folder.
CASES = [
    ("train", ["--max-seq-length", "100000"], "limit of 128 tokens"),
    ("train", ["--max-seq-length", "0"], "--max-seq-length must be >= 1, got 0"),
    pytest.param("train", ["--device", "cuda"], "--device is cuda", marks=NO_CUDA),
    ("train", ["--device", "gpu"], "--device must be one of auto, cpu, cuda, cuda:N, mps"),
    ("train", ["--warmup", "-5"], "--warmup must be >= 0, got -5"),
    ("train", ["--scale", "0"], "--scale must be > 0"),
    ("train", ["--token-budget", "0"], "--token-budget must be >= 1"),
    ("train", ["--chunk-size", "0"], "--chunk-size must be >= 1"),
    ("train", ["--loss-block-size", "0"], "--loss-block-size must be >= 1"),
    ("train", ["--keep-graphs", "-1"], "--keep-graphs must be >= 0"),
    ("train", ["--weight-decay", "-0.1"], "--weight-decay must be >= 0"),
    ("train", ["--max-grad-norm", "0"], "--max-grad-norm must be > 0"),
    ("train", ["--max-grad-norm", "abc"], "'--max-grad-norm'"),
    ("train", ["--log-every", "0"], "--log-every must be >= 1"),
    ("train", ["--grad-accum", "0"], "--grad-accum must be >= 1"),
    ("train", ["--batch-size", "0"], "--batch-size must be >= 1"),
    ("train", ["--epochs", "0"], "--epochs must be >= 1"),
    ("train", ["--lr", "0"], "--lr must be auto or a number > 0"),
    ("train", ["--max-steps", "0"], "--max-steps must be >= 1"),
    ("train", ["--checkpoint-every", "0"], "--checkpoint-every must be >= 1"),
    ("train", ["--keep-checkpoints", "-1"], "--keep-checkpoints must be >= 0"),
    ("train", ["--max-nonfinite", "-1"], "--max-nonfinite must be >= 0"),
    ("train", ["--memory-budget", "bogus"], "--memory-budget must be a memory size"),
    ("train", ["--memory-budget", "150%"], "--memory-budget must be a memory size"),
    ("train", ["--loss", "triplet"], "--loss must be one of mnrl, margin_mse"),
    ("train", ["--memory", "lots"], "--memory must be one of plain, checkpoint, cache"),
    ("train", ["--gather", "all"], "--gather must be one of none, candidates, both"),
    ("train", ["--amp", "fp32"], "--amp must be one of null, bf16, fp16"),
    ("train", ["--similarity", "l2"], "--similarity must be one of null, cosine, dot"),
    ("train", ["--batch-size", "many"], "'--batch-size'"),
    ("train", ["--nproc", "0"], "--nproc must be >= 1"),
    ("train", ["--no-such-option"], "--no-such-option"),
    ("train", ["-o", "{ws}/a_file"], "not a folder"),
    ("train", ["-m", "{ws}/no-model"], "no-model"),
    ("plan", ["--memory-budget", "bogus"], "--memory-budget must be a memory size"),
    ("plan", ["--max-seq-length", "100000"], "limit of 128 tokens"),
    ("plan", ["--device", "gpu"], "--device must be one of"),
    ("plan", ["--memory", "cache"], "--memory"),  # plan always plans memory auto
    ("mine", ["--range", "abc"], "MIN:MAX"),
    ("mine", ["--method", "tfidf"], "--method must be one of bm25, dense, hybrid"),
    ("mine", ["--num-negatives", "0"], "--num-negatives must be >= 1, got 0"),
    ("mine", ["--relative-margin", "2"], "--relative-margin must be <= 1"),
    ("mine", ["--corpus", "{ws}/missing"], "missing"),
    ("dense-mine", ["--max-seq-length", "100000"], "limit of 128 tokens"),
    ("index", ["--max-seq-length", "100000"], "limit of 128 tokens"),
    ("index", ["--vectors", "int4"], "--vectors must be one of float32, float16, int8, binary"),
    ("search", ["--mode", "sparse"], "--mode must be one of dense, bm25, hybrid, got 'sparse'"),
    ("search", ["--fusion", "max"], "--fusion must be one of rrf, weighted"),
    ("search", ["--dense-weight", "2"], "--dense-weight must be <= 1, got 2"),
    ("search", ["--rrf-k", "-1"], "--rrf-k must be >= 0"),
    ("search", ["--rescore", "0"], "--rescore must be >= 1, got 0"),
    ("eval", ["--mode", "sparse"], "--mode must be one of dense, bm25, hybrid"),
    ("eval", ["--mode", "bm25", "--dims", "16"], "--dims cuts the embeddings"),
    ("index", ["--encode-batch-size", "0"], "--encode-batch-size must be >= 1"),
    ("index", ["--nproc", "0"], "--nproc must be >= 1, got 0"),
    ("index", ["--nproc", "-2"], "--nproc must be >= 1, got -2"),
    ("search", ["--top-k", "0"], "--top-k must be >= 1, got 0"),
    ("eval", ["--top-k", "0"], "--top-k must be >= 1, got 0"),
    ("eval", ["--queries", "q.jsonl"], "--dataset brings its own queries"),
    ("search", [], "no-store"),
    ("eval", ["--metrics", "ndcg@ten"], "ndcg@ten"),
    ("eval", ["--dataset", "{ws}/missing"], "missing"),
    ("run", ["--lr", "0"], "--lr must be auto or a number > 0"),
    ("run", ["--set", "train.warmup_steps=-5"], "train.warmup_steps must be >= 0, got -5"),
    ("run", ["--set", "train.device=gpu"], "train.device must be one of"),
    ("run", ["--set", "warmup"], "KEY=VALUE"),
    ("run", ["-o", "{ws}/a_file"], "not a folder"),
    ("run", ["--data", "{ws}/missing"], "missing"),
    ("serve", [], "no-store"),
    ("serve", ["--device", "gpu"], "--device must be one of"),
    ("serve", ["--max-k", "0"], "--max-k must be >= 1, got 0"),
    ("serve", ["--port", "70000"], "--port must be <= 65535"),
]


@pytest.mark.parametrize(("name", "extra", "expected"), CASES)
def test_bad_option_is_one_line_and_exit_2(ws, name, extra, expected):
    args = command(ws, name) + [a.format(ws=ws) for a in extra]
    result = runner.invoke(app, args)
    lines = result.stderr.splitlines()
    assert result.exit_code == 2, (args, result.output)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert expected.format(ws=ws) in lines[0], lines[0]
    assert "Traceback" not in result.output


def test_missing_data_file_every_command(ws):
    missing = str(ws / "missing.jsonl")
    for args in (
        ["train", missing, "-m", str(ws / "model"), "-o", str(ws / "o")],
        ["plan", missing, "-m", str(ws / "model"), "--batch-size", "4"],
        ["mine", missing, "--corpus", str(ws / "beir"), "-o", str(ws / "m.jsonl")],
        ["index", missing, "-m", str(ws / "model"), "--store", str(ws / "s")],
        ["run", str(ws / "missing.yaml")],
    ):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert result.stderr.count("\n") == 1 and "missing" in result.stderr, result.stderr


def test_planner_out_of_memory_is_one_line_and_exit_3(ws):
    result = runner.invoke(app, [*command(ws, "plan"), "--memory-budget", "1KiB"])
    assert result.exit_code == 3 and result.stderr.startswith("error: ")
    assert result.stderr.count("\n") == 1 and "raise --memory-budget" in result.stderr


def test_warnings_are_printed_by_the_one_warn_function(ws, tmp_path):
    args = ["train", str(ws / "pairs.jsonl"), "-m", str(ws / "model"), "-o", str(tmp_path / "o"),
            "--max-steps", "1", "--no-progress", "--resume"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "warning: no checkpoint in" in result.stderr and "starting from step 0" in result.stderr


def test_ctrl_c_says_where_the_checkpoint_is_and_how_to_resume(ws, tmp_path, monkeypatch):
    from densefit.training import checkpoint

    original = checkpoint.Checkpointer.save

    def save_then_interrupt(self, step, **kwargs):
        path = original(self, step, **kwargs)
        if step == 2:
            raise KeyboardInterrupt
        return path

    monkeypatch.setattr(checkpoint.Checkpointer, "save", save_then_interrupt)
    out = tmp_path / "out"
    args = ["train", str(ws / "pairs.jsonl"), "-m", str(ws / "model"), "-o", str(out),
            "--batch-size", "2", "--checkpoint-every", "1", "--no-progress"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 130, result.output
    line = " ".join(result.stderr.split())
    assert f"the last checkpoint is {out / 'checkpoints' / 'step-000002'} (step 2)" in line
    assert line.endswith(" ".join(["continue with: densefit", *args[:], "--resume"]))


def test_debug_prints_the_traceback(ws, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "DENSEFIT_ALLOCATOR": "system"}
    args = ["plan", str(ws / "missing.jsonl"), "--batch-size", "4", "-m", str(ws / "model")]
    plain = subprocess.run([sys.executable, "-m", "densefit", *args], capture_output=True,
                           text=True, env=env, timeout=120)  # fmt: skip
    assert plain.returncode == 2 and plain.stderr.count("\n") == 1
    debug = subprocess.run([sys.executable, "-m", "densefit", *args, "--debug"],
                           capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert debug.returncode == 2 and "Traceback" in debug.stderr
    assert debug.stderr.splitlines()[-1] == plain.stderr.strip()


def test_an_unexpected_error_is_one_line_that_says_how_to_report_it(ws):
    code = (
        "import sys, densefit.data.readers as r\n"
        "def boom(*a, **k):\n    raise RuntimeError('boom')\n"
        "r.read_training_data = boom\n"
        "from densefit.cli import main\nmain()\n"
    )
    args = ["plan", str(ws / "pairs.jsonl"), "--batch-size", "4", "-m", str(ws / "model")]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                            env=env, timeout=120)  # fmt: skip
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("unexpected error: RuntimeError: boom — rerun with --debug")


# ----------------------------------------------------------------------------- the declaration


def _commands():
    """(name, click command, the Options classes it is generated from) of every command."""
    import typer as _typer

    from densefit.config.commands import (
        EvalJob,
        ExportJob,
        IndexJob,
        MineJob,
        PlanJob,
        ReembedJob,
        SearchJob,
        TrainJob,
    )
    from densefit.config.run import RunCommand, RunConfig
    from densefit.serve.config import ServeJob

    group = _typer.main.get_command(app)
    declared = {"train": [TrainJob], "plan": [PlanJob], "mine": [MineJob], "index": [IndexJob],
                "reembed": [ReembedJob], "search": [SearchJob], "eval": [EvalJob], "export": [ExportJob], "serve": [ServeJob],
                "run": [RunCommand, RunConfig], "options": []}  # fmt: skip
    assert set(group.commands) == set(declared), "a command without its declaration here"
    return [(name, group.commands[name], classes) for name, classes in declared.items()]


def test_every_flag_of_every_command_comes_from_a_declaration():
    from densefit.cli.options import command_flags

    for name, command, classes in _commands():
        generated = {f.parameter for cls in classes for f in command_flags(cls)}
        params = {p.name for p in command.params if p.name != "help"}
        assert params == generated, (name, params ^ generated)
        for cls in classes:
            for flag in command_flags(cls):
                assert flag.opt.help, (name, flag.key)


def test_shared_options_mean_one_thing_everywhere():
    """--model, --device, --store, --output, --max-seq-length...: a flag that several commands
    take has one declaration there, so one help and one default."""
    from densefit.cli.options import command_flags

    seen: dict[str, tuple[str, object]] = {}
    for name, _, classes in _commands():
        for cls in classes:
            for flag in command_flags(cls):
                if flag.opt.positional:
                    continue
                for spelling in flag.declaration.split("/"):
                    first = seen.setdefault(spelling, (name, flag.opt))
                    assert first[1] is flag.opt, f"{spelling}: declared in {first[0]} and {name}"
    shared = ("--model", "--device", "--store", "--output", "--json", "--progress", "--split",
              "--max-seq-length", "--query-prompt", "--encode-batch-size", "--top-k")  # fmt: skip
    assert all(flag in seen for flag in shared)
    assert seen["--batch-size"][1].help.startswith("Rows per optimizer step")


def test_docs_options_covers_every_command_and_every_run_key():
    from densefit.cli.reference import options_reference
    from densefit.config.options import iter_rows
    from densefit.config.run import RunConfig

    text = options_reference(app)
    assert (REPO / "docs" / "options.md").read_text() == text, (
        "docs/options.md is stale: densefit options > docs/options.md"
    )
    for name, command, _ in _commands():
        if name == "options":
            continue
        assert f"## `densefit {name}`" in text
        for param in command.params:
            for spelling in param.opts:
                if spelling.startswith("--") and spelling != "--help":
                    assert f"`{spelling}`" in text, (name, spelling)
    for row in iter_rows(RunConfig, yaml=True):
        assert f"| `{row['key']}` |" in text


def test_choices_come_from_the_registries():
    from densefit.choices import GATHER_MODES, LOSSES, MEMORY_STRATEGIES
    from densefit.config.options import option_of
    from densefit.losses.contrastive import LOSS_FUNCTIONS

    assert option_of(TrainConfig, "loss").choice_list() == LOSSES == tuple(LOSS_FUNCTIONS)
    assert option_of(TrainConfig, "memory").choice_list() == (*MEMORY_STRATEGIES, "auto")
    assert option_of(TrainConfig, "gather").choice_list() == GATHER_MODES


def test_auto_device_and_shares_of_memory():
    from densefit.models import resolve_device

    assert TrainConfig(device="auto").device == "auto"  # a name: resolved when a model loads
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    for budget in ("0.8", 0.5, "80%", "8GiB", 2**30):
        assert TrainConfig(memory_budget=budget).memory_budget == budget
    for budget in ("0", "-1", "0%", "150%", "lots", "1.5"):
        with pytest.raises(ValueError, match="memory_budget must be a memory size"):
            TrainConfig(memory_budget=budget)


def test_load_reads_what_save_wrote(tmp_path):
    config = TrainConfig(batch_size=8, memory="cache", warmup_steps=3, amp="bf16")
    config.save(tmp_path / "densefit_config.json", steps=4, memory_plan={"strategy": "cache"},
                densefit_version="0.1.0")  # fmt: skip
    assert TrainConfig.load(tmp_path) == config
    assert TrainConfig.load(tmp_path / "densefit_config.json", batch_size=16).batch_size == 16
    with pytest.raises(ValueError, match="unknown training options: steps"):
        TrainConfig.from_dict({"steps": 4})


def test_options_command_prints_the_markdown_reference():
    from densefit.cli.reference import options_reference

    result = runner.invoke(app, ["options"])
    assert result.exit_code == 0 and result.stdout == options_reference(app)
    assert "| `--warmup` |  | >= 0 | Linear warm-up steps" in result.stdout
    assert "| `train.warmup_steps` | null | >= 0 |" in result.stdout


def test_device_presence_on_a_one_gpu_machine(monkeypatch):
    from densefit.errors import OptionError
    from densefit.models import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("auto") == "cuda" and resolve_device("cuda:0") == "cuda:0"
    with pytest.raises(OptionError, match=r"has 1 CUDA device\(s\): cuda:0 to cuda:0"):
        resolve_device("cuda:3")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(OptionError, match="MPS is not available"):
        resolve_device("mps")


def test_a_missing_extra_says_what_to_install(capsys):
    from densefit.cli.app import error_exit_code

    missing = ModuleNotFoundError("No module named 'faiss'", name="faiss")
    assert error_exit_code(missing) == 2
    assert capsys.readouterr().err == (
        "error: No module named 'faiss': pip install 'densefit[index]'\n"
    )
    assert error_exit_code(ModuleNotFoundError("No module named 'nope'", name="nope")) == 1
    assert capsys.readouterr().err.startswith("unexpected error: ModuleNotFoundError")


# ----------------------------------------------------------------------------- every bounded option
# One bad value for each option of each command that has a range, a choice list or a check,
# generated from the declarations the commands are built from (densefit/config/): a new
# bounded option gets its case without anyone adding it here. `densefit run` gets each of its
# flags and, through --set, each key of its configuration file.


def bad_values(opt, hint) -> list[tuple[str, str]]:
    """(a value just outside what ``opt`` allows, the words after the name in the error)."""
    integer = int in (hint, *typing.get_args(hint)) and float not in typing.get_args(hint)
    step = 1 if integer else 0.5
    out = []
    if opt.ge is not None:
        out.append((opt.ge - step, " must be"))
    if opt.gt is not None:
        out.append((opt.gt, " must be"))
    if opt.le is not None:
        out.append((opt.le + step, " must be"))
    if [c for c in opt.choice_list() if c is not None]:
        out.append(("bogus", " must be one of"))
    if opt.check is not None:
        out.append((CHECKED_BAD[opt.help], ""))
    return [(str(int(v) if integer and not isinstance(v, str) else v), words) for v, words in out]


def _checked_bad() -> dict[str, str]:
    """A bad value for each option with a check function, by its help (one declaration)."""
    from densefit.config.commands import EvalJob, ExportJob
    from densefit.config.evaluation import EvalConfig
    from densefit.config.mine import MineConfig
    from densefit.config.options import option_of
    from densefit.config.run import RunConfig

    by_field = {
        (TrainConfig, "learning_rate"): "0",
        (TrainConfig, "memory_budget"): "bogus",
        (TrainConfig, "device"): "gpu",
        (TrainConfig, "eval_metric"): "ndcg@ten",
        (TrainConfig, "matryoshka_dims"): "0",
        (TrainConfig, "matryoshka_weights"): "1,x",
        (TrainConfig, "lora_dropout"): "1",
        (EvalConfig, "metrics"): "ndcg@ten",
        (MineConfig, "range"): "100:10",
        (EvalJob, "dims"): "0",
        (ExportJob, "int8_recipes"): "bogus",
        (TrainConfig, "report_to"): "bogus",
        (RunConfig, "train_data"): "[]",
    }
    return {option_of(cls, name).help: value for (cls, name), value in by_field.items()}


CHECKED_BAD = _checked_bad()


def bounded_cases() -> list[tuple[str, list[str], str]]:
    """(command, extra arguments, a piece of the one error line) for every bounded option."""
    from densefit.cli.options import command_flags
    from densefit.config.options import field_types, iter_rows, option_of, sections_of
    from densefit.config.run import RunConfig

    cases = []
    for name, _, classes in _commands():
        if name == "options":
            continue
        for cls in classes:
            for flag in command_flags(cls):
                if flag.opt.positional:
                    continue
                for value, words in bad_values(flag.opt, field_types(flag.cls)[flag.name]):
                    cases.append((name, [flag.flag, value], flag.flag + words))
    holders = {f.name: sec.cls for f, sec in sections_of(RunConfig)}
    for row in iter_rows(RunConfig, yaml=True):
        section, _, key = row["key"].rpartition(".")
        cls = holders.get(section, RunConfig)
        for value, words in bad_values(option_of(cls, key), field_types(cls)[key]):
            cases.append(("run", ["--set", f"{row['key']}={value}"], row["key"] + words))
    return cases


def case_id(case) -> str:
    name, extra, _ = case
    return f"{name} {' '.join(extra)}"


@pytest.fixture(scope="module")
def store_ws(ws):
    """The workspace with a store of the BEIR corpus (search and serve need a real one)."""
    if not (ws / "store").exists():
        result = runner.invoke(app, command(ws, "index"))
        assert result.exit_code == 0, result.output
    return ws


@pytest.fixture
def no_server(monkeypatch):
    """A serve command that got through its checks must not start a server here."""
    uvicorn = pytest.importorskip("uvicorn")

    def refuse(self, *args, **kwargs):
        raise AssertionError("the server started: the bad option was accepted")

    monkeypatch.setattr(uvicorn.Server, "run", refuse)


@pytest.mark.parametrize("case", bounded_cases(), ids=case_id)
def test_every_bounded_option_refuses_a_bad_value(store_ws, no_server, case):
    name, extra, expected = case
    base = {
        "search": ["search", "cell", "--store", str(store_ws / "store")],
        "serve": ["serve", "--store", str(store_ws / "store")],
    }.get(name) or command(store_ws, name)
    args = base + extra
    result = runner.invoke(app, args)
    lines = result.stderr.splitlines()
    assert result.exit_code == 2, (args, result.output)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert expected in lines[0], lines[0]
    assert "Traceback" not in result.output


def test_the_generated_cases_cover_every_command():
    covered = {name for name, _, _ in bounded_cases()}
    assert covered >= {"train", "plan", "mine", "index", "search", "eval", "serve", "run"}
    assert len(bounded_cases()) > 150
