"""Does `torch.compile` of the decode forward pay on the CPU? Eager vs compiled, same process.

The default model (`make serve` weights: GGUF int4 with the dense dispatch, bf16) decodes one
request (128-token prompt) with bench_linear's harness (torch_native attention), once eagerly
and once with `torch.compile(model.model, dynamic=False)`; the prefill runs eagerly in both (its
oneDNN-prepacked dense GEMMs do not lower in Inductor). Prints the compile time, the graph count
and the median decode step (process CPU time, one thread: robust on a shared machine).

    python benchmark/cpu/bench_compile_decode.py
"""
import statistics as st
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from bench_linear import CLOCK, DecodeHarness  # noqa: E402

from hiserve.layers.quantization import setup_int4_dispatch  # noqa: E402
from hiserve.models import loader  # noqa: E402


def main() -> None:
    """Load, time eager vs compiled decode at batch 1, print."""
    torch.set_num_threads(1)
    CLOCK[0] = time.process_time
    path = loader.resolve_model_path(None)
    m, cfg = loader.load_model(path, torch.bfloat16, "cpu", quantization="gguf")
    m.pack_for_cpu()
    setup_int4_dispatch(m)
    prompts = [list(range(1000, 1128))]
    eager = DecodeHarness(m, cfg, torch.bfloat16, prompts, 4096)
    comp_model = torch.compile(m.model, dynamic=False)

    def compiled_forward(fb):
        """The model's forward with the compiled decoder stack (the LM head stays eager)."""
        return m.logits_processor(comp_model(fb.input_ids, fb.positions, fb), m.lm_head_weight, fb)

    t0 = time.perf_counter()
    comp = DecodeHarness(m, cfg, torch.bfloat16, prompts, 4096)  # prefill eager (its dense GEMMs do not lower)
    comp.model = compiled_forward
    with torch.inference_mode():
        comp.decode_ms(2)
    print("compile+first steps wall s", round(time.perf_counter() - t0, 1), flush=True)
    import torch._dynamo.utils as du

    print("graphs compiled:", du.counters["stats"].get("unique_graphs"), "; distinct graph-break reasons:",
          len(du.counters["graph_break"]), flush=True)
    a, b = [], []
    with torch.inference_mode():
        for _ in range(7):
            a.append(eager.decode_ms(8))
            b.append(comp.decode_ms(8))
    print("decode bs1 ms/step (CPU time, 1 thread): eager %.2f compiled %.2f" % (st.median(a), st.median(b)))


if __name__ == "__main__":
    main()
