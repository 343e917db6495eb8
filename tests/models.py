"""Small models shaped like the ones tk serves."""

import torch
import torch.nn.functional as F


class Block(torch.nn.Module):
    """A transformer block: fused qkv projection, causal attention, output projection, GELU MLP."""

    def __init__(self, d=64, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.proj = torch.nn.Linear(d, d)
        self.fc = torch.nn.Linear(d, 4 * d)
        self.out = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(x)))


class LlamaMLP(torch.nn.Module):
    """LitGPT's LLaMAMLP, proj(silu(fc_1(x)) * fc_2(x)); `bias` on fc_2 only, `proj_bias` on proj, `swap` writes the
    product the other way round, `act` another gate (GLU's sigmoid, GEGLU's gelu)."""

    def __init__(self, n=64, hidden=128, bias=False, swap=False, act=F.silu, proj_bias=False):
        super().__init__()
        self.act = act
        self.fc_1 = torch.nn.Linear(n, hidden, bias=False)
        self.fc_2 = torch.nn.Linear(n, hidden, bias=bias)
        self.proj = torch.nn.Linear(hidden, n, bias=proj_bias)
        self.swap = swap

    def forward(self, x):
        a, b = self.act(self.fc_1(x)), self.fc_2(x)
        return self.proj(b * a if self.swap else a * b)
