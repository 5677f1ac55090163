"""Typed messages that cross the API-process / scheduler-process boundary (pickled over ZMQ).

This is the only module both sides share (with `sampling_params`); neither side imports
the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hiserve.engine.sampling_params import SamplingParams
from hiserve.engine.tokenizer_spec import TokenizerSpec

# ---------------------------------------------------------------- API -> scheduler


@dataclass
class TokenizedGenerateReqInput:
    """One sequence to generate (n > 1 is expanded into n of these by the API side)."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    # Logprobs (see hiserve.engine.logprobs): logprob_start_len -1 = output logprobs only.
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False  # read by the API process only
    # Generate requests the API process had accepted but not yet sent when it sent this one
    # (hiserve.engine.incoming): an idle scheduler waits for them (briefly) so that a burst is
    # prefilled as one batch (Scheduler._recv_from_api).
    api_pending: int = 0


@dataclass
class AbortReq:
    """Abort one request by id, or every request."""

    rid: str = ""
    abort_all: bool = False


@dataclass
class FlushCacheReq:
    """Empty the prefix cache (device and host tiers); refused while requests run."""


@dataclass
class GetInternalStateReq:
    """Ask for the scheduler's sizes and counters (for /get_server_info)."""


# ---------------------------------------------------------------- scheduler -> API


@dataclass
class SchedulerStats:
    """Gauges and counters the API process exports at /metrics."""

    num_running_reqs: int = 0
    num_queue_reqs: int = 0
    num_used_tokens: int = 0
    token_usage: float = 0.0
    cache_hit_rate: float = 0.0
    gen_throughput: float = 0.0
    num_retracted_reqs: int = 0
    # Hierarchical cache (zero when it is off).
    hicache_host_used_tokens: int = 0
    hicache_host_total_tokens: int = 0
    backed_up_tokens_total: int = 0
    loaded_back_tokens_total: int = 0
    # Storage tier (None when it is off): `KVManager.storage_metrics()`.
    storage: Optional[dict[str, Any]] = None


@dataclass
class LogprobChunk:
    """Logprobs of one request that arrived with one BatchTokenIDOut entry.

    Entries are (logprob, token_id) pairs; a top list is best first. The prompt's lists come
    once, complete (the first prompt position's logprob is None); the output lists cover
    exactly the entry's new output ids.
    """

    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_token_logprobs: Optional[list[tuple[Optional[float], int]]] = None
    input_top_logprobs: Optional[list[list[tuple[float, int]]]] = None


@dataclass
class BatchTokenIDOut:
    """New output tokens of several requests since the last message.

    `finished_reasons[i]` is None while request i runs, else SGLang's finish_reason
    object: {"type": "length", "length": n} | {"type": "stop", "matched": id_or_str}
    | {"type": "abort", "message": str, ...}.
    """

    rids: list[str]
    new_output_ids: list[list[int]]
    finished_reasons: list[Optional[dict[str, Any]]]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens_device: list[int]
    cached_tokens_host: list[int]
    stats: Optional[SchedulerStats] = None
    cached_tokens_storage: list[int] = field(default_factory=list)  # empty without a storage tier
    logprobs: list[Optional[LogprobChunk]] = field(default_factory=list)  # per entry, when any asked


@dataclass
class FlushCacheReqOutput:
    success: bool
    message: str = ""


@dataclass
class GetInternalStateReqOutput:
    state: dict[str, Any] = field(default_factory=dict)


@dataclass
class SchedulerReady:
    """Sent once through the start-up pipe when the scheduler can take requests."""

    max_total_num_tokens: int
    max_req_input_len: int
    context_len: int
    vocab_size: int
    eos_token_ids: list[int]
    max_running_requests: int = 0  # 0: unknown (the API side then uses --max-running-requests)
    tokenizer_spec: Optional[TokenizerSpec] = None  # the API process's tokenizer, without torch
