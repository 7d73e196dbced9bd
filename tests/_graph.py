"""CUDA-graph capture for the GPU tests: static inputs that replays refill, a warm-up on a side stream
(allocations and lazy set-up happen outside the capture), then the capture."""
import torch


def static_inputs(T: int, H: int, K: int):
    """(x BF16 zeros [T, H], topk_idx -1 [T, K], weights zeros [T, K]) on the current GPU."""
    return (torch.zeros(T, H, dtype=torch.bfloat16, device="cuda"),
            torch.full((T, K), -1, dtype=torch.int64, device="cuda"),
            torch.zeros(T, K, device="cuda"))


def capture(step, warmup=None):
    """Run warmup() (default: step()) on a side stream, then capture step(): -> (graph, step's outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        (warmup or step)()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out
