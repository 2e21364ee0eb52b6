"""Fine-tune all-MiniLM-L6-v2 on the bundled SciFact training pairs; compare before and after.

    bash scripts/demo.sh            # sets up .venv, then runs this
    python examples/quickstart.py --batch-size 64 --epochs 1 --output runs/quickstart

Steps: evaluate the base model on SciFact test (nDCG@10, Recall@100 ...), train with
in-batch negatives (MNRL) and the memory planner (`memory="auto"`), evaluate the trained
model the same way, print both side by side, and write runs/quickstart/report.json.
On a 2-core CPU most of the time is the two evaluations: all-MiniLM-L6-v2 embeds the
5,183 abstracts at about 5 documents/s there (bench/results/reproduce_mteb.md), so a run
takes roughly 40 minutes; `--eval-max-seq-length 128` roughly halves that.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(HERE / "scifact"), help="BEIR folder (train + test qrels)")
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--output", default="runs/quickstart")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--max-seq-length", type=int, default=128, help="for training")
    parser.add_argument("--memory-budget", default="4GiB")
    parser.add_argument("--eval-max-seq-length", type=int, default=None,
                        help="truncate documents for both evaluations (default: the model's 256)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    from rich.console import Console

    from densefit import Retriever
    from densefit.evaluate import evaluate_beir, format_table

    console = Console()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    console.rule("1/3 base model on SciFact test")
    base = Retriever(args.model, max_seq_length=args.eval_max_seq_length)
    before = evaluate_beir(base.model, args.data, "test", show_progress=True, name="base")

    console.rule("2/3 fine-tune on SciFact train (MNRL, memory auto)")
    trained = Retriever(args.model, max_seq_length=args.max_seq_length)
    result = trained.train(
        args.data, batch_size=args.batch_size, n_epochs=args.epochs, learning_rate=args.lr,
        memory="auto", memory_budget=args.memory_budget, save_dir=out / "model",
    )
    plan = result.plan
    console.print(
        f"{result.steps} steps in {result.seconds:.0f}s; memory plan: {plan.get('strategy')} "
        f"(predicted peak {plan.get('predicted_peak_bytes', 0) / 2**30:.2f} GiB of "
        f"{args.memory_budget}); model saved to {out / 'model'}"
    )

    console.rule("3/3 fine-tuned model on SciFact test")
    trained.model.max_seq_length = base.model.max_seq_length  # evaluate at the same length
    after = evaluate_beir(trained.model, args.data, "test", show_progress=True, name="fine-tuned")

    console.print(format_table([before, after], title="SciFact test: before / after"))
    report = {
        "before": before.to_dict(), "after": after.to_dict(), "train": {
            "steps": result.steps, "final_loss": result.final_loss, "plan": plan,
            "seconds": round(result.seconds, 1), "batch_size": args.batch_size,
            "epochs": args.epochs, "lr": args.lr,
        },
        "total_seconds": round(time.perf_counter() - started, 1),
    }
    (out / "report.json").write_text(json.dumps(report, indent=2))
    console.print(f"report: {out / 'report.json'} ({report['total_seconds']:.0f}s in all)")


if __name__ == "__main__":
    main()
