"""One measuring child of `bandpo-lut bench` (`python -m bandpo_lut.cli.bench.child WORKLOAD ARGS THREADS`, started
by `measure.run_child`): a fresh process per measurement, so that no other row's memory or warm-up is counted.
Prints one JSON line:

  loss [kind, batch, tokens]              the peak extra memory (MB) of one forward+backward of the fused
                                          (`policy_loss`) or the eager PPO loss (CPU), after a small warm-up
  fused_linear [kind, tokens, hidden,     [peak extra bytes, median seconds] of the unfused or the fused-linear
                vocab, train, repeats,    loss or Liger's (kind "liger"), hidden and head in `dtype`: one warm-up
                chunk, device, dtype]     step, one measured step for memory, then `repeats` timed steps
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from bandpo_lut.cli.bench.measure import peak_extra_bytes


def loss_memory(kind: str, batch: int, tokens: int) -> float:
    from bandpo_lut.cli.bench.command import _loss_batch, _loss_step

    cpu = torch.device("cpu")
    b = _loss_batch(batch, tokens, cpu)
    _loss_step(kind, _loss_batch(2, 64, cpu))
    return peak_extra_bytes(lambda: _loss_step(kind, b), cpu) / 2 ** 20


def fused_linear(kind, tokens, hidden, vocab, train, repeats, chunk, dev, dtype="float32") -> list:
    from bandpo_lut.cli.bench.fused_linear import liger_inputs, liger_loss, make_inputs, step

    device = torch.device(dev)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    x = make_inputs(tokens, hidden, vocab, device, train, dtype=dtype)
    liger = None
    if kind == "liger":
        liger, x = liger_loss(), liger_inputs(x)
    step(kind, x, chunk, liger)     # warm-up (also allocates the gradients; Liger compiles its loss here)
    x[0].grad = x[1].grad = None
    peak = peak_extra_bytes(lambda: step(kind, x, chunk, liger), device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step(kind, x, chunk, liger)
        sync()
        times.append(time.perf_counter() - t0)
    return [peak, statistics.median(times)]


WORKLOADS = {"loss": loss_memory, "fused_linear": fused_linear}


def main(argv: list[str]) -> None:
    workload, args, threads = argv[0], json.loads(argv[1]), int(argv[2])
    torch.set_num_threads(threads)
    print(json.dumps(WORKLOADS[workload](*args)))


if __name__ == "__main__":
    main(sys.argv[1:])
