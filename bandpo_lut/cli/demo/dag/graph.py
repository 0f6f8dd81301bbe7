"""The dag-paths task: one random layered graph per seed, prompts (start, target) and every answer enumerated.

Nodes sit in `layers` layers of `width` nodes; edges join consecutive layers only, each present with probability
`edge_prob` (then every node gets at least one edge out and one in, so no node is a dead end). A prompt is a node of
the first layer and a node of the last; an answer names one node in each layer between; it is right iff consecutive
nodes are joined. Every answer is enumerable (width^(layers-2) of them), so a model's probability of each is exact.
Only prompts with at least two right answers are used. Each prompt has one canonical right answer (drawn at random),
the one the warm-up data favours."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GraphConfig:
    layers: int = 5
    width: int = 6
    edge_prob: float = 0.4


@dataclass
class Graph:
    adj: torch.Tensor        # (layers-1, width, width) bool: adj[l, i, j] = edge from node i of layer l to j of l+1
    prompts: torch.Tensor    # (P, 2) long: start (layer 0) and target (last layer), as node indices 0..width-1
    answers: torch.Tensor    # (A, layers-2) long: every answer, lexicographic; entry k is a node of layer k+1
    valid: torch.Tensor      # (P, A) bool: answer a is a path from the prompt's start to its target
    canonical: torch.Tensor  # (P,) long: index into answers of each prompt's canonical right answer


def make_graph(seed: int, cfg: GraphConfig) -> Graph:
    """The graph, prompts and answer sets of `seed`, from `seed` alone."""
    if cfg.layers < 3 or cfg.width < 2:
        raise ValueError(f"dag-paths needs at least 3 layers of 2 nodes, got {cfg.layers} x {cfg.width}")
    g = torch.Generator().manual_seed(seed)
    L, W = cfg.layers, cfg.width
    adj = torch.rand(L - 1, W, W, generator=g) < cfg.edge_prob
    for layer in adj:            # at least one edge out of every node and one into every node
        for i in torch.nonzero(~layer.any(1)).flatten().tolist():
            layer[i, int(torch.randint(W, (1,), generator=g))] = True
        for j in torch.nonzero(~layer.any(0)).flatten().tolist():
            layer[int(torch.randint(W, (1,), generator=g)), j] = True
    answers = torch.cartesian_prod(*[torch.arange(W)] * (L - 2)).reshape(-1, L - 2)
    inner = torch.ones(answers.shape[0], dtype=torch.bool)
    for k in range(L - 3):       # edges between the answer's own nodes
        inner &= adj[k + 1, answers[:, k], answers[:, k + 1]]
    # (start, target, answer): the first edge from the start, the last into the target
    valid = adj[0][:, answers[:, 0]][:, None, :] & adj[L - 2][answers[:, -1], :].T[None, :, :] & inner
    starts, targets = torch.meshgrid(torch.arange(W), torch.arange(W), indexing="ij")
    keep = valid.sum(-1) >= 2
    prompts = torch.stack([starts[keep], targets[keep]], dim=1)
    valid = valid[keep]
    if prompts.shape[0] == 0:
        raise ValueError(f"seed {seed}: no (start, target) pair has two paths; raise edge_prob")
    # canonical: a uniformly drawn right answer per prompt
    u = torch.rand(valid.shape, generator=g).masked_fill(~valid, -1.0)
    return Graph(adj=adj, prompts=prompts, answers=answers, valid=valid, canonical=u.argmax(1))
