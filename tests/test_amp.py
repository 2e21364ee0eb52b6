"""Mixed precision through every memory strategy: bf16 autocast, and fp16 autocast with loss
scaling, give the fp32 loss and gradients within the tolerances below, and each strategy the
loss and gradients of plain at the same precision.

On this CPU; fp16 (CUDA only for users) runs here with the CPU's autocast and a CPU loss
scaler, the same code path as on a GPU. tests/test_cuda.py runs the same on CUDA.
"""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import pytest
import torch

import densefit.training.setup as training_setup
from densefit import TrainConfig, TrainingExample, train
from densefit.choices import MEMORY_STRATEGIES
from densefit.losses import mnrl
from densefit.memory import make_strategy
from densefit.memory.dropout import enable_invariant_dropout

QUERIES = [("what is the cell " * (i % 5 + 1)) + str(i) for i in range(12)]
DOCS = [("the protein gene cancer risk " * (i % 7 + 1)) + str(i) for i in range(12)]
NEGS = [("python function class " * (i % 3 + 1)) + str(i) for i in range(24)]
COLUMNS = [QUERIES, DOCS, NEGS]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Against fp32 (the loss's relative error; the gradient's relative L2 error): bf16 keeps 8
# bits of mantissa, fp16 11. Measured on this tiny model: bf16 1e-5 / 5e-4, fp16 3e-7 / 6e-5.
TO_FP32 = {"bf16": (1e-3, 5e-3), "fp16": (1e-4, 1e-3)}
# A strategy against plain at the same precision: the cache's embeddings pass through fp32
# before the loss, so its gradients round differently (measured: bf16 4e-4, fp16 5e-5).
TO_PLAIN = {"bf16": 2e-3, "fp16": 5e-4}
FP16_SCALE = 256.0  # small enough that the tiny model's fp16 gradients do not overflow


def loss_fn(emb):
    return mnrl(emb[0], emb[1], emb[2], symmetric=True)


def step(model, name: str, amp: str | None, chunk: int = 4, device: str = "cpu"):
    """One forward-backward of ``name`` at ``amp`` on ``device``: the loss, the (unscaled)
    gradients and the dtypes the encoder's matrix products ran in."""
    model = copy.deepcopy(model).to(device)
    model.train()
    enable_invariant_dropout(model)  # dropout on, the same masks whatever the chunks
    strategy = make_strategy(name, chunk)
    strategy.prepare(model)
    autocast = contextlib.nullcontext
    if amp is not None:
        autocast = lambda: torch.autocast(device, dtype=DTYPES[amp])  # noqa: E731
    scaler = torch.amp.GradScaler(device, init_scale=FP16_SCALE) if amp == "fp16" else None
    linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    seen = set()
    linear.register_forward_hook(lambda module, inputs, output: seen.add(output.dtype))
    torch.manual_seed(1)
    stats = strategy.forward_backward(model, COLUMNS, loss_fn, autocast=autocast, scaler=scaler)
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    if scaler is not None:
        grads = grads / scaler.get_scale()
    return stats.loss, grads.cpu(), seen


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def fp32(tiny_models):
    from densefit.models import load_model

    model = load_model(str(tiny_models / "tiny"))
    loss, grads, _ = step(model, "plain", None)
    return model, loss, grads


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
@pytest.mark.parametrize("name", MEMORY_STRATEGIES)
def test_every_strategy_at_half_precision_gives_the_fp32_step(fp32, name, amp):
    model, ref_loss, ref_grads = fp32
    _, plain_grads, _ = step(model, "plain", amp)
    loss, grads, seen = step(model, name, amp)
    assert seen == {DTYPES[amp]}  # every pass of the strategy ran under autocast
    assert torch.isfinite(grads).all()
    loss_tolerance, grad_tolerance = TO_FP32[amp]
    assert abs(loss - ref_loss) <= loss_tolerance * abs(ref_loss)
    assert relative(grads, ref_grads) <= grad_tolerance
    assert relative(grads, plain_grads) <= TO_PLAIN[amp]


ROWS = [
    TrainingExample(f"what is the cell {i} " * (i % 4 + 1), f"the protein gene {i} " * (i % 6 + 1))
    for i in range(64)
]


@pytest.mark.parametrize("memory", ["plain", "cache"])
def test_bf16_and_scaled_fp16_runs_converge_like_fp32(tiny_models, monkeypatch, memory):
    """30 steps each; the loss curves stay within 5% of fp32's at every step. fp16 runs with
    the loss scaler setup makes for CUDA (here on the CPU: densefit offers fp16 on CUDA only)."""
    from densefit.models import load_model

    monkeypatch.setattr(training_setup, "FP16_DEVICES", ("cuda", "cpu"))
    curves = {}
    for amp in (None, "bf16", "fp16"):
        model = load_model(str(tiny_models / "tiny"))
        config = TrainConfig(
            batch_size=16, max_steps=30, learning_rate=1e-3, amp=amp, memory=memory,
            chunk_size=4, show_progress=False, warmup_steps=0, epochs=10,
        )  # fmt: skip
        records = []
        result = train(model, ROWS, config, on_step=records.append)
        assert result.steps == 30 and np.isfinite(result.final_loss)
        curves[amp] = np.array(result.losses)
        if amp == "fp16":  # the scaler's search for its scale skips at most a few steps
            assert result.skipped_nonfinite <= 3
            assert all(r["skipped"] is False for r in records[3:])
    assert curves[None][-5:].mean() < 0.7 * curves[None][:5].mean()  # it did learn
    for amp in ("bf16", "fp16"):
        close = np.abs(curves[amp] - curves[None]) <= 0.05 * curves[None]
        assert close[3:].all(), (amp, curves[amp], curves[None])


def test_fp16_is_refused_where_it_does_not_run(tiny):
    with pytest.raises(ValueError, match="--amp fp16 needs a CUDA device; on CPU use --amp bf16"):
        train(tiny, ROWS[:8], TrainConfig(batch_size=4, max_steps=1, amp="fp16"))
