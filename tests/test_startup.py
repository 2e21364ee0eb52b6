"""The command line answers --help, --version and a bad option before any framework loads:
``import densefit`` and the CLI's parsing import no torch, transformers or
sentence-transformers (each command imports its job only when it runs)."""

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "sentence_transformers", "numpy")

# Run the CLI in a fresh interpreter, then list the heavy modules it imported.
CHILD = """
import json, sys
sys.argv = ["densefit", *json.loads(sys.argv[1])]
try:
    from densefit.cli.app import main
    main()
except SystemExit as exc:
    code = exc.code
else:
    code = 0
heavy = [m for m in HEAVY if m in sys.modules]
print(json.dumps({"code": code, "heavy": heavy}), file=sys.__stderr__)
""".replace("HEAVY", repr(list(HEAVY)))


def run_cli(args: list[str], tmp_path) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    return json.loads(done.stderr.strip().splitlines()[-1])


COMMANDS = ["train", "plan", "mine", "index", "search", "eval", "export", "run", "serve", "options"]


@pytest.mark.parametrize(
    "args",
    [["--help"], ["--version"]]
    + [[command, "--help"] for command in COMMANDS]
    + [
        ["train", "data.jsonl", "-o", "out", "--batch-size", "0"],  # a value out of range
        ["train", "data.jsonl", "-o", "out", "--no-such-option"],  # a usage error
        ["index", "corpus.jsonl", "--store", "s", "--encode-batch-size", "0"],
        ["eval", "--dataset", "d", "--queries", "q.jsonl"],  # options that do not go together
        ["serve", "--store", "s", "--max-k", "0"],
        ["export", "m", "--to", "tflite"],  # a choice that is not one
        ["index", "corpus.jsonl", "--store", "s", "--runtime", "tensorrt"],
        ["run", "--data", "d", "--set", "train.batch_size=0"],  # checked before any stage
    ],
    ids=lambda args: " ".join(args),
)
def test_no_framework_before_the_work_starts(args, tmp_path):
    (tmp_path / "d" / "qrels").mkdir(parents=True)
    found = run_cli(args, tmp_path)
    assert found["heavy"] == [], f"densefit {' '.join(args)} imported {found['heavy']}"
    assert found["code"] in (0, 2), found


def test_import_densefit_loads_no_framework():
    code = f"import sys, densefit; print([m for m in {list(HEAVY)!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def test_the_lazy_exports_resolve():
    import densefit

    assert densefit.Retriever.__name__ == "Retriever"
    assert set(densefit.__all__) <= set(dir(densefit))
