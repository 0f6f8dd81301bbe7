"""The dag-paths policy: a small GPT in plain PyTorch (pre-norm blocks, causal self-attention, learned positions),
trained from scratch. Input: start, target, then the answer's nodes; the output at position k (k >= 1) is a
distribution over the `width` nodes of the answer's next layer (an answer always names one node per layer, so the
answer space is exactly the graph's width^(layers-2) node sequences)."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(B, T, D))
        return x + self.mlp(self.ln2(x))


class PathGPT(nn.Module):
    """Tokens are the graph's nodes (layer * width + index); logits are over the next layer's `width` nodes."""

    def __init__(self, layers: int, width: int, dim: int = 64, depth: int = 2, heads: int = 4):
        super().__init__()
        self.layers, self.width = layers, width
        self.tok = nn.Embedding(layers * width, dim)
        self.pos = nn.Embedding(layers - 1, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, width)

    def forward(self, prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
        """Log-probabilities (B, K, width) of each answer position's node, given the prompt (B, 2) and the answer's
        first K-1 nodes (B, >= K-1); position k conditions on answers[:, :k]."""
        K = answers.shape[1]
        W = self.width
        seq = torch.cat([prompts[:, :1], prompts[:, 1:] + (self.layers - 1) * W,
                         answers[:, :K - 1] + W * torch.arange(1, K, device=answers.device)], dim=1)
        x = self.tok(seq) + self.pos.weight[: seq.shape[1]]
        for block in self.blocks:
            x = block(x)
        return torch.log_softmax(self.head(self.ln(x))[:, 1:], dim=-1)

    def token_log_probs(self, prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
        """log pi(answer token k | prompt, answer[:k]) for each answer: (B, K), differentiable."""
        return torch.gather(self.forward(prompts, answers), 2, answers[..., None])[..., 0]


def all_answer_log_probs(model: PathGPT, prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """log pi(answer | prompt) for every prompt and every answer, (P, A), exactly, in one batched forward: one
    sequence per prompt and answer prefix (the last node is scored for all `width` choices at once). `answers` must
    be the lexicographic enumeration of graph.make_graph."""
    P, A, W = prompts.shape[0], answers.shape[0], model.width
    prefixes = answers[::W]                              # (A / W, K): every prefix, last node 0
    batch_p = prompts.repeat_interleave(prefixes.shape[0], 0)
    batch_a = prefixes.repeat(P, 1)
    logp = model(batch_p, batch_a)                       # (P * A/W, K, W)
    K = answers.shape[1]
    head = torch.gather(logp[:, :K - 1], 2, batch_a[:, :K - 1, None])[..., 0].sum(1)   # all but the last node
    return (head[:, None] + logp[:, K - 1]).reshape(P, A)
