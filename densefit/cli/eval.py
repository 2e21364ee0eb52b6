"""``densefit eval``: nDCG, MRR, Recall and MAP of one model, or two side by side.

Two ways in: ``--dataset BEIR_DIR [--model M] [--compare M2]`` indexes the corpus with each
model and scores its split; ``--store DIR --queries FILE --qrels FILE`` scores an existing
store. With ``--compare`` the table shows the compared model first, then ``--model``, and
the delta is ``--model`` minus ``--compare``. Rows skipped with ``--on-bad-row skip`` are
listed by ``file:line`` on stderr, in the table's caption and under ``skipped_rows`` in
``--json``, as ``train``, ``mine`` and ``index`` list theirs.

With ``--compare`` the two models are also lined up query by query
(:mod:`densefit.comparison`): the JSON gets the summary under ``per_query_summary`` (queries
better / same / worse on the first metric, rank changes, largest wins and losses, possible
missing labels), ``--output FILE`` writes the rows beside it as ``FILE``'s stem +
``.per_query.jsonl``, and the table's caption counts the queries better, same and worse.
"""

from __future__ import annotations

import json

import typer

from densefit.cli.common import err, out, progress_of, say, warn
from densefit.cli.options import options_command
from densefit.config.commands import EvalJob

__all__ = ["evaluate", "register"]


@options_command(EvalJob)
def evaluate(options: EvalJob) -> None:
    """nDCG@10, MRR@10, Recall@10/100, MAP@100 (pytrec_eval) on a BEIR split or a store.

    Examples:

      densefit eval --dataset datasets/scifact --model runs/tuned --compare all-MiniLM-L6-v2

      densefit eval --dataset datasets/scifact --model runs/tuned --distractors 1000 --max-seq-length 128

      densefit eval --store stores/scifact --queries q.jsonl --qrels qrels/test.tsv

      densefit eval --dataset datasets/scifact --model runs/mrl --dims 384,256,128,64
    """  # noqa: E501
    job = options.replace(show_progress=progress_of(options))
    from densefit.comparison import per_query_path  # the framework: only now
    from densefit.evaluate import compare_results, format_table  # the framework: only now
    from densefit.jobs import eval_job  # the framework: only when evaluating

    outcome = eval_job(job, say=say if job.show_progress else None)
    results = outcome.results
    if any(r.skipped_rows for r in results):
        first = results[0]
        err.print(
            f"[yellow]skipped rows:[/] {len(first.skipped_rows)}: "
            + ", ".join(origin for origin, _ in first.skipped_rows)
        )
    comparison = outcome.comparison
    payload = {
        "results": [r.to_dict(per_query=job.per_query) for r in results],
        "comparison": compare_results(*results) if len(results) == 2 else None,
        "notes": outcome.notes,
    }
    if comparison is not None:
        payload["per_query_summary"] = comparison.summary
    if job.output is not None:
        job.output.parent.mkdir(parents=True, exist_ok=True)
        if comparison is not None:
            rows = comparison.write_jsonl(per_query_path(job.output))
            payload["per_query_file"] = str(rows)
        job.output.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    for result in results:
        if result.missing_queries:
            warn(
                f"{len(result.missing_queries)} judged queries had no results or no text and "
                f"score 0 (e.g. {result.missing_queries[:3]})"
            )
    if job.json:
        typer.echo(json.dumps(payload, indent=2))
        return
    table = format_table(results, title=outcome.title)
    notes = list(outcome.notes)
    if comparison is not None:
        notes.append(_per_query_note(comparison.summary, payload.get("per_query_file")))
    if notes:
        table.caption = "; ".join([table.caption or "", *notes]).strip("; ")
    out.print(table)


def _per_query_note(summary: dict, path: str | None) -> str:
    """The caption's per-query line: better / same / worse, possible missing labels, file."""
    note = (
        f"per query ({summary['metric']}): {summary['better']} better, {summary['same']} same, "
        f"{summary['worse']} worse"
    )
    if summary["possible_missing_labels"]:
        note += f", {len(summary['possible_missing_labels'])} top hits to review (unjudged)"
    return note + (f"; rows in {path}" if path else "; --output FILE saves the rows")


def register(app: typer.Typer) -> None:
    """Add the ``eval`` command to ``app``."""
    app.command("eval")(evaluate)
