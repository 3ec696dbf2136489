"""BERT encoder with mean pooling: sentence embeddings (e.g. all-MiniLM-L6-v2).

Module names follow HF's BertModel, so its checkpoint loads as it is; the
pooling and normalisation are those of a sentence-transformers pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import nn

from .checkpoint import Checkpoint, CheckpointError


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position: int
    type_vocab_size: int
    layer_norm_eps: float

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint) -> BertConfig:
        c = ckpt.config
        if c.get("hidden_act", "gelu") != "gelu":
            raise CheckpointError(f"{ckpt.path / 'config.json'}: hidden_act must be 'gelu'")
        try:
            return cls(
                vocab_size=int(c["vocab_size"]),
                hidden_size=int(c["hidden_size"]),
                num_layers=int(c["num_hidden_layers"]),
                num_heads=int(c["num_attention_heads"]),
                intermediate_size=int(c["intermediate_size"]),
                max_position=int(c.get("max_position_embeddings", 512)),
                type_vocab_size=int(c.get("type_vocab_size", 2)),
                layer_norm_eps=float(c.get("layer_norm_eps", 1e-12)),
            )
        except KeyError as exc:
            raise CheckpointError(f"{ckpt.path / 'config.json'}: missing key {exc}") from None


class Embeddings(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.word_embeddings(ids) + self.position_embeddings(positions)[None]
        x = x + self.token_type_embeddings(torch.zeros_like(ids))
        return self.LayerNorm(x)


class SelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.heads = cfg.num_heads
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.heads, d // self.heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            split(self.query(x)), split(self.key(x)), split(self.value(x)), attn_mask=mask
        )
        return out.transpose(1, 2).reshape(b, t, d)


class DenseNorm(nn.Module):
    """Projection, residual add, LayerNorm: BERT's 'output' blocks."""

    def __init__(self, d_in: int, d_out: int, eps: float):
        super().__init__()
        self.dense = nn.Linear(d_in, d_out)
        self.LayerNorm = nn.LayerNorm(d_out, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.self = SelfAttention(cfg)
        self.output = DenseNorm(cfg.hidden_size, cfg.hidden_size, cfg.layer_norm_eps)


class Intermediate(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)


class Layer(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.attention = Attention(cfg)
        self.intermediate = Intermediate(cfg)
        self.output = DenseNorm(cfg.intermediate_size, cfg.hidden_size, cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.attention.output(self.attention.self(x, mask), x)
        return self.output(F.gelu(self.intermediate.dense(x)), x)


class Encoder(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))


class BertEncoder(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.cfg = cfg
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Mean-pooled, L2-normalised embeddings [batch, hidden] for padded `ids` [batch, seq]."""
        keep = attention_mask.bool()
        mask = keep[:, None, None, :]  # broadcast over heads and queries
        x = self.embeddings(ids)
        for layer in self.encoder.layer:
            x = layer(x, mask)
        weights = keep[..., None].to(x.dtype)
        pooled = (x * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        return F.normalize(pooled.float(), p=2, dim=-1)

    @classmethod
    def load(cls, ckpt: Checkpoint, device="cpu", dtype=torch.float32) -> BertEncoder:
        cfg = BertConfig.from_checkpoint(ckpt)
        with torch.device("meta"):
            model = cls(cfg)
        state = {k.removeprefix("bert."): v for k, v in ckpt.load_tensors(device, dtype).items()}
        expected = set(model.state_dict())
        missing = sorted(expected - set(state))
        if missing:
            raise CheckpointError(f"{ckpt.path}: missing tensors {missing[:5]}")
        model.load_state_dict({k: state[k] for k in expected}, assign=True)
        return model.eval()


class EmbeddingTokenizer:
    """tokenizer.json with the pipeline's own max length, and neither padding nor
    truncation: a longer input is its caller's to refuse or to cut (`keep`)."""

    def __init__(self, ckpt: Checkpoint, max_position: int):
        self._tok = Tokenizer.from_file(str(ckpt.path / "tokenizer.json"))
        st = ckpt.json("sentence_bert_config.json")
        self.max_length = min(int(st.get("max_seq_length", max_position)), max_position)
        self._tok.no_padding()
        self._tok.no_truncation()
        # the tokens the pipeline adds to each text ([CLS] and [SEP])
        self.special_tokens = self._tok.num_special_tokens_to_add(False)

    def encode_batch(self, texts: list[str], keep: int | None = None) -> list[list[int]]:
        """Each text's token ids, its special tokens included; with `keep` (more than
        `special_tokens`), its first `keep`: the text's first keep - special_tokens
        tokens between the special ones, as the pipeline truncates."""
        if keep is None:
            return [e.ids for e in self._tok.encode_batch(texts)]
        out = []
        for encoding in self._tok.encode_batch(texts, add_special_tokens=False):
            encoding.truncate(keep - self.special_tokens)
            out.append(self._tok.post_process(encoding).ids)
        return out


class EmbeddingModel:
    """Texts in, normalised vectors out."""

    def __init__(self, ckpt: Checkpoint, device="cpu"):
        self.model = BertEncoder.load(ckpt, device)
        self.tokenizer = EmbeddingTokenizer(ckpt, self.model.cfg.max_position)
        self.device = device

    @property
    def dimensions(self) -> int:
        return self.model.cfg.hidden_size

    def embed(self, token_lists: list[list[int]]) -> torch.Tensor:
        longest = max(len(t) for t in token_lists)
        ids = torch.zeros(len(token_lists), longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, toks in enumerate(token_lists):
            ids[i, : len(toks)] = torch.tensor(toks)
            mask[i, : len(toks)] = 1
        return self.model(ids.to(self.device), mask.to(self.device)).cpu()
