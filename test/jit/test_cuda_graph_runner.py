"""CUDA-graph replays give the eager logits: DECODE (fa3 and triton), one-request EXTEND (fa3).

Two real ModelRunners share one small random-weight Llama built from a ModelConfig: one
replays CUDA graphs (captured for 1, 2, 4, 8, 16, 24), the other runs eagerly, each on its
own pools. Both get the same prefills, then the same decode steps at batch sizes 1, 3, 17
and 3 again (padded to 1, 4, 24, 4: rows a larger batch used are padding again), several
steps each so every replay sees new lengths. Short prompts keep a wrong length or page
visible in the logits.

A last test starts a layer-by-layer load-back on another stream that is still running when
a decode of other requests replays: the replay must not wait for it, and the extend batch
that reads the loaded slots (carrying the load's ticket) must see every layer's new K/V.

Skipped without CUDA; each backend is skipped where it cannot run (fa3: Hopper and
flash_attn_interface; triton: its backend module and the triton package).
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

from hiserve.engine.model_runner import ModelRunner  # noqa: E402
from hiserve.layers.attention.fa3_probe import fa3_unavailable_reason  # noqa: E402
from hiserve.layers.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from hiserve.models.llama import LlamaForCausalLM  # noqa: E402
from hiserve.models.model_config import ModelConfig  # noqa: E402
from hiserve.server_args import ServerArgs  # noqa: E402

HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512,
             "vocab_size": 1000, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5}
GRAPH_MAX_BS = 24
DECODE_BATCHES = [1, 3, 17, 3]
STEPS_PER_BATCH = 3


def skip_reason(backend: str) -> str | None:
    if backend == "fa3":
        return fa3_unavailable_reason()
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if importlib.util.find_spec("hiserve.layers.attention.triton_backend") is None:
        return "hiserve has no triton backend module"
    return None


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(folder with config.json, model, config): resolve() reads the folder, the runners share the model."""
    folder = tmp_path_factory.mktemp("llama")
    (folder / "config.json").write_text(json.dumps(HF_CONFIG))
    config = ModelConfig.from_hf_config(HF_CONFIG)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config, torch.bfloat16)
    return str(folder), model.eval(), config


def make_runner(llama, backend: str, page_size: int, graphs: bool) -> ModelRunner:
    folder, model, config = llama
    args = ServerArgs(model_path=folder, device="cuda", dtype="bfloat16", attention_backend=backend,
                      page_size=page_size, max_total_tokens=16384, max_running_requests=32,
                      cuda_graph_max_bs=GRAPH_MAX_BS, disable_cuda_graph=not graphs).resolve()
    return ModelRunner(args, model=(model, config))


class Driver:
    """Feeds requests to one runner the way the scheduler does (rows, paged slots, batches)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.rows: dict[str, int] = {}
        self.lens: dict[str, int] = {}

    def _batch(self, mode: ForwardMode, names: list[str], tokens: list[list[int]], out_cache_loc: torch.Tensor,
               prefix: list[int]) -> ForwardBatch:
        r = self.runner
        ext = [len(t) for t in tokens]
        seq = [p + e for p, e in zip(prefix, ext)]
        off = 0
        for name, p, s in zip(names, prefix, seq):
            r.req_to_token_pool.req_to_token[self.rows[name], p:s] = out_cache_loc[off:off + s - p].to(torch.int32)
            off += s - p
            self.lens[name] = s
        dev = r.device
        return ForwardBatch(
            forward_mode=mode, batch_size=len(names),
            input_ids=torch.tensor([t for ts in tokens for t in ts], dtype=torch.int64, device=dev),
            positions=torch.tensor([j for p, s in zip(prefix, seq) for j in range(p, s)], dtype=torch.int64,
                                   device=dev),
            out_cache_loc=out_cache_loc.to(dev),
            req_pool_indices=torch.tensor([self.rows[n] for n in names], dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(seq, dtype=torch.int64, device=dev), seq_lens_cpu=seq,
            extend_seq_lens_cpu=ext, extend_prefix_lens_cpu=prefix,
            req_to_token_pool=r.req_to_token_pool, token_to_kv_pool=r.token_to_kv_pool,
            attn_backend=r.attn_backend)

    def prefill(self, prompts: dict[str, list[int]]) -> ForwardBatch:
        names = list(prompts)
        for name in names:
            self.rows[name] = self.runner.req_to_token_pool.alloc(1)[0]
        seq = [len(prompts[n]) for n in names]
        loc = self.runner.token_to_kv_pool_allocator.alloc_extend([0] * len(names), seq, [-1] * len(names))
        return self._batch(ForwardMode.EXTEND, names, [prompts[n] for n in names], loc, [0] * len(names))

    def extend(self, name: str, tokens: list[int]) -> ForwardBatch:
        """Continue `name` with `tokens` (a prefix of lens[name] tokens already in the pool)."""
        p = self.lens[name]
        last_loc = int(self.runner.req_to_token_pool.req_to_token[self.rows[name], p - 1])
        loc = self.runner.token_to_kv_pool_allocator.alloc_extend([p], [p + len(tokens)], [last_loc])
        return self._batch(ForwardMode.EXTEND, [name], [tokens], loc, [p])

    def decode(self, tokens: dict[str, int]) -> ForwardBatch:
        names = list(tokens)
        table = self.runner.req_to_token_pool.req_to_token
        seq = [self.lens[n] + 1 for n in names]
        last_loc = [int(table[self.rows[n], s - 2]) for n, s in zip(names, seq)]
        loc = self.runner.token_to_kv_pool_allocator.alloc_decode(seq, last_loc)
        return self._batch(ForwardMode.DECODE, names, [[tokens[n]] for n in names], loc, [s - 1 for s in seq])


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("backend", ["fa3", "triton"])
def test_replayed_decode_logits_equal_eager(llama, backend, page_size):
    reason = skip_reason(backend)
    if reason is not None:
        pytest.skip(f"{backend} unavailable: {reason}")
    graphed = make_runner(llama, backend, page_size, graphs=True)
    eager = make_runner(llama, backend, page_size, graphs=False)
    runner = graphed.cuda_graph_runner
    assert runner is not None and eager.cuda_graph_runner is None
    assert runner.capture_bs == [1, 2, 4, 8, 16, 24]

    gen = torch.Generator().manual_seed(1)
    vocab = HF_CONFIG["vocab_size"]
    prompts = {f"r{i}": torch.randint(0, vocab, (1 + (7 * i) % 23,), generator=gen).tolist() for i in range(17)}
    graphed_driver, eager_driver = Driver(graphed), Driver(eager)
    logits_g = graphed.run_forward(graphed_driver.prefill(prompts))
    logits_e = eager.run_forward(eager_driver.prefill(prompts))
    torch.testing.assert_close(logits_g, logits_e, rtol=1e-3, atol=1e-3)  # both eager: the same kernels

    for bs in DECODE_BATCHES:
        names = list(prompts)[:bs]
        for _ in range(STEPS_PER_BATCH):
            tokens = {n: int(t) for n, t in zip(names, torch.randint(0, vocab, (bs,), generator=gen))}
            fb_g, fb_e = graphed_driver.decode(tokens), eager_driver.decode(tokens)
            assert runner.can_run(fb_g)
            out_g = graphed.run_forward(fb_g).clone()
            out_e = eager.run_forward(fb_e)
            assert out_g.shape == (bs, vocab)
            # Padding changes GEMM shapes and FA3's split heuristic, so allow bf16 rounding noise.
            torch.testing.assert_close(out_g, out_e, rtol=2e-2, atol=2e-2,
                                       msg=lambda m: f"bs {bs}, lens {fb_g.seq_lens_cpu}: {m}")


def test_batch_larger_than_the_graphs_runs_eagerly(llama):
    backend = "fa3" if skip_reason("fa3") is None else "triton"
    if skip_reason(backend) is not None:
        pytest.skip("neither fa3 nor triton can run here")
    runner = make_runner(llama, backend, 1, graphs=True)
    driver = Driver(runner)
    prompts = {f"r{i}": [i + 1, i + 2] for i in range(GRAPH_MAX_BS + 1)}
    runner.run_forward(driver.prefill(prompts))
    fb = driver.decode({n: 5 for n in prompts})
    assert not runner.cuda_graph_runner.can_run(fb)
    assert runner.run_forward(fb).shape == (GRAPH_MAX_BS + 1, HF_CONFIG["vocab_size"])


def test_load_back_is_waited_for_only_by_its_batch(llama):
    """A load-back still running on another stream (slowed by a sleep kernel): a decode replay
    of other requests finishes first, and the extend reading the loaded slots, which carries
    the load's ticket, sees every layer's new K/V (its logits equal the eager runner's)."""
    from hiserve.mem_cache.cache_controller import CacheAck, LoadTicket

    backend = "fa3" if skip_reason("fa3") is None else "triton"
    if skip_reason(backend) is not None:
        pytest.skip("neither fa3 nor triton can run here")
    graphed, eager = make_runner(llama, backend, 1, graphs=True), make_runner(llama, backend, 1, graphs=False)
    prompts = {"r0": list(range(3, 40)), "r1": [5, 6, 7], "r2": list(range(100, 120))}
    drivers = {"graphed": Driver(graphed), "eager": Driver(eager)}
    for name, runner in (("graphed", graphed), ("eager", eager)):
        runner.run_forward(drivers[name].prefill(prompts))
    torch.cuda.synchronize()

    gen = torch.Generator(device="cuda").manual_seed(5)
    new_kv = {}  # (layer, "k"/"v") -> replacement K/V of r0's whole context

    def slots(name: str) -> torch.Tensor:
        driver, runner = drivers[name], {"graphed": graphed, "eager": eager}[name]
        return runner.req_to_token_pool.req_to_token[driver.rows["r0"], :driver.lens["r0"]].long()

    pool = eager.token_to_kv_pool
    for layer in range(pool.layer_num):
        for kind, bufs in (("k", pool.k_buffer), ("v", pool.v_buffer)):
            shape = bufs[layer][slots("eager")].shape
            new_kv[layer, kind] = torch.randn(shape, generator=gen, device="cuda").to(bufs[layer].dtype)
            bufs[layer][slots("eager")] = new_kv[layer, kind]  # the eager runner gets it at once

    target = graphed.token_to_kv_pool
    events = [torch.cuda.Event() for _ in range(target.layer_num)]
    finish = torch.cuda.Event()
    load_stream = torch.cuda.Stream()
    load_stream.wait_stream(torch.cuda.current_stream())
    dst = slots("graphed")
    with torch.cuda.stream(load_stream):
        torch.cuda._sleep(400_000_000)  # the load is still running when the decode is issued
        for layer in range(target.layer_num):
            target.k_buffer[layer][dst] = new_kv[layer, "k"]
            target.v_buffer[layer][dst] = new_kv[layer, "v"]
            events[layer].record(load_stream)
        finish.record(load_stream)
    ticket = LoadTicket(events, CacheAck(0, [0], len(dst), finish))

    others = {"r1": 12, "r2": 13}
    fb_g, fb_e = drivers["graphed"].decode(others), drivers["eager"].decode(others)
    assert graphed.cuda_graph_runner.can_run(fb_g)
    decoded = torch.cuda.Event()
    out_g = graphed.run_forward(fb_g, None).clone()
    decoded.record()
    decoded.synchronize()
    assert not finish.query(), "the decode of other requests waited for the load-back"
    torch.testing.assert_close(out_g, eager.run_forward(fb_e), rtol=2e-2, atol=2e-2)

    fb_g, fb_e = drivers["graphed"].extend("r0", [11, 12]), drivers["eager"].extend("r0", [11, 12])
    xg = graphed.extend_graph_runner
    assert (xg is not None and xg.can_run(fb_g)) == (backend == "fa3")  # fa3: a replay after wait_all
    out_g = graphed.run_forward(fb_g, ticket).clone()
    out_e = eager.run_forward(fb_e)
    torch.testing.assert_close(out_g, out_e, rtol=2e-2, atol=2e-2)
    assert target.layer_transfer_counter is None  # installed for that forward only


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_replayed_extend_logits_equal_eager(llama, page_size):
    """One-request extends on cached prefixes (1 to 256 new tokens, and 257: eager) replayed
    from extend graphs give the eager runner's logits, and a decode after each reads the K/V
    the replay wrote (its logits equal too)."""
    reason = skip_reason("fa3")
    if reason is not None:
        pytest.skip(f"fa3 unavailable: {reason}")
    graphed = make_runner(llama, "fa3", page_size, graphs=True)
    eager = make_runner(llama, "fa3", page_size, graphs=False)
    runner = graphed.extend_graph_runner
    assert runner is not None and eager.extend_graph_runner is None
    assert runner.buckets == [8, 16, 32, 64, 128, 256]
    gen = torch.Generator().manual_seed(3)
    vocab = HF_CONFIG["vocab_size"]
    prompts = {f"r{i}": torch.randint(0, vocab, (5 + 61 * i,), generator=gen).tolist() for i in range(4)}
    drivers = Driver(graphed), Driver(eager)
    for d in drivers:
        d.runner.run_forward(d.prefill(prompts))
    # Shrinking within a graph (200 then 130 in the 256-bucket): the rows 200 used are padding again.
    for i, t in enumerate([1, 7, 8, 9, 64, 65, 200, 130, 256, 257, 3]):
        name = f"r{i % 4}"
        tokens = torch.randint(0, vocab, (t,), generator=gen).tolist()
        fb_g, fb_e = drivers[0].extend(name, tokens), drivers[1].extend(name, tokens)
        assert runner.can_run(fb_g) == (t <= 256)
        out_g = graphed.run_forward(fb_g).clone()
        torch.testing.assert_close(out_g, eager.run_forward(fb_e), rtol=2e-2, atol=2e-2,
                                   msg=lambda m: f"+{t} on {fb_g.seq_lens_cpu[0] - t}: {m}")
        step = {n: int(x) for n, x in zip(prompts, torch.randint(0, vocab, (4,), generator=gen))}
        out_g = graphed.run_forward(drivers[0].decode(step)).clone()
        torch.testing.assert_close(out_g, eager.run_forward(drivers[1].decode(step)), rtol=2e-2, atol=2e-2)
