"""What the fastattn.torch GPU tests share (gpu_helpers.py stays free of PyTorch)."""

import torch

import fastattn.torch


class Block(torch.nn.Module):
    """A small attention block: qkv projection, fastattn.torch.attention (causal), output
    projection; what torch.compile tests trace."""

    def __init__(self, dim=256, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        return self.out(fastattn.torch.attention(q, k, v, causal=True).reshape(b, s, d))
