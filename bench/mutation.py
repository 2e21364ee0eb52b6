"""Mutation testing of the core modules with mutmut: how many deliberate bugs the fast tests
catch, per module, and the mutants that survive.

Each module is mutated alone, in a scratch copy of the repository (``mutmut run`` writes its
``mutants/`` folder there, never into the checkout), with only the fast tests that cover it
(:data:`MODULES`); mutmut then runs, for each mutant, the tests that reach the mutated
function. One worker, under ``nice -n 19``: the machine is shared, and this runs the tests
hundreds of times (a benchmark, not CI). Each mutant's tests run in a process forked from
mutmut's (one torch thread each, so the fork is safe on CPU).

Writes bench/results/mutation.json (per module: killed, survived, timeouts, score, the
command, the environment; every surviving mutant's diff) and bench/results/mutation.md;
modules not run this time keep their earlier results.

    nice -n 19 .venv/bin/python bench/mutation.py --module densefit/retrieval/index/filters.py
    nice -n 19 .venv/bin/python bench/mutation.py            # every module (hours)
    .venv/bin/python bench/mutation.py --list                 # the modules and their tests

Needs ``pip install 'densefit[mutation]'`` (mutmut).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _runner import command_line, environment, loadavg  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
TARGET = 0.80  # (killed + timeouts) / every mutant that ran or had no test, per module

# Left out of every run, through pytest's addopts in the scratch copy (so that mutmut's own
# test arguments stay plain files): the real-model tests, and the 100k-document filter test
# (a minute a run).
ADDOPTS = ("-m 'not slow' --deselect "
           "tests/test_filters.py::test_filter_matching_a_thousandth_of_100k_documents_returns_k_hits")  # fmt: skip
# Each core module and the fast tests that cover it (pytest arguments, from the repo root).
MODULES: dict[str, list[str]] = {
    "densefit/losses/contrastive.py": ["tests/test_contrastive.py", "tests/test_losses.py",
                                       "tests/test_matryoshka.py"],
    "densefit/losses/masking.py": ["tests/test_masking.py", "tests/test_losses.py"],
    "densefit/losses/matryoshka.py": ["tests/test_matryoshka.py"],
    "densefit/memory/strategies.py": ["tests/test_memory.py", "tests/test_dropout.py",
                                      "tests/test_train.py"],
    "densefit/memory/chunking.py": ["tests/test_chunking.py", "tests/test_memory.py"],
    "densefit/data/readers.py": ["tests/test_data.py", "tests/test_data_fuzz.py"],
    "densefit/data/rows.py": ["tests/test_data.py", "tests/test_data_fuzz.py"],
    "densefit/data/batching.py": ["tests/test_sampler.py", "tests/test_sources.py",
                                  "tests/test_train.py", "tests/test_masking.py"],
    "densefit/mine.py": ["tests/test_mine.py"],
    "densefit/retrieval/index/filters.py": ["tests/test_filters.py"],
    "densefit/retrieval/index/quantized.py": ["tests/test_vectors.py"],
    "densefit/training/checkpoint.py": ["tests/test_checkpoint.py"],
    "densefit/retrieval/fusion.py": ["tests/test_fusion.py", "tests/test_bm25.py",
                                     "tests/test_hybrid.py"],
    # test_serve.py reaches it too, at a minute a run: left out so that a run takes minutes
    "densefit/serve/batcher.py": ["tests/test_batcher.py", "tests/test_serve_tokens.py"],
    "densefit/data/sources.py": ["tests/test_sources.py", "tests/test_hf_datasets.py"],
    "densefit/retrieval/index/store.py": ["tests/test_index_store.py", "tests/test_faults.py",
                                          "tests/test_wrong_implementations.py"],
    "densefit/retrieval/index/documents.py": ["tests/test_index_store.py", "tests/test_faults.py",
                                              "tests/test_wrong_implementations.py"],
    "densefit/retrieval/index/swap.py": ["tests/test_swap.py", "tests/test_wrong_implementations.py"],
    "densefit/retrieval/export.py": ["tests/test_export_cli.py",
                                     "tests/test_wrong_implementations.py"],
    "densefit/retrieval/runtimes.py": ["tests/test_runtimes.py", "tests/test_export_cli.py"],
}  # fmt: skip
# Why a module has no score yet (bench/results/mutation.md says it beside the module).
NOT_RUN_YET = "not run yet: CPU time on a shared 2-core machine"
NOT_RUN = {
    "densefit/retrieval/index/store.py": "not run: about 1,500 mutants, each running store "
    "tests of about 5 minutes (tests/test_index_store.py) on a shared 2-core machine",
    "densefit/retrieval/index/documents.py": "not run: each of its mutants runs the store "
    "tests (about 5 minutes) on a shared 2-core machine",
    "densefit/retrieval/index/swap.py": "not run: its tests kill processes mid-swap (about "
    "90 s a run) for each mutant, on a shared 2-core machine",
    "densefit/retrieval/export.py": "not run: its tests export and check ONNX and OpenVINO "
    "files (minutes a run) for each mutant, on a shared 2-core machine",
    "densefit/retrieval/runtimes.py": "not run: its tests export and run ONNX and OpenVINO "
    "files (minutes a run) for each mutant, on a shared 2-core machine",
}
# A score measured on an earlier version of its module, and what changed since.
STALE: dict[str, str] = {}
# What the scratch copy needs besides the package and the tests (mutmut copies tests/).
COPY = ["densefit", "tests", "pyproject.toml", "examples"]
# Surviving mutants explained, per module: (a regular expression matched against the
# mutant's added line, why it survives). "equivalent": no test can tell it from the code;
# "message": it changes only the wording of an error (tests check the words that name the
# field and the fix, not every character).
EXPLAINED: dict[str, list[tuple[str, str]]] = {
    "densefit/data/batching.py": [
        (r'digest_size=5\)|int\.from_bytes\(digest, \)|"XX/XX"\.join|seed \* 1_000_003 - epoch|'
         r'seed \* 1000004|_seed_of\((config\.seed, (epoch|self\.index)|"XX(schedule|source)XX"|'
         r'"(SCHEDULE|SOURCE)"|None, config\.seed)',
         "equivalent: another seeded order, as reproducible in every process (the seed's label, "
         "digest or arithmetic changed, not what it depends on)"),
        (r"-\(-rows / micro\)",
         "equivalent: ceil(ceil(r / m) / a) equals ceil((r / m) / a) for whole r, m, a"),
        (r"budget\[0\] (= 1|\+= 1|-= 2)$|budget\[0\] (<= 0|< 1):",
         "equivalent until the work budget (the O(n) guard on duplicate-heavy data) runs out, "
         "which no test with a comparable output reaches"),
        (r"counts\.(subtract|update)\(None\)|counts\[h\] > 2|break  # two rows|"
         r"len\(recent\) >= _SWAP_BATCHES|if len\(batch\) != size:|dtype=None|"
         r"for s in active\], \)$",
         "not tested: a second swap into one batch, a text held twice in an earlier batch, the "
         "16th batch back, deferred rows left for the end, float32 temperature weights"),
        (r"if len\(batch\) <= size:",
         "equivalent: the retry and the fill loop do nothing to a full batch"),
        (r"forget\(recent\.popleft\(\)\[1\]\)|self\.pop\(None, None\)|self\.pop\(i, \)",
         "equivalent in the batches: the oldest batch's text keys stay cached (memory only), or "
         "are dropped as they are anyway"),
        (r'encode\("UTF-8", |digest_size=9\)|, \)\.digest\(\) for t in texts',
         "equivalent: the same codec, or another stable hash of the same texts"),
        (r"return \[\(1, len\(examples\)\)\]",
         "equivalent: a list is one source, whose start is never read"),
        (r"at = 1  # the micro-batch",
         "equivalent: a step's position is read back only by step_groups itself"),
        (r"min\(active, default=1\)", "equivalent: times no source is zero"),
        (r'source_sampling != "(XXproportionalXX|PROPORTIONAL)"',
         "equivalent: replaying the earlier epochs' schedules counts one pass of each source "
         "per epoch, what the shortcut for proportional sampling computes"),
    ],
    "densefit/data/sources.py": [
        (r"warn\(report\.summary\(\), (None, )?stacklevel=2\)",
         "equivalent: warnings.warn's category is UserWarning when none is given"),
        (r"stacklevel=3\)",
         "untestable under mutmut: its trampoline adds a frame, so the warning's line differs "
         "from the caller's with or without the mutant (tests/test_sources.py checks the "
         "caller's line outside it)"),
    ],
    "densefit/retrieval/index/filters.py": [
        (r'" (or|and) "\.join|operator = "(or|and)" if', "equivalent: SQL keywords are case-insensitive"),
        (r'"select julianday', "equivalent: SQL keywords are case-insensitive"),
        (r'connect\(":MEMORY:"\)',
         "equivalent in what it returns: a database file named :MEMORY: (left in the working "
         "folder) reads dates as the in-memory one does"),
        (r'open\(source, (encoding=(None|"UTF-8"))?\)',
         "equivalent here: 'UTF-8' is the same codec, and the default is the locale's, UTF-8 on "
         "this machine (on a cp1252 Windows it would misread a non-ASCII filter file)"),
        (r"PASS E\.G\.", "message"),
        (r"replace\(tzinfo=None\)\.timestamp",
         "killed since this run by test_date_seconds_are_utc_and_name_where_a_bad_date_came_from "
         "(a non-UTC timezone; put back by hand and seen failing)"),
        (r"\(len\(parts\) == 1\) and False",
         "equivalent: one condition in parentheses is the same SQL"),
        (r"\"'TEXT'\"|\"XX'text'XX\"",
         "equivalent: a shortcut for text columns; without it SQLite's typeof() check gives "
         "the same no-match"),
        (r"raise ValueError\(None\)|XX.*XX|_short\(None\)|type\(None\)\.__name__|"
         r"[A-Z]{4,} [A-Z]{4,}|\(a comparison needs|\(and, or, not\)|\biso dates\b|"
         r"ISO DATES|\(A COMPARISON|'XX, XX'\.join|^\s+None$",
         "message"),
        (r"json\.dumps\(strings, ",
         "equivalent: json_each() decodes the strings, escaped or not"),
        (r"if numbers or type_sql", "equivalent: adds an IN over an empty list, always false"),
        (r"where = None|, None\)+$|AND SPACES|len\(text\) < width|json\.dumps\(node, default=repr, "
         r"(\)|ensure_ascii=(None|True))", "message"),
        (r"json\.dumps\(node, (default=None, )?ensure_ascii=False\)",
         "killed since this run by test_a_filter_holding_what_json_cannot_write_is_still_a_one_line_error"),
    ],
    "densefit/losses/contrastive.py": [
        (r'float\("-INF"\)', "equivalent: float() reads infinity in any case"),
        (r"F\.normalize\((anchors|positives|neg), (dim=\+1)?\)|\.sum\(\+1, |shape\[\+1\] != d|"
         r'einsum\("BD,BKD->BK"',
         "equivalent: these tensors are 2-D (negatives flattened first), so axis 1 is axis -1; "
         "einsum's letters only have to agree"),
        (r"device=None|arange\((n|B), \)|arange\(start, stop, \)",
         "equivalent on the CPU the tests run on: the default device is the inputs'"),
        (r"chunk_size > q\.shape\[0\]",
         "equivalent: one chunk of every row computes the full matrix's value and gradients"),
        (r"needs_input_grad\[[01]\]\) or True",
         "equivalent: autograd drops a gradient computed for an input that needs none"),
        (r"torch\.empty\(1\)|dense = None|None if \(dense\) and False",
         "equivalent: the mask is then read from ctx.lazy_mask, which holds the same mask"),
        (r"grad_q\[sl\] = \(probs\.to\(k\.dtype\) @ k\)\.to\(None\)",
         "equivalent: assigning into grad_q casts to its dtype, q's"),
        (r"scores\.reshape\(B, -1\)\.to\(None\)",
         "equivalent: both sides are cast to float32 before the MSE"),
        (r"^\s+chunk_size=None,$|^REMOVED\s+chunk_size=chunk_size,$",
         "equivalent in value: chunking only bounds memory (the chunked loss equals the full "
         "matrix's, tests/test_losses.py)"),
        (r"0 <= start < stop <= B",
         "not a bug: an empty share of rows (rows=slice(k, k)) has no loss term, and refusing "
         "it serves as well as its NaN"),
        (r"zeros_like\(k, (dtype=None)?\)|grad_k = grad_k\.to\(None\)",
         "precision only: k's gradient summed in half precision, or handed back in float32 "
         "(autograd casts it), stays within the half-precision test's tolerance"),
        (r"new_zeros\(\(\), (dtype=None)?\)",
         "equivalent: the first block's float32 sum promotes the total to float32"),
    ],
    "densefit/serve/batcher.py": [
        (r"max_batch: int = 65|max_wait: float = 1\.002|workers: int = 2,",
         "a default only direct users meet: the server passes ServeConfig's values "
         "(serve/app.py); a test would restate the number"),
        (r"_announced = None|stopping = None|done = None",
         "equivalent: None is read only as false, as False is"),
        (r"_queue: asyncio\.Queue \| None = \"\"",
         "equivalent: start() makes the queue before anything reads it"),
        (r"^\s+None,$|^REMOVED\s+workers,$",
         "equivalent: the semaphore of `workers` slots bounds the batches running at once; "
         "a larger pool's extra threads stay idle"),
        (r"remaining < 0", "equivalent: wait_for with a timeout of 0 times out at once"),
        (r"zip\(batch, results, (strict=(False|None))?\)",
         "equivalent: run_batch returns one result per query; with another count no query "
         "of the batch is answered either way"),
        (r"shutdown\(wait=(None|False)\)",
         "equivalent: _run waited for every batch, so the pool's threads are idle"),
        (r"XX.*XX", "message"),
        (r"initializer=None|^REMOVED\s+initializer=_set_torch_threads,$|_running = 1$|"
         r"_running [+-]= [12]$|return batch, False|^\s+break$|^\s+return$|"
         r"add_done_callback\(None\)|asyncio\.wait\(None\)",
         "killed since this run by the tests added to tests/test_batcher.py after it (each "
         "mutant put back by hand and seen failing)"),
    ],
    "densefit/retrieval/fusion.py": [
        (r"np\.bincount\(inverse, weights=np\.concatenate\(contributions\), \)",
         "equivalent: inverse holds every index below len(keys), so bincount has that length"),
        (r"np\.arange\(1, len\(p\) \+ 1, (dtype=None)?\)",
         "equivalent: 1.0 divided by an integer array is float64 too"),
        (r"else \((1\.0, 0\.0|0\.0, 1\.0)\)",
         "equivalent: only an empty list takes that branch, and it has no score to normalise"),
        (r"np\.zeros\(0, (dtype=None)?\)$", "equivalent: NumPy's default dtype is float64"),
    ],
    "densefit/losses/matryoshka.py": [
        (r"dim=\+1|shape\[\+1\]", "equivalent: embeddings are (rows, d), so axis 1 is axis -1"),
        (r"raise ValueError\(None\)|^\s+None$|XX.*XX|--MATRYOSHKA", "message"),
    ],
}  # fmt: skip
# mutmut's exit codes (mutmut.stats.status_by_exit_code), as counted here.
KILLED = {1, 3}
SURVIVED = {0}
NO_TESTS = {5, 33}  # no selected test reaches the mutated function: not killed either
TIMEOUT = {24, -24, 36, 152, 255}


def mutmut_config(module: str, tests: list[str]) -> str:
    """The [tool.mutmut] section for mutating ``module`` alone with ``tests``."""
    quoted = lambda items: "[" + ", ".join(json.dumps(i) for i in items) + "]"  # noqa: E731
    return (
        "\n[tool.mutmut]\n"
        'source_paths = ["densefit"]\n'
        f"only_mutate = {quoted([module])}\n"
        f"pytest_add_cli_args_test_selection = {quoted(tests)}\n"
        'pytest_add_cli_args = ["-q"]\n'
        # fork: the isolation this script was checked with; one thread per process keeps
        # torch fork-safe on CPU
        'process_isolation = "fork"\n'
    )


def prepare(work: Path, module: str, tests: list[str]) -> None:
    """A scratch copy of the repository configured to mutate ``module``."""
    for name in COPY:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, work / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif source.exists():
            shutil.copy2(source, work / name)
    pyproject = (work / "pyproject.toml").read_text()
    pyproject = re.sub(r"\n\[tool\.mutmut\][^\[]*", "\n", pyproject)  # ours replaces any
    pyproject = pyproject.replace(
        "[tool.pytest.ini_options]\n",
        f"[tool.pytest.ini_options]\naddopts = {json.dumps(ADDOPTS)}\n",
    )
    (work / "pyproject.toml").write_text(pyproject + mutmut_config(module, tests))


def mutmut_env(work: Path) -> dict:
    """One thread per test process; children (the resume and serve tests' subprocesses)
    import the mutated package from mutants/, with the mutant chosen by mutmut's variable."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               DENSEFIT_ALLOCATOR="system")  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join([str(work / "mutants"), env.get("PYTHONPATH", "")])
    return env


def mutmut_binary() -> str:
    found = shutil.which("mutmut", path=str(Path(sys.executable).parent))
    if found is None:
        sys.exit("mutmut is not installed: pip install 'densefit[mutation]'")
    return found


def run_module(module: str, tests: list[str], *, keep: bool) -> dict:
    """Mutate ``module``, run its tests against every mutant; the counts and survivors."""
    work = Path(tempfile.mkdtemp(prefix="densefit-mutation-"))
    started, load_before = time.time(), loadavg()
    try:
        prepare(work, module, tests)
        env = mutmut_env(work)
        command = [mutmut_binary(), "run", "--max-children", "1"]
        print(f"{module}: mutmut run in {work} with {' '.join(tests)}", flush=True)
        meta = work / "mutants" / (module + ".meta")
        # Twice: here, mutmut 3.8's run that generates the mutants finds no test for any
        # mutant and stops (its stats see no trampoline hit: likely the package imported
        # before mutants/ held it); a second run, with mutants/ in place, tests them.
        for attempt in (1, 2):
            with open(work / f"mutmut-{attempt}.log", "w") as log_file:  # tail -f to follow
                proc = subprocess.run(command, cwd=work, env=env, stdout=log_file,
                                      stderr=log_file)  # fmt: skip
            log = (work / f"mutmut-{attempt}.log").read_text(errors="replace")[-4000:]
            if meta.exists() and any(
                code is not None
                for code in json.loads(meta.read_text())["exit_code_by_key"].values()
            ):
                break
        if not meta.exists():
            return {"module": module, "tests": tests, "status": "failed", "log": log}
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        survivors = []
        for name, code in sorted(codes.items()):
            if code in SURVIVED | NO_TESTS:
                shown = subprocess.run(
                    [mutmut_binary(), "show", name], cwd=work, env=env, capture_output=True,
                    text=True,
                )  # fmt: skip
                why = "survived" if code in SURVIVED else "no test reaches it"
                diff = shown.stdout.strip()
                survivors.append({"mutant": name, "status": why, "diff": diff,
                                  "explained": explain(module, diff)})  # fmt: skip
        counted = {
            "killed": sum(c in KILLED for c in codes.values()),
            "survived": sum(c in SURVIVED for c in codes.values()),
            "no_tests": sum(c in NO_TESTS for c in codes.values()),
            "timeout": sum(c in TIMEOUT for c in codes.values()),
        }
        other = len(codes) - sum(counted.values())  # no tests, not checked, suspicious...
        decided = sum(counted.values())
        return {
            "module": module,
            "tests": tests,
            "status": "ok" if proc.returncode == 0 else f"mutmut exit {proc.returncode}",
            "mutants": len(codes),
            **counted,
            "other": other,
            # a timeout counts as killed: the mutant made the tests hang or crawl
            "score": round((counted["killed"] + counted["timeout"]) / decided, 4)
            if decided
            else None,
            "survivors": survivors,
            "seconds": round(time.time() - started, 1),
            "loadavg_before": load_before,
            "loadavg_after": loadavg(),
            "log_tail": log[-2000:] if proc.returncode else "",
        }
    finally:
        if keep:
            print(f"kept {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)


def explain(module: str, diff: str) -> str:
    """Why a surviving mutant survives, from :data:`EXPLAINED` ("" when nobody said)."""
    added = [line[1:] for line in diff.splitlines() if line.startswith("+") and
             not line.startswith("+++")]  # fmt: skip
    if not added:  # a line deleted: its patterns read "REMOVED <the line>"
        added = [f"REMOVED {line[1:]}" for line in diff.splitlines()
                 if line.startswith("-") and not line.startswith("---")]  # fmt: skip
    for pattern, reason in EXPLAINED.get(module, []):
        if any(re.search(pattern, line) for line in added):
            return reason
    return ""


def write_results(runs: list[dict], argv: list[str]) -> None:
    """Merge ``runs`` into bench/results/mutation.json (by module) and write the table."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "mutation.json"
    old = json.loads(path.read_text()) if path.exists() else {"modules": {}}
    modules = old.get("modules", {})
    command = "nice -n 19 " + command_line("mutation.py", argv)
    for run in runs:
        modules[run["module"]] = {**run, "command": command, "environment": environment()}
    for name, run in modules.items():  # the explanations as EXPLAINED says now
        for survivor in run.get("survivors", []):
            survivor["explained"] = explain(name, survivor["diff"])
    payload = {"target": TARGET, "modules": dict(sorted(modules.items()))}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    lines = [
        "# Mutation testing (mutmut)",
        "",
        f"Mutants killed per module by its fast tests (target {TARGET:.0%}); a timeout counts",
        "as killed, a mutant no selected test reaches as not killed. Command and environment",
        "per module: `mutation.json`, with the diff of every mutant not killed.",
        "",
        "| module | tests | mutants | killed | timeout | survived | no test | score | "
        "survivors equivalent / message only |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, run in payload["modules"].items():
        if run.get("status") == "failed":
            lines.append(f"| `{name}` | {' '.join(run['tests'])} | failed | | | | | | |")
            continue
        score = "-" if run["score"] is None else f"{run['score']:.1%}"
        lines.append(
            f"| `{name}` | {' '.join(run['tests'])} | {run['mutants']} | {run['killed']} | "
            f"{run['timeout']} | {run['survived']} | {run['no_tests']} | {score} | "
            f"{sum(s['explained'].startswith('equivalent') for s in run['survivors'])} / "
            f"{sum(s['explained'] == 'message' for s in run['survivors'])} |"
        )
    stale = [m for m in STALE if m in payload["modules"]]
    if stale:
        lines += ["", "Scores of an earlier version:", ""]
        lines += [f"- `{m}`: {STALE[m]}" for m in stale]
    missing = [m for m in MODULES if m not in payload["modules"]]
    if missing:
        lines += ["", "Modules without a score yet:", ""]
        lines += [f"- `{m}` ({' '.join(MODULES[m])}): {NOT_RUN.get(m, NOT_RUN_YET)}"
                  for m in missing]  # fmt: skip
    for name, run in payload["modules"].items():
        if run.get("survivors"):
            lines += ["", f"## Survivors: `{name}`", ""]
            for survivor in run["survivors"]:
                why = survivor.get("explained") or "not explained yet"
                lines += [f"`{survivor['mutant']}` ({survivor['status']}; {why})", "",
                          "```diff", survivor["diff"], "```", ""]  # fmt: skip
    (RESULTS / "mutation.md").write_text("\n".join(lines).rstrip() + "\n")
    print(f"wrote {path} and {RESULTS / 'mutation.md'}", flush=True)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", action="append", choices=sorted(MODULES),
                        help="Module to mutate (repeatable); default: every one.")  # fmt: skip
    parser.add_argument("--list", action="store_true", help="Print the modules and exit.")
    parser.add_argument("--keep", action="store_true", help="Keep the scratch folders.")
    parser.add_argument("--report", action="store_true",
                        help="Rewrite mutation.md from mutation.json (explanations), run nothing.")  # fmt: skip
    args = parser.parse_args(argv)
    if args.list:
        for module, tests in MODULES.items():
            print(f"{module}: {' '.join(tests)}")
        return
    if args.report:
        write_results([], argv)
        return
    runs = []
    for module in args.module or list(MODULES):
        run = run_module(module, MODULES[module], keep=args.keep)
        score = run.get("score")
        shown = "failed" if score is None else f"{score:.1%}"
        print(f"{module}: {shown} ({run.get('killed')} killed, {run.get('survived')} "
              f"survived, {run.get('timeout')} timeouts)", flush=True)  # fmt: skip
        runs.append(run)
        write_results(runs, argv)  # after each module: an interrupted run keeps what it did


if __name__ == "__main__":
    main(sys.argv[1:])
