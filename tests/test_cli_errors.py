"""Every command, every bad option: exit status 2, one line on stderr, never a traceback.

In-process through typer's CliRunner (the app's own error handler runs there too), a
subprocess only for ``--debug``'s traceback and the unexpected-error line.
"""

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from densefit.cli import app
from densefit.config import TrainConfig, config_options, option_of, options_markdown
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
        "dense-mine": ["mine", str(ws / "beir"), "--corpus", str(ws / "beir"), "-o",
                       str(ws / "mined.jsonl"), "--no-progress", "--method", "dense", "-m", m],
        "index": ["index", str(ws / "beir"), "-m", m, "--store", str(ws / "store"),
                  "--no-progress"],
        "search": ["search", "cell", "--store", str(ws / "no-store")],
        "eval": ["eval", "--dataset", str(ws / "beir"), "-m", m, "--no-progress"],
        "run": ["run", "--data", str(ws / "beir"), "-m", m, "-o", str(ws / "run"),
                "--no-progress"],
        "serve": ["serve", "--store", str(ws / "no-store")],
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
    ("train", ["--loss-chunk-size", "0"], "--loss-chunk-size must be >= 1"),
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
    ("mine", ["--method", "tfidf"], "'--method'"),
    ("mine", ["--method", "dense"], "pass --model"),
    ("mine", ["--corpus", "{ws}/missing"], "missing"),
    ("dense-mine", ["--max-seq-length", "100000"], "limit of 128 tokens"),
    ("index", ["--max-seq-length", "100000"], "limit of 128 tokens"),
    ("index", ["--dtype", "int8"], "'--dtype'"),
    ("search", [], "no-store"),
    ("eval", ["--metrics", "ndcg@ten"], "ndcg@ten"),
    ("eval", ["--dataset", "{ws}/missing"], "missing"),
    ("run", ["--lr", "0"], "train.learning_rate must be auto or a number > 0"),
    ("run", ["--set", "train.warmup_steps=-5"], "train.warmup_steps must be >= 0, got -5"),
    ("run", ["--set", "train.device=gpu"], "train.device must be one of"),
    ("run", ["--set", "warmup"], "KEY=VALUE"),
    ("run", ["-o", "{ws}/a_file"], "not a folder"),
    ("run", ["--data", "{ws}/missing"], "missing"),
    ("serve", [], "no-store"),
    ("serve", ["--device", "gpu"], "--device must be one of"),
    ("serve", ["--create", "--store", "{ws}/new-store"], "--create needs --model"),
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


def test_every_option_is_declared_once_and_reaches_cli_yaml_and_docs():
    import inspect

    from densefit.cli.train import plan, train
    from densefit.pipeline import describe_keys

    train_params = inspect.signature(train).parameters
    docs = {key: doc for key, _, doc in describe_keys()}
    table = options_markdown()
    for f, opt in config_options():
        assert opt.help, f.name
        assert f"`train.{f.name}`" in table
        if f.name != "show_progress":
            assert docs[f"train.{f.name}"].startswith(opt.help)
        assert (f.name in train_params) == opt.cli, f.name
    assert "memory" not in inspect.signature(plan).parameters  # plan plans memory auto
    assert option_of("warmup_steps").flag == "--warmup"


def test_choices_come_from_the_registries():
    from densefit.choices import GATHER_MODES, LOSSES, MEMORY_STRATEGIES
    from densefit.losses.contrastive import LOSS_FUNCTIONS

    assert option_of("loss").choice_list() == LOSSES == tuple(LOSS_FUNCTIONS)
    assert option_of("memory").choice_list() == (*MEMORY_STRATEGIES, "auto")
    assert option_of("gather").choice_list() == GATHER_MODES


def test_auto_device_and_shares_of_memory():
    assert TrainConfig(device="auto").device == ("cuda" if torch.cuda.is_available() else "cpu")
    for budget in ("0.8", 0.5, "80%", "8GiB", 2**30):
        assert TrainConfig(memory_budget=budget).memory_budget == budget
    for budget in ("0", "-1", "0%", "150%", "lots"):
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


def test_options_command_prints_the_markdown_table():
    from densefit.pipeline.config import options_reference

    result = runner.invoke(app, ["options", "--markdown"])
    assert result.exit_code == 0 and result.stdout == options_reference()
    assert options_markdown() in result.stdout
    assert "| `train.warmup_steps` | `--warmup` | null | >= 0 |" in result.stdout


def test_device_presence_on_a_one_gpu_machine(monkeypatch):
    from densefit.config import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert check_device("auto") == "cuda" and check_device("cuda:0") == "cuda:0"
    with pytest.raises(ValueError, match=r"has 1 CUDA device\(s\): cuda:0 to cuda:0"):
        check_device("cuda:3")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(ValueError, match="MPS is not available"):
        check_device("mps")


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
# One bad value for each bounded option of each command, and one for each option with a
# choice list or a check. TrainConfig's options are generated from their declarations
# (config_options(): ge, gt, choices, check); the other commands' bounded options come from
# OTHER_BOUNDS until they are declared the same way: then generate them from those
# declarations here (declared_cases) and drop the table.
# test_every_number_option_has_a_bad_value_case fails when a command gains a number option
# that neither covers.


@dataclass(frozen=True)
class Bound:
    """The allowed range of a number option: ``ge``/``gt`` below, ``le``/``lt`` above."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    integer: bool = True
    named: str | None = None  # what the error calls it, when not the flag (a run key)

    def bad_values(self) -> list:
        """Just outside each side of the range."""
        step = 1 if self.integer else 0.5
        values = []
        if self.ge is not None:
            values.append(self.ge - step)
        if self.gt is not None:
            values.append(self.gt)
        if self.le is not None:
            values.append(self.le + step)
        if self.lt is not None:
            values.append(self.lt)
        return [int(v) if self.integer else v for v in values]


# A bad value for each TrainConfig option with a check function (its domain is in the code).
CHECKED_BAD = {
    "learning_rate": "0",
    "memory_budget": "bogus",
    "device": "gpu",
    "eval_metric": "ndcg@ten",
    "matryoshka_dims": "0",
    "matryoshka_weights": "1,x",
    "lora_dropout": "1",
}

# The bounded number options of the other commands (their flag, their range), by command.
OTHER_BOUNDS: dict[str, dict[str, Bound]] = {
    "mine": {"--num-negatives": Bound(ge=1), "--relative-margin": Bound(ge=0, lt=1, integer=False),
             "--query-block": Bound(ge=1), "--batch-size": Bound(ge=1)},
    "dense-mine": {"--max-seq-length": Bound(ge=1), "--batch-size": Bound(ge=1)},
    "index": {"--batch-size": Bound(ge=1), "--commit-every": Bound(ge=1),
              "--max-seq-length": Bound(ge=1), "--lock-timeout": Bound(ge=0, integer=False),
              "--dim": Bound(ge=1)},
    "store-search": {"--top-k": Bound(ge=1), "--width": Bound(ge=1), "--dim": Bound(ge=1)},
    "eval": {"--top-k": Bound(ge=1), "--batch-size": Bound(ge=1)},
    "run": {"--eval-max-seq-length": Bound(ge=1, named="eval.max_seq_length"),
            "--distractors": Bound(ge=-1, named="eval.distractors")},  # -1: the full corpus
    "store-serve": {"--port": Bound(ge=0, le=65535), "--max-k": Bound(ge=1),
                    "--max-queries": Bound(ge=1), "--max-documents": Bound(ge=1),
                    "--max-body-bytes": Bound(ge=1), "--max-batch": Bound(ge=1),
                    "--query-workers": Bound(ge=1), "--threads-per-worker": Bound(ge=0),
                    "--max-wait-ms": Bound(ge=0, integer=False)},
    "train": {"--nproc": Bound(ge=1)},
}  # fmt: skip
# `densefit run`'s own keys with a range (--set KEY=VALUE), by key.
RUN_KEY_BOUNDS = {
    "threads": Bound(ge=1),
    "mine.num_negatives": Bound(ge=1),
    "mine.relative_margin": Bound(ge=0, lt=1, integer=False),
    "mine.batch_size": Bound(ge=1),
    "mine.max_seq_length": Bound(ge=1),
    "eval.max_seq_length": Bound(ge=1),
    "eval.batch_size": Bound(ge=1),
    "eval.distractors": Bound(ge=0),
}
# Number options with no range: any value is meaningful.
UNBOUNDED = {("mine", "--seed")}


def declared_cases() -> list[tuple[str, list[str], str]]:
    """(command, extra arguments, a piece of the error line) for every TrainConfig option
    with a range, a choice list or a check, in every command that takes it."""
    from densefit.config import field_types, flag_of

    cases = []
    for f, opt in config_options():
        hint = field_types()[f.name]
        integer = int in (hint, *getattr(hint, "__args__", ()))
        bad = []
        if opt.ge is not None or opt.gt is not None:
            bound = Bound(ge=opt.ge, gt=opt.gt, integer=integer)
            bad += [(v, " must be") for v in bound.bad_values()]
        if opt.choice_list():
            bad.append(("bogus", " must be one of"))
        if opt.check is not None:  # the check's own words follow the name
            bad.append((CHECKED_BAD[f.name], ""))
        flag = flag_of(f.name)
        for value, words in bad:
            if opt.cli:
                cases.append(("train", [flag, str(value)], flag + words))
            if opt.cli and opt.plan and f.name != "device":  # plan: a device it can plan for
                cases.append(("plan", [flag, str(value)], flag + words))
            if f.name != "show_progress":  # not a train key: the top-level `progress`
                key = f"train.{f.name}"
                cases.append(("run", ["--set", f"{key}={value}"], key + words))
    return cases


def table_cases() -> list[tuple[str, list[str], str]]:
    """The same for OTHER_BOUNDS and RUN_KEY_BOUNDS."""
    cases = []
    for name, bounds in OTHER_BOUNDS.items():
        for flag, bound in bounds.items():
            cases += [(name, [flag, str(v)], bound.named or flag) for v in bound.bad_values()]
    for key, bound in RUN_KEY_BOUNDS.items():
        cases += [("run", ["--set", f"{key}={v}"], key) for v in bound.bad_values()]
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


@pytest.mark.parametrize("case", declared_cases() + table_cases(), ids=case_id)
def test_every_bounded_option_refuses_a_bad_value(store_ws, no_server, case):
    name, extra, expected = case
    base = {
        "store-search": ["search", "cell", "--store", str(store_ws / "store")],
        "store-serve": ["serve", "--store", str(store_ws / "store")],
    }.get(name) or command(store_ws, name)
    args = base + extra
    result = runner.invoke(app, args)
    lines = result.stderr.splitlines()
    assert result.exit_code == 2, (args, result.output)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    # named by its flag, or by the argument name of the library function that checks it
    argument = expected.lstrip("-").replace("-", "_") + " "
    assert expected in lines[0] or argument in lines[0], lines[0]
    assert "Traceback" not in result.output


def test_every_number_option_has_a_bad_value_case():
    """Each int or float option of each command is generated from TrainConfig, in the
    tables above, or known to take any value: a new one without a case fails here."""
    import inspect
    import typing

    import typer

    from densefit.config import flag_of

    declared = {flag_of(f.name) for f, opt in config_options() if opt.cli}
    run_flags = {"--batch-size", "--epochs", "--max-steps", "--max-seq-length"}  # train.* keys
    covered = {(n.removeprefix("store-").removeprefix("dense-"), flag)
               for n, bounds in OTHER_BOUNDS.items() for flag in bounds} | UNBOUNDED  # fmt: skip
    missing = []
    for info in app.registered_commands:
        name = info.name or info.callback.__name__
        for param in inspect.signature(info.callback, eval_str=True).parameters.values():
            option = param.default
            types = set(typing.get_args(param.annotation)) | {param.annotation}
            if not isinstance(option, typer.models.OptionInfo) or not types & {int, float}:
                continue
            flag = next((d for d in option.param_decls if d.startswith("--")), None)
            flag = flag or "--" + param.name.replace("_", "-")
            if name in ("train", "plan") and flag in declared:
                continue
            if name == "run" and flag in run_flags:
                continue
            if (name, flag) not in covered:
                missing.append(f"{name} {flag}")
    assert not missing, f"add a bad-value case (OTHER_BOUNDS) or UNBOUNDED: {missing}"
