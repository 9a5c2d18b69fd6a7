"""TinyGPT: a small decoder-only transformer, byte-level, trained on the Python standard library.

The corpus is real text that needs no download: a fixed, sorted list of the standard library's own
source files (under `sysconfig.get_paths()["stdlib"]`), concatenated and capped in size, read the
same way on every rank. Bytes are the tokens (vocabulary 256), so no tokenizer is needed. The last
`held_out` fraction of the corpus is the held-out set.

Pre-norm blocks with causal attention through `F.scaled_dot_product_attention`; the output layer is
tied to the token embedding. `blocks()` exposes the layers as FSDP / activation-checkpointing units.
"""

from __future__ import annotations

import math
import sysconfig
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812 - the universal alias
from torch import nn
from torch.utils.data import Dataset

from training.task import TaskBase

__all__ = ["CORPUS_FILES", "Block", "TinyGPT", "TinyGPTTask", "load_corpus", "task"]

# Present in every CPython 3.10-3.13; a missing one is skipped, so the corpus is still deterministic
# for a given Python installation.
CORPUS_FILES = (
    "abc.py",
    "argparse.py",
    "bisect.py",
    "calendar.py",
    "collections/__init__.py",
    "contextlib.py",
    "copy.py",
    "dataclasses.py",
    "difflib.py",
    "enum.py",
    "fractions.py",
    "functools.py",
    "heapq.py",
    "inspect.py",
    "json/decoder.py",
    "json/encoder.py",
    "os.py",
    "random.py",
    "shutil.py",
    "statistics.py",
    "string.py",
    "textwrap.py",
    "typing.py",
)
VOCAB = 256


def load_corpus(max_bytes: int = 1_000_000) -> torch.Tensor:
    """The corpus as a uint8 tensor: the files of `CORPUS_FILES` in sorted order, capped at `max_bytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for name in sorted(CORPUS_FILES):
        path = root / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    corpus = b"".join(chunks)[:max_bytes]
    if len(corpus) < 10_000:
        raise RuntimeError(f"the standard library under {root} is missing; tinygpt needs its source files")
    return torch.frombuffer(bytearray(corpus), dtype=torch.uint8).clone()


class _Windows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows of `seq_len + 1` bytes: (input, next-byte targets)."""

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        self.data = data
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.seq_len
        chunk = self.data[start : start + self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class TinyGPT(nn.Module):
    """Decoder-only transformer with learned positions and a tied output layer."""

    def __init__(self, dim: int, layers: int, heads: int, seq_len: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.layers = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                # GPT-2's residual scaling keeps the residual stream's variance flat with depth
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.layers:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits


Batch = tuple[torch.Tensor, torch.Tensor]


class TinyGPTTask(TaskBase):
    """Next-byte prediction on the standard library's source.

    Args:
        dim: Model width (divisible by `heads`).
        layers: Transformer blocks.
        heads: Attention heads.
        seq_len: Context length (tokens per sample).
        dropout: Dropout in attention and MLP.
        max_bytes: Corpus size cap.
        held_out: Fraction of the corpus (its end) held out for evaluation.
    """

    def __init__(
        self,
        dim: int = 128,
        layers: int = 4,
        heads: int = 4,
        seq_len: int = 128,
        dropout: float = 0.0,
        max_bytes: int = 1_000_000,
        held_out: float = 0.05,
    ) -> None:
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
        self.dim, self.num_layers, self.heads, self.seq_len = dim, layers, heads, seq_len
        self.dropout, self.max_bytes, self.held_out = dropout, max_bytes, held_out

    @cached_property
    def _splits(self) -> tuple[_Windows, _Windows]:
        corpus = load_corpus(self.max_bytes)
        cut = int(len(corpus) * (1.0 - self.held_out))
        return _Windows(corpus[:cut], self.seq_len), _Windows(corpus[cut:], self.seq_len)

    def build_model(self) -> nn.Module:
        return TinyGPT(self.dim, self.num_layers, self.heads, self.seq_len, self.dropout)

    def train_dataset(self) -> Dataset[tuple[torch.Tensor, torch.Tensor]]:
        return self._splits[0]

    def eval_dataset(self) -> Dataset[tuple[torch.Tensor, torch.Tensor]]:
        return self._splits[1]

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))

    def evaluate(self, model: nn.Module, batch: Batch) -> Mapping[str, float | torch.Tensor]:
        x, y = batch
        logits = model(x).float()
        nll = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), reduction="sum")
        return {"nll": nll, "tokens": float(y.numel()), "count": float(y.shape[0])}

    def summarize(self, totals: Mapping[str, float]) -> dict[str, float]:
        tokens = totals.get("tokens", 0.0)
        if not tokens:
            return {}
        loss = totals["nll"] / tokens
        return {"loss": loss, "bits_per_byte": loss / math.log(2), "perplexity": math.exp(loss)}

    def tokens_per_sample(self) -> int:
        return self.seq_len

    def flops_per_sample(self) -> float:
        # 6 N per token for the matmuls (N: parameters in blocks + output layer), plus attention's
        # QK^T and AV: 12 * layers * dim * seq_len per token (PaLM appendix B).
        d, layer_count, t = self.dim, self.num_layers, self.seq_len
        n = layer_count * 12 * d * d + VOCAB * d
        return float(t * (6 * n + 12 * layer_count * d * t))

    def blocks(self, model: nn.Module) -> Sequence[nn.Module]:
        return list(model.layers) if isinstance(model, TinyGPT) else []


def task(
    dim: int = 128,
    layers: int = 4,
    heads: int = 4,
    seq_len: int = 128,
    dropout: float = 0.0,
    max_bytes: int = 1_000_000,
    held_out: float = 0.05,
) -> TinyGPTTask:
    """Entry point for `task.entrypoint: training.examples.tinygpt:task`."""
    return TinyGPTTask(dim, layers, heads, seq_len, dropout, max_bytes, held_out)
