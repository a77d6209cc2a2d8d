"""The one CUDA check of the test suite (GPU tests skip, saying why, where no CUDA device is present), and the
CUDA-graph replay and planned-call checks GPU tests share."""

import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (run on the device machine)")
hopper = pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability()[0] != 9, reason="needs an sm_90 GPU")


def assert_graph_replays_follow_eager(call, static: list, fresh: list) -> None:
    """``call(*static)`` captured in a CUDA graph after eager calls (one on a side stream, as a capture's warm-up):
    its replay equals the eager result; with ``fresh``'s values copied into ``static``, a replay equals an eager
    ``call(*fresh)``, which differs from the first, and so does a replay after that eager call. Bit for bit."""
    before = call(*static)
    assert torch.equal(call(*static), before)  # a shape's second eager call (launch plans) gives the same bits
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call(*static)
    graph.replay()
    assert torch.equal(captured, before)
    for t, new in zip(static, fresh):
        t.copy_(new)
    graph.replay()
    eager = call(*fresh)
    assert torch.equal(captured, eager) and not torch.equal(eager, before)
    graph.replay()  # after an eager call on the same stream
    assert torch.equal(captured, eager)


def assert_planned_calls_follow_the_whole_path(layer, inputs: list, module, monkeypatch) -> None:
    """A quantized linear ``layer``'s planned calls (``dispatch.LinearPlans``) on ``inputs`` (one signature, new
    contents each) give bit for bit what its whole path gives each of them (its plans cleared before each), and
    never reach ``module.run_op`` (the dispatch the plan skips)."""
    with torch.no_grad():
        whole = []
        for x in inputs:
            layer.plans.clear()
            whole.append(layer(x))
        assert len(layer.plans.entries) == 1

        def dispatch(*args, **kwargs):
            raise AssertionError("a planned call went through the dispatch")

        monkeypatch.setattr(module, "run_op", dispatch)
        planned = [layer(x) for x in inputs]
    assert all(torch.equal(a, b) for a, b in zip(planned, whole))
