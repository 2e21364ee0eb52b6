"""The code that runs only on a CUDA device, run on the CPU with stand-ins for torch.cuda:
the planner's probe and budget, mixed precision's autocast and loss scaler, and the step's
out-of-memory redo. tests/test_cuda.py runs them for real on a GPU."""

from __future__ import annotations

import pytest
import torch

import densefit.training.setup as training_setup
from densefit import TrainConfig
from densefit.memory import planner


class FakeCudaMemory:
    """torch.cuda's memory counters: what is allocated is what the parameters and their
    gradients hold, plus ``activations`` while a probe's forward/backward runs."""

    def __init__(self, model, activations: int):
        self.model = model
        self.activations = activations
        self.baseline_had_grads = None

    def held(self) -> int:
        tensors = [p for p in self.model.parameters()]
        tensors += [p.grad for p in self.model.parameters() if p.grad is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def memory_allocated(self, device=None) -> int:
        if self.baseline_had_grads is None:
            params = [p for p in self.model.parameters() if p.requires_grad]
            self.baseline_had_grads = all(p.grad is not None for p in params)
        return self.held()

    def max_memory_allocated(self, device=None) -> int:
        return self.held() + self.activations


def test_the_cuda_probe_counts_activations_not_gradients(tiny, monkeypatch):
    """Backward would allocate the gradients: the probe makes them first, so the peak it
    measures above its baseline is the activations alone."""
    from densefit.memory.chunking import tokenize

    fake = FakeCudaMemory(tiny, activations=4 * 1000)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", fake.memory_allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", fake.max_memory_allocated)
    features = tokenize(tiny, ["cells divide"] * 4)
    params = list(tiny.parameters())
    used = planner._cuda_activation_bytes(tiny, features, params, torch.device("cuda"))
    assert fake.baseline_had_grads is True
    assert used == 4 * 1000  # not the gradients backward made
    assert all(p.grad is None for p in tiny.parameters())  # and gone again after


def test_the_default_budget_on_cuda_is_0_8_of_the_free_device_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * 2**30, 80 * 2**30))
    assert planner.resolve_budget(None, torch.device("cuda")) == int(0.8 * 10 * 2**30)
    assert planner.resolve_budget("50%", torch.device("cuda")) == 5 * 2**30
    assert planner.resolve_budget("3GiB", torch.device("cuda")) == 3 * 2**30


@pytest.mark.filterwarnings("ignore:CUDA is not available")  # torch: autocast off here
def test_mixed_precision_on_cuda_autocasts_there_and_scales_fp16(monkeypatch):
    made = []
    monkeypatch.setattr(
        torch.amp, "GradScaler", lambda device, **kw: made.append(device) or f"scaler:{device}"
    )
    cuda = torch.device("cuda")
    autocast, scaler = training_setup._mixed_precision(TrainConfig(amp="fp16"), cuda)
    assert scaler == "scaler:cuda" and made == ["cuda"]
    context = autocast()
    assert context.device == "cuda" and context.fast_dtype == torch.float16
    autocast, scaler = training_setup._mixed_precision(TrainConfig(amp="bf16"), cuda)
    assert scaler is None and autocast().fast_dtype == torch.bfloat16
    autocast, scaler = training_setup._mixed_precision(TrainConfig(), cuda)
    assert scaler is None and autocast().__class__.__name__ == "nullcontext"


def test_an_out_of_memory_error_frees_the_cuda_cache_before_the_redo(tiny, monkeypatch):
    from densefit.data.types import TrainingExample
    from densefit.training.setup import setup_run
    from densefit.training.step import train_step

    rows = [TrainingExample(f"query {i}", f"the cell protein {i}") for i in range(8)]
    run = setup_run(tiny, rows, TrainConfig(batch_size=8, memory="cache", chunk_size=8))
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    real = run.strategy.forward_backward
    calls = []

    def runs_out_once(*args, **kwargs):
        calls.append(run.plan.chunk_size)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(
        type(run.strategy), "forward_backward", lambda self, *a, **k: runs_out_once(*a, **k)
    )
    with pytest.warns(RuntimeWarning, match="out of memory"):
        record = train_step(run, [list(range(8))])
    assert calls == [8, 4] and emptied == [True] and record["oom_retries"] == 1


def test_chunks_on_a_gpu_default_to_gpu_sized_ones(monkeypatch):
    from densefit.memory.planner import plan_for_run
    from densefit.memory.strategies import DEFAULT_CACHE_CHUNK, GPU_DEFAULT_CHUNK

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for memory in ("plain", "checkpoint", "cache"):
        plan = plan_for_run(None, [], TrainConfig(memory=memory, device="cuda"))
        assert plan.chunk_size == GPU_DEFAULT_CHUNK
    assert plan_for_run(None, [], TrainConfig(memory="cache", device="cpu")).chunk_size == (
        DEFAULT_CACHE_CHUNK
    )
    assert (
        plan_for_run(None, [], TrainConfig(memory="cache", device="cuda", chunk_size=8)).chunk_size
        == 8
    )
