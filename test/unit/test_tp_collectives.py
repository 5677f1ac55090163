"""The TP collectives and parallel layers with two real gloo ranks (spawned processes, CPU).

Each rank checks: rank 0's pickled object reaches rank 1 (`broadcast_pyobj`); MIN and
gather agree; column-parallel (fused parts, replicated KV part) + row-parallel linears and the
vocabulary-parallel embedding / logits give the TP=1 result in float32; a divergence of the
two ranks' prefix matches raises (`KVManager._agree_match`); a peer that dies makes the
survivor's next collective raise quickly instead of hanging.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback

import torch
import torch.nn.functional as F

from hiserve.distributed import (
    broadcast_pyobj,
    destroy_tp_group,
    init_tp_group,
    tp_gather_objects,
    tp_min_ints,
)
from hiserve.layers.parallel_linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardPart,
    VocabParallelEmbedding,
    gather_vocab_logits,
)


def _free_addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _check_layers(rank: int) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 32, generator=g)
    # q: 4 heads of 8, k/v: 1 head of 8 (replicated on both ranks); o_proj back to 32
    w_qkv, w_o = torch.randn(48, 32, generator=g), torch.randn(32, 32, generator=g)
    col = ColumnParallelLinear(32, [ShardPart(32, 2), ShardPart(8, 1), ShardPart(8, 1)], False, torch.float32)
    col.weight.data.copy_(col.weight.tp_shard(w_qkv))
    row = RowParallelLinear(32, 32, True, torch.float32)
    row.weight.data.copy_(row.weight.tp_shard(w_o))
    row.bias.data.fill_(0.5)
    with torch.inference_mode():
        qkv = col(x)
        assert qkv.shape == (5, 32)  # 16 q + 8 k + 8 v
        full = F.linear(x, w_qkv)
        assert torch.equal(qkv[:, :16], full[:, rank * 16:(rank + 1) * 16])
        assert torch.equal(qkv[:, 16:], full[:, 32:])
        y = row(full[:, rank * 16:(rank + 1) * 16].contiguous())
        assert torch.allclose(y, F.linear(full[:, :32], w_o) + 0.5, atol=1e-5)
        vocab, emb_full = 11, torch.randn(11, 32, generator=g)  # 11 rows: rank 1 holds 5 + 1 padding row
        emb = VocabParallelEmbedding(vocab, 32, torch.float32)
        emb.weight.data.copy_(emb.weight.tp_shard(emb_full))
        ids = torch.tensor([0, 5, 6, 10, 3])
        assert torch.equal(emb(ids), emb_full[ids])
        logits = gather_vocab_logits(F.linear(x, emb.weight), vocab)
        assert torch.allclose(logits, F.linear(x, emb_full), atol=1e-5)


def _check_agreement(rank: int) -> None:
    from hiserve.mem_cache.kv_manager import KVManager
    from hiserve.mem_cache.prefix_cache import MatchResult

    same = MatchResult(torch.arange(16), None, 32, None)
    KVManager._agree_match(same)  # equal on both ranks: passes
    differ = MatchResult(torch.arange(16 if rank == 0 else 32), None, 0, None)
    try:
        KVManager._agree_match(differ)
    except RuntimeError as e:
        assert "diverged" in str(e)
    else:
        raise AssertionError("a divergent match was not detected")


def _worker(rank: int, addr: str, results) -> None:
    try:
        init_tp_group(2, rank, addr, torch.device("cpu"), timeout_s=60)
        got = broadcast_pyobj({"reqs": [1, 2, 3]} if rank == 0 else None)
        assert got == {"reqs": [1, 2, 3]}
        assert broadcast_pyobj([] if rank == 0 else ["ignored"]) == []
        assert tp_min_ints([rank, 5 - rank]) == [0, 4]
        assert tp_gather_objects(("r", rank)) == [("r", 0), ("r", 1)]
        _check_layers(rank)
        _check_agreement(rank)
        if rank == 1:
            os._exit(0)  # dies without leaving the group
        start = time.monotonic()
        try:
            broadcast_pyobj("after the peer died")
        except Exception:  # noqa: BLE001 - gloo's error type varies by version
            results.put((rank, f"raised after {time.monotonic() - start:.1f} s"))
            return
        results.put((rank, "no error from a dead peer"))
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put((rank, traceback.format_exc()))
    finally:
        if rank == 0:
            destroy_tp_group()


def test_two_gloo_ranks():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    addr = _free_addr()
    procs = [ctx.Process(target=_worker, args=(r, addr, results)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert not p.is_alive(), "a rank hung"
    out = {}
    while True:
        try:
            rank, msg = results.get(timeout=2)
        except queue.Empty:
            break
        out[rank] = msg
    print(out)
    assert 1 not in out, out.get(1)  # rank 1 reports only a failure
    assert out[0].startswith("raised after"), out[0]
    assert float(out[0].split()[2]) < 30, out[0]
