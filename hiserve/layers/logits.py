"""Final projection to vocabulary logits, one row per request."""

from __future__ import annotations

import torch
from torch import nn

from hiserve.layers.forward_batch import ForwardBatch
from hiserve.layers.linear import linear
from hiserve.layers.parallel_linear import gather_vocab_logits


class LogitsProcessor(nn.Module):
    """Keeps the last new token of each request and applies the LM head (a weight, or a module
    holding it in another form: `PackedLinear`, `GGUFBlockLinear`).

    hidden_states: [T, H] (already final-normed); returns float32 [B, vocab].

    When `forward_batch.input_logprob_rows` is set (an EXTEND pass where some request asked
    for prompt logprobs), the logits of those T-axis rows are computed too and left in
    `forward_batch.input_logits` [len(rows), vocab] float32; other requests pay nothing.

    Under tensor parallelism the head holds this rank's vocabulary block: each rank's
    [B, ceil(V / tp)] logits are all-gathered into [B, V] (`vocab_size`) on every rank.
    """

    def __init__(self, vocab_size: int | None = None):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(
        self, hidden_states: torch.Tensor, lm_head_weight: torch.Tensor | nn.Module,
        forward_batch: ForwardBatch
    ) -> torch.Tensor:
        rows = forward_batch.input_logprob_rows
        if rows is not None and forward_batch.forward_mode.is_extend():
            forward_batch.input_logits = self._gather(
                linear(hidden_states.index_select(0, rows), lm_head_weight)).float()
        if forward_batch.last_token_index is not None:
            hidden_states = hidden_states.index_select(0, forward_batch.last_token_index)
        elif forward_batch.forward_mode.is_extend() and hidden_states.shape[0] != forward_batch.batch_size:
            last, acc = [], 0
            for n in forward_batch.extend_seq_lens_cpu:
                acc += n
                last.append(acc - 1)
            index = torch.tensor(last, dtype=torch.long, device=hidden_states.device)
            hidden_states = hidden_states.index_select(0, index)
        return self._gather(linear(hidden_states, lm_head_weight)).float()

    def _gather(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.vocab_size is None else gather_vocab_logits(logits, self.vocab_size)
