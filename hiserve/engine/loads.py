"""Load reports for routers: SGLang's `/v1/loads` and its legacy `/get_load`.

A router in front of several replicas (sglang-router / SMG) polls these to balance load:
sglang-router 0.3.2 reads `/get_load` (a list, one entry per data-parallel rank, of
`dp_rank`, `num_reqs`, `num_waiting_reqs`, `num_tokens`) for its `power_of_two` policy;
newer gateways read `/v1/loads` (`{"loads": [...]}` with SGLang's `GetLoadsReqOutput`
fields). hiserve has one rank (dp_rank 0). Both are built from the scheduler's internal
state at the time of the request (`TokenizerManager.get_internal_state`).

Token counts follow SGLang's definitions: `num_used_tokens` = KV slots held by requests
(the pool minus free and evictable-cache slots), `num_total_tokens` = that plus the prompt
tokens of the waiting queue, `token_usage` = num_used_tokens / max_total_num_tokens.
"""

from __future__ import annotations

import time
from typing import Any


def load_entry(state: dict[str, Any], cache_hit_rate: float) -> dict[str, Any]:
    """One rank's `/v1/loads` entry from the scheduler's internal state.

    Args:
        state: `Scheduler.internal_state()` (keys max_total_num_tokens, available_size,
            evictable_size, num_running_reqs, num_queue_reqs, max_running_requests,
            last_gen_throughput, optionally num_waiting_tokens).
        cache_hit_rate: cached / prompt tokens of the latest prefill batch (0-1).
    Returns:
        SGLang's GetLoadsReqOutput fields: counts in requests and tokens, token_usage and
        cache_hit_rate in 0-1, gen_throughput in tokens/s, timestamp in Unix seconds.
    """
    total = int(state["max_total_num_tokens"])
    used = max(0, total - int(state.get("available_size", 0)) - int(state.get("evictable_size", 0)))
    return {"dp_rank": 0, "timestamp": time.time(),
            "num_running_reqs": int(state.get("num_running_reqs", 0)),
            "num_waiting_reqs": int(state.get("num_queue_reqs", 0)),
            "num_used_tokens": used,
            "num_total_tokens": used + int(state.get("num_waiting_tokens", 0)),
            "max_total_num_tokens": total,
            "token_usage": used / total if total else 0.0,
            "gen_throughput": float(state.get("last_gen_throughput", 0.0)),
            "cache_hit_rate": float(cache_hit_rate),
            "max_running_requests": int(state.get("max_running_requests", 0))}


def legacy_load(entry: dict[str, Any]) -> dict[str, Any]:
    """The `/get_load` projection of a `/v1/loads` entry (as SGLang's legacy shim)."""
    return {"dp_rank": entry["dp_rank"],
            "num_reqs": entry["num_running_reqs"] + entry["num_waiting_reqs"],
            "num_waiting_reqs": entry["num_waiting_reqs"],
            "num_tokens": entry["num_total_tokens"],
            "num_pending_tokens": entry["num_total_tokens"] - entry["num_used_tokens"],
            "ts_tic": time.perf_counter()}
