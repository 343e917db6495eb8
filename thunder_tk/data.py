"""Token streams for pretraining, with no downloads.

A stream maps a sample index to `seq_len + 1` tokens (inputs and shifted targets), deterministically, so a
run that resumes at sample i sees exactly what an uninterrupted run would have seen.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch


class SyntheticTokens:
    """Learnable synthetic text: each sample walks the vocabulary with a random start and stride, with 10% of
    positions replaced by noise. A model can learn it, so the loss falls, and nothing is downloaded."""

    VALIDATION_START = 1 << 40  # validation samples come from indices training never reaches

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

    @property
    def validation(self) -> "_Offset":
        return _Offset(self, self.VALIDATION_START)


class _Offset:
    """A stream's samples from `start` on."""

    def __init__(self, stream, start: int):
        self.stream, self.start = stream, start

    def sample(self, index: int) -> torch.Tensor:
        return self.stream.sample(self.start + index)


class TokenWindows:
    """Windows of seq_len + 1 tokens over one token sequence: sample i starts at i seq_len (modulo the windows)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len

    @property
    def samples_per_epoch(self) -> int:
        """Samples until the windows start over."""
        windows = self.tokens.numel() - self.seq_len - 1
        return -(-windows // self.seq_len)

    def sample(self, index: int) -> torch.Tensor:
        windows = self.tokens.numel() - self.seq_len - 1
        start = (index * self.seq_len) % windows
        return self.tokens[start : start + self.seq_len + 1]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")  # LitGPT's Tokenizer reads one of them


def has_tokenizer(folder: str | Path) -> bool:
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


class TextFiles(TokenWindows):
    """Local text files tokenized with a local LitGPT tokenizer directory, read as one stream of windows. Validation
    reads text training never does: `val_paths`' files, or else the stream's last `val_fraction` (at least one
    window's worth); with a fraction of 0, the training text itself."""

    def __init__(self, paths: list[str], tokenizer_dir: str, seq_len: int, val_fraction: float = 0.05,
                 val_paths: list[str] | None = None):
        from litgpt import Tokenizer

        missing = [p for p in [*paths, *(val_paths or [])] if not Path(p).exists()]
        if missing:
            raise FileNotFoundError(f"data.paths: {', '.join(missing)} not found")
        if not Path(tokenizer_dir).is_dir():
            raise FileNotFoundError(f"data.tokenizer_dir: {tokenizer_dir} is not a directory")
        if not has_tokenizer(tokenizer_dir):
            raise FileNotFoundError(f"data.tokenizer_dir: {tokenizer_dir} has no tokenizer.json or tokenizer.model "
                                    "(LitGPT's Tokenizer reads one of them)")
        tokenizer = Tokenizer(tokenizer_dir)

        def tokens_of(files):
            return torch.cat([tokenizer.encode(Path(p).read_text(), bos=True, eos=True) for p in files]).long()

        tokens = tokens_of(paths)
        self.vocab_size = tokenizer.vocab_size
        need = seq_len + 2  # one window and a token to spare
        if val_paths:
            held_out = tokens_of(val_paths)
            if held_out.numel() < need:
                raise ValueError(f"data.val_paths: {held_out.numel()} tokens, fewer than one sequence of {seq_len + 1}")
        elif val_fraction > 0:
            n_val = max(math.ceil(val_fraction * tokens.numel()), need)
            if tokens.numel() - n_val < need:
                raise ValueError(f"data.paths: {tokens.numel()} tokens, too few for a training and a validation "
                                 f"sequence of {seq_len + 1} each (data.val_fraction {val_fraction:g})")
            tokens, held_out = tokens[:-n_val], tokens[-n_val:]
        else:
            held_out = tokens
        if tokens.numel() < need:
            raise ValueError(f"data.paths: {tokens.numel()} tokens, fewer than one sequence of {seq_len + 1}")
        super().__init__(tokens, seq_len)
        self.validation = TokenWindows(held_out, seq_len)


def batch(stream, indices: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.stack([stream.sample(i) for i in indices])
    rows = rows.to(device, non_blocking=True)
    return rows[:, :-1], rows[:, 1:]
