"""Token streams for pretraining, with no downloads.

A stream maps a sample index to `seq_len + 1` tokens (inputs and shifted targets), deterministically, so a
run that resumes at sample i sees exactly what an uninterrupted run would have seen.
"""

from __future__ import annotations

from pathlib import Path

import torch


class SyntheticTokens:
    """Learnable synthetic text: each sample walks the vocabulary with a random start and stride, with 10% of
    positions replaced by noise. A model can learn it, so the loss falls, and nothing is downloaded."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        if vocab_size < 2:
            raise ValueError("vocab_size must be at least 2")
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def sample(self, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = torch.randint(self.vocab_size, (1,), generator=g)
        stride = torch.randint(1, min(self.vocab_size, 17), (1,), generator=g)
        tokens = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab_size
        noise = torch.rand(self.seq_len + 1, generator=g) < 0.1
        return torch.where(noise, torch.randint(self.vocab_size, (self.seq_len + 1,), generator=g), tokens)


class TextFiles:
    """Local text files tokenized with a local LitGPT tokenizer directory, read as one stream of windows."""

    def __init__(self, paths: list[str], tokenizer_dir: str, seq_len: int):
        from litgpt import Tokenizer

        missing = [p for p in paths if not Path(p).exists()]
        if missing:
            raise FileNotFoundError(f"data.paths: {', '.join(missing)} not found")
        if not Path(tokenizer_dir).is_dir():
            raise FileNotFoundError(f"data.tokenizer_dir: {tokenizer_dir} is not a directory")
        tokenizer = Tokenizer(tokenizer_dir)
        ids = [tokenizer.encode(Path(p).read_text(), bos=True, eos=True) for p in paths]
        self.tokens = torch.cat(ids).long()
        self.seq_len = seq_len
        self.vocab_size = tokenizer.vocab_size
        if self.tokens.numel() < seq_len + 2:
            raise ValueError(f"data.paths: {self.tokens.numel()} tokens, fewer than one sequence of {seq_len + 1}")

    @property
    def samples_per_epoch(self) -> int:
        """Samples until the windows start over (sample i starts at i seq_len, modulo the windows)."""
        windows = self.tokens.numel() - self.seq_len - 1
        return -(-windows // self.seq_len)

    def sample(self, index: int) -> torch.Tensor:
        windows = self.tokens.numel() - self.seq_len - 1
        start = (index * self.seq_len) % windows
        return self.tokens[start : start + self.seq_len + 1]


def batch(stream, indices: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.stack([stream.sample(i) for i in indices])
    rows = rows.to(device, non_blocking=True)
    return rows[:, :-1], rows[:, 1:]
