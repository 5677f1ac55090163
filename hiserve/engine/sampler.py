"""Turn one step's logits into next tokens: penalties, temperature, top-k/top-p/min-p, draw.

The scheduler builds a `SamplingBatchInfo` once per batch (`from_reqs`); `Sampler.sample`
then works on whole-batch tensors. Only rows with a `sampling_seed` are drawn one by one,
each from its own generator.

Semantics (SGLang-compatible):
- greedy: temperature < 1e-6 or top_k == 1 → argmax of the penalized logits;
- repetition_penalty (HF): for every token seen in prompt + output, positive logits are
  divided by the penalty and negative ones multiplied by it;
- frequency_penalty / presence_penalty (OpenAI): subtract penalty × (count of the token in
  the output) and penalty × (token appeared in the output);
- min_new_tokens: while the output is shorter, EOS (unless `ignore_eos`) and the request's
  `stop_token_ids` get -inf;
- logit_bias (OpenAI): an additive bias per (row, token id), after the penalties;
- grammar mask: tokens an xgrammar matcher forbids get -inf (`vocab_mask`, a packed
  bitmask built by `hiserve.engine.grammar`);
- top-k, then top-p over the renormalized survivors, then min-p relative to the largest
  probability; all three share one sort.

Logprobs (`sample_and_logprobs`) are the log-softmax of the logits after penalties,
logit_bias, the grammar mask and temperature, before top-k/top-p/min-p truncation: the
distribution the sampler draws from, as OpenAI defines logprobs "of the sampling
distribution"; it is also what SGLang returns by default. Greedy rows use temperature 1,
so their logprobs are those of the (penalized, biased) model distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from hiserve.engine.sampling_params import SamplingParams
from hiserve.jit_kernel import cpu as cpu_kernels

_MASK64 = (1 << 64) - 1


def step_seed(seed: int, step: int) -> int:
    """A 63-bit generator seed for output position `step` of a request seeded with `seed`.

    Deriving each step's generator from (seed, step) makes a seeded request's tokens depend
    only on its own logits, never on which other requests share the batch.
    """
    # splitmix64 finalizer over the pair.
    x = (seed * 0x9E3779B97F4A7C15 + step + 0x632BE59BD9B4E019) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


@dataclass
class SamplingBatchInfo:
    """Per-batch sampling tensors. B = batch size, V = vocab size.

    Attributes:
        temperatures: [B, 1] float32 (1.0 on greedy rows, so division is harmless).
        top_ps: [B] float32.
        top_ks: [B] int64, V where top-k is off.
        min_ps: [B] float32.
        greedy_mask: [B] bool, rows that take argmax.
        is_all_greedy: every row is greedy → argmax only, no softmax or sort.
        need_top_p / need_top_k / need_min_p: some sampled row uses that filter.
        repetition_penalties: [B, 1] float32, or None when no row uses it.
        repetition_mask: [B, V] bool, token appeared in prompt + output (with the above).
        frequency_penalties / presence_penalties: [B, 1] float32, or None when all zero.
        output_counts: [B, V] float32, occurrences of each token in the output (with the above).
        min_tokens_rows / min_tokens_ids: [K] int64 pairs (row, token) to set to -inf, or None.
        generators: one entry per row, a generator for seeded sampled rows, else None.
        seeded_rows: indices of rows with a generator.
        logit_bias_rows / logit_bias_ids / logit_bias_values: [K] int64, int64, float32
            triples (row, token, bias) added to the logits, or None.
        vocab_mask: [B, ceil(V'/32)] int32 packed allowed-token bitmask (bit t % 32 of word
            t // 32; V' may be below V, tokens past it are forbidden), or None (set by the
            caller after `from_reqs`, see `hiserve.engine.grammar`).
    """

    vocab_size: int
    temperatures: torch.Tensor
    top_ps: torch.Tensor
    top_ks: torch.Tensor
    min_ps: torch.Tensor
    greedy_mask: torch.Tensor
    is_all_greedy: bool
    need_top_p: bool
    need_top_k: bool
    need_min_p: bool
    repetition_penalties: Optional[torch.Tensor] = None
    repetition_mask: Optional[torch.Tensor] = None
    frequency_penalties: Optional[torch.Tensor] = None
    presence_penalties: Optional[torch.Tensor] = None
    output_counts: Optional[torch.Tensor] = None
    min_tokens_rows: Optional[torch.Tensor] = None
    min_tokens_ids: Optional[torch.Tensor] = None
    generators: list[Optional[torch.Generator]] = field(default_factory=list)
    seeded_rows: list[int] = field(default_factory=list)
    logit_bias_rows: Optional[torch.Tensor] = None
    logit_bias_ids: Optional[torch.Tensor] = None
    logit_bias_values: Optional[torch.Tensor] = None
    vocab_mask: Optional[torch.Tensor] = None

    @property
    def batch_size(self) -> int:
        return self.temperatures.shape[0]

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalties is not None or self.output_counts is not None
                or self.min_tokens_rows is not None)

    @classmethod
    def from_reqs(
        cls,
        params: Sequence[SamplingParams],
        token_histories: Optional[Sequence[tuple[Sequence[int], Sequence[int]]]],
        vocab_size: int,
        device: torch.device | str,
        eos_token_ids: Sequence[int] = (),
    ) -> "SamplingBatchInfo":
        """Build the batch's tensors from each request's parameters.

        Args:
            params: one SamplingParams per row.
            token_histories: `token_histories[i] = (prompt_ids, output_ids)` of row i. Read
                only for rows that use a penalty, `min_new_tokens` or a `sampling_seed`
                (the seed of each step mixes in the output length); may be None otherwise.
            vocab_size: V, the width of the logits.
            device: where the tensors live (the logits' device).
            eos_token_ids: the model's EOS ids, masked while `min_new_tokens` is unmet.

        Raises:
            ValueError: a history is needed but `token_histories` is None.
        """
        device = torch.device(device)
        bs = len(params)

        def history(i: int) -> tuple[Sequence[int], Sequence[int]]:
            if token_histories is None:
                raise ValueError(f"row {i} uses a penalty, min_new_tokens or a seed; "
                                 f"token_histories is required")
            return token_histories[i]

        greedy = [p.is_greedy for p in params]
        is_all_greedy = all(greedy)
        temps = [1.0 if g else float(p.temperature) for p, g in zip(params, greedy)]
        top_ks = [vocab_size if (p.top_k < 0 or p.top_k >= vocab_size) else p.top_k for p in params]
        sampled = [not g for g in greedy]

        # One host-to-device copy for the five per-row values (top-k as float32 is exact
        # below 2**24; no vocabulary is that large): a copy costs more than its bytes.
        rows = _as_tensor([temps, [float(p.top_p) for p in params], top_ks, [float(p.min_p) for p in params],
                           greedy], torch.float32, device)
        info = cls(
            vocab_size=vocab_size,
            temperatures=rows[0].view(bs, 1),
            top_ps=rows[1],
            top_ks=rows[2].to(torch.int64),
            min_ps=rows[3],
            greedy_mask=rows[4].to(torch.bool),
            is_all_greedy=is_all_greedy,
            need_top_p=any(s and p.top_p < 1.0 for s, p in zip(sampled, params)),
            need_top_k=any(s and k < vocab_size for s, k in zip(sampled, top_ks)),
            need_min_p=any(s and p.min_p > 0.0 for s, p in zip(sampled, params)),
        )

        _add_penalties(info, params, history, vocab_size, device)
        _add_min_tokens(info, params, history, vocab_size, eos_token_ids, device)
        _add_logit_bias(info, params, vocab_size, device)
        _add_generators(info, params, history, greedy, device)
        return info


def _as_tensor(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device` (one copy). On CUDA through pinned memory without
    waiting: `torch.tensor(..., device=cuda)` would block the host until the copy is done,
    i.e. until the work queued before it on the stream has run."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _add_penalties(info: "SamplingBatchInfo", params: Sequence[SamplingParams], history,
                   vocab_size: int, device: torch.device) -> None:
    """Repetition penalty: a [B, V] bool mask of tokens seen in prompt + output; frequency /
    presence penalties: [B, V] float32 counts of output tokens (only rows that use them)."""
    bs = len(params)
    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep_rows:
        rows, ids = [], []
        for i in rep_rows:
            prompt_ids, output_ids = history(i)
            rows.extend([i] * (len(prompt_ids) + len(output_ids)))
            ids.extend(prompt_ids)
            ids.extend(output_ids)
        mask = torch.zeros(bs, vocab_size, dtype=torch.bool, device=device)
        mask[_as_tensor(rows, torch.int64, device), _as_tensor(ids, torch.int64, device)] = True
        info.repetition_mask = mask
        info.repetition_penalties = _as_tensor(
            [float(p.repetition_penalty) for p in params], torch.float32, device).view(bs, 1)
    add_rows = [i for i, p in enumerate(params)
                if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
    if not add_rows:
        return
    rows, ids = [], []
    for i in add_rows:
        output_ids = history(i)[1]
        rows.extend([i] * len(output_ids))
        ids.extend(output_ids)
    counts = torch.zeros(bs, vocab_size, dtype=torch.float32, device=device)
    if ids:
        counts.index_put_((_as_tensor(rows, torch.int64, device), _as_tensor(ids, torch.int64, device)),
                          torch.ones(len(ids), dtype=torch.float32, device=device), accumulate=True)
    info.output_counts = counts
    info.frequency_penalties = _as_tensor(
        [float(p.frequency_penalty) for p in params], torch.float32, device).view(bs, 1)
    info.presence_penalties = _as_tensor(
        [float(p.presence_penalty) for p in params], torch.float32, device).view(bs, 1)


def _add_min_tokens(info: "SamplingBatchInfo", params: Sequence[SamplingParams], history,
                    vocab_size: int, eos_token_ids: Sequence[int], device: torch.device) -> None:
    """min_new_tokens: the (row, stop id) pairs to forbid this step."""
    rows, ids = [], []
    for i, p in enumerate(params):
        if p.min_new_tokens <= 0 or len(history(i)[1]) >= p.min_new_tokens:
            continue
        stop_ids = set(p.stop_token_ids or ())
        if not p.ignore_eos:
            stop_ids.update(eos_token_ids)
        stop_ids = sorted(t for t in stop_ids if 0 <= t < vocab_size)
        rows.extend([i] * len(stop_ids))
        ids.extend(stop_ids)
    if ids:
        info.min_tokens_rows = _as_tensor(rows, torch.int64, device)
        info.min_tokens_ids = _as_tensor(ids, torch.int64, device)


def _add_logit_bias(info: "SamplingBatchInfo", params: Sequence[SamplingParams], vocab_size: int,
                    device: torch.device) -> None:
    """logit_bias: sparse (row, token, bias) triples, added with one scatter."""
    rows, ids, values = [], [], []
    for i, p in enumerate(params):
        for token, bias in (p.logit_bias or {}).items():
            if 0 <= int(token) < vocab_size:
                rows.append(i)
                ids.append(int(token))
                values.append(float(bias))
    if rows:
        info.logit_bias_rows = _as_tensor(rows, torch.int64, device)
        info.logit_bias_ids = _as_tensor(ids, torch.int64, device)
        info.logit_bias_values = _as_tensor(values, torch.float32, device)


def _add_generators(info: "SamplingBatchInfo", params: Sequence[SamplingParams], history,
                    greedy: Sequence[bool], device: torch.device) -> None:
    """Seeded rows: a generator per row, seeded from (seed, output position)."""
    info.generators = [None] * len(params)
    for i, p in enumerate(params):
        if p.sampling_seed is None or greedy[i]:
            continue
        gen = torch.Generator(device=device)
        gen.manual_seed(step_seed(int(p.sampling_seed), len(history(i)[1])))
        info.generators[i] = gen
        info.seeded_rows.append(i)


def apply_penalties(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Return `logits` [B, V] with repetition, frequency, presence and min_new_tokens
    penalties applied (a new tensor when any applies; `logits` itself otherwise)."""
    if info.repetition_penalties is not None:
        rp = info.repetition_penalties
        penalized = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(info.repetition_mask, penalized, logits)
    if info.output_counts is not None:
        counts = info.output_counts
        logits = (logits - info.frequency_penalties * counts
                  - info.presence_penalties * (counts > 0).to(logits.dtype))
    if info.min_tokens_rows is not None:
        logits = logits.clone() if (info.repetition_penalties is None
                                    and info.output_counts is None) else logits
        logits[info.min_tokens_rows, info.min_tokens_ids] = float("-inf")
    return logits


def apply_logit_bias_and_mask(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Return `logits` [B, V] with logit_bias added and grammar-forbidden tokens at -inf
    (a new tensor when either applies; `logits` itself otherwise)."""
    if info.logit_bias_rows is not None:
        logits = logits.index_put((info.logit_bias_rows, info.logit_bias_ids), info.logit_bias_values,
                                  accumulate=True)
    if info.vocab_mask is not None:
        allowed = unpack_bitmask(info.vocab_mask, logits.shape[-1])
        logits = logits.masked_fill(~allowed, float("-inf"))
        dead = torch.isneginf(logits).all(dim=-1, keepdim=True)
        if bool(dead.any()):
            # min_new_tokens banned the only tokens the grammar allows (its stop token): the
            # grammar wins, uniformly over what it allows, rather than a NaN distribution.
            logits = torch.where(dead & allowed, torch.zeros_like(logits), logits)
    return logits


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, W] int32 packed bitmask -> [B, vocab] bool (columns past W*32 are False)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().view(bitmask.shape[0], -1)
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    pad = torch.zeros(bits.shape[0], vocab - bits.shape[1], dtype=torch.bool, device=bits.device)
    return torch.cat([bits, pad], dim=1)


def filter_probs(probs: torch.Tensor, info: SamplingBatchInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply top-k, top-p and min-p with one descending sort.

    Returns:
        (weights, order): `weights` [B, V] are the surviving probabilities in sorted order
        (zeros elsewhere, not renormalized), `order` [B, V] the token id of each column.
    """
    probs_sorted, order = probs.sort(dim=-1, descending=True)
    vocab = probs.shape[-1]
    if info.need_top_k:
        rank = torch.arange(vocab, device=probs.device).view(1, vocab)
        probs_sorted = probs_sorted.masked_fill(rank >= info.top_ks.view(-1, 1), 0.0)
    if info.need_top_p:
        cum = probs_sorted.cumsum(dim=-1)
        total = cum[:, -1:]
        # Drop a token when the mass strictly before it already reaches top_p (of the
        # survivors' total); the most likely token always stays.
        drop = (cum - probs_sorted) > info.top_ps.view(-1, 1) * total
        probs_sorted = probs_sorted.masked_fill(drop, 0.0)
    if info.need_min_p:
        threshold = info.min_ps.view(-1, 1) * probs_sorted[:, :1]
        probs_sorted = probs_sorted.masked_fill(probs_sorted < threshold, 0.0)
    return probs_sorted, order


class Sampler:
    """Chooses one next token per row."""

    def sample(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """Sample next tokens.

        Args:
            logits: [B, V] logits of the last position of each request (cast to float32).
            info: this batch's SamplingBatchInfo.

        Returns:
            [B] int64 token ids.
        """
        return self.sample_and_logprobs(logits, info)[0]

    def sample_and_logprobs(self, logits: torch.Tensor, info: SamplingBatchInfo,
                            logprob_rows: Optional[torch.Tensor] = None
                            ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Sample next tokens and, for `logprob_rows`, the log-probabilities they were drawn from.

        Args:
            logits: [B, V] logits of the last position of each request (cast to float32).
            info: this batch's SamplingBatchInfo.
            logprob_rows: [R] int64 rows whose logprobs are wanted, or None for none.

        Returns:
            ([B] int64 token ids, [R, V] float32 logprobs or None). The logprobs are
            log_softmax((logits after penalties, logit_bias, grammar mask) / temperature),
            before top-k/top-p/min-p (see the module docstring); forbidden tokens are -inf.
        """
        if logits.dim() != 2 or logits.shape[0] != info.batch_size:
            raise ValueError(f"logits must be [B={info.batch_size}, V], got {tuple(logits.shape)}")
        if logits.dtype != torch.float32:
            logits = logits.float()
        logits = apply_logit_bias_and_mask(apply_penalties(logits, info), info)
        logprobs = None
        if logprob_rows is not None and logprob_rows.numel():
            logprobs = torch.log_softmax(logits[logprob_rows] / info.temperatures[logprob_rows], dim=-1)
        return self._draw(logits, info), logprobs

    def _draw(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        if info.is_all_greedy:
            return _argmax(logits)

        probs = torch.softmax(logits / info.temperatures, dim=-1)
        if info.need_top_k or info.need_top_p or info.need_min_p:
            weights, order = filter_probs(probs, info)
        else:
            weights, order = probs, None
        # A row with no finite positive weight (e.g. every token masked, or an overflow) would
        # make multinomial raise and take the whole scheduler down: such a row draws uniformly
        # instead (no host sync: torch.where, not a Python branch).
        weights = torch.nan_to_num(weights, nan=0.0, posinf=0.0, neginf=0.0).clamp_min_(0)
        empty = weights.sum(dim=-1, keepdim=True) <= 0
        weights = torch.where(empty, torch.ones_like(weights), weights)

        bs = logits.shape[0]
        picked = torch.empty(bs, dtype=torch.int64, device=logits.device)
        if info.seeded_rows:
            unseeded = [i for i in range(bs) if info.generators[i] is None]
            if unseeded:
                rows = torch.tensor(unseeded, dtype=torch.int64, device=logits.device)
                picked[rows] = torch.multinomial(weights[rows], 1).view(-1)
            for i in info.seeded_rows:
                picked[i] = torch.multinomial(weights[i], 1, generator=info.generators[i])[0]
        else:
            picked = torch.multinomial(weights, 1).view(-1)
        if order is not None:
            picked = order.gather(1, picked.view(-1, 1)).view(-1)
        # Greedy rows in a mixed batch take argmax.
        return torch.where(info.greedy_mask, _argmax(logits), picked)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] float32 -> [B] int64 greedy tokens. On the CPU the kernel (torch's CPU argmax is
    one scalar pass on one thread: 1.2 ms of a batch-16 decode step for 16 x 49152 logits,
    against 0.1 ms); elsewhere torch's."""
    if logits.is_cpu and logits.stride(-1) == 1 and cpu_kernels.can_use_cpu_kernels():
        return cpu_kernels.argmax(logits)
    return logits.argmax(dim=-1)
