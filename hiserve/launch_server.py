"""`python -m hiserve.launch_server [flags]`: start the scheduler process, then serve HTTP.

    main: parse flags (no torch) ──spawn──> scheduler process: _run_scheduler()
      │                                       ├── ServerArgs.resolve() (torch: device, dtype, kernels)
      │   <── pipe: resolved, frozen ServerArgs (or InvalidServerArgs: exit 2, a usage error)
      │   <── pipe: SchedulerReady with the tokenizer's spec (or an error string: exit 1)
      ├── TokenizerManager (tokenizer rebuilt from the spec) + FastAPI app
      └── uvicorn; warm-up /generate; "The server is fired up and ready to roll!"

This process is the API process: it tokenizes and serves HTTP, and imports neither torch
nor gguf to start. Everything that needs them (detecting the device and its kernels while
resolving the flags, reading a GGUF file's vocabulary) happens in the scheduler process,
which sends back the results: the frozen `ServerArgs` and a `TokenizerSpec`. The API
process thus starts sooner, holds ~180 MiB less, and on CUDA creates no CUDA context.
(xgrammar, which imports torch, still loads here at the first request with a grammar
constraint, to refuse a bad one with a 400 before any work starts.)

The scheduler process is killed whenever this process leaves, normally or by SIGTERM /
SIGINT. If it dies first, requests fail with 503 instead of waiting forever.

Threads: the scheduler process computes on `scheduler_threads()` torch/OpenMP threads (the
cores it may use: its affinity, capped by a cgroup v2 cpu.max quota; or OMP_NUM_THREADS when
the user set it). This process's OpenMP pools (if a library starts one) are held at one
thread, leaving the cores to the scheduler's compute threads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import sys
import time
from typing import Any

from hiserve.server_args import PortArgs, ServerArgs, server_args_parser

logger = logging.getLogger("hiserve.launch_server")

_WARMUP_PROMPT = "The capital city of France is"
_WARMUP_TIMEOUT_S = 600.0


class InvalidServerArgs(ValueError):
    """The flags cannot run here (`ServerArgs.resolve()` refused them in the scheduler
    process); `main` reports it as a usage error (exit status 2)."""


def scheduler_threads() -> tuple[int, str]:
    """Compute threads for the scheduler process and why (`hardware.cpu_compute_threads`),
    read before this process sets its own OMP_NUM_THREADS to 1."""
    from hiserve.hardware import cpu_compute_threads

    return cpu_compute_threads()


def _run_scheduler(num_threads: int, server_args: ServerArgs, port_args: PortArgs, writer: Any) -> None:
    """Scheduler process entry: size torch's and OpenMP's thread pools before torch loads,
    resolve the flags and send them back (the API process never imports torch to resolve
    them), then run the scheduler. Importing torch and the scheduler only here keeps them
    out of the API process, which pickles only a reference to this function.

    Pipe messages, in order: the resolved `ServerArgs` or an `InvalidServerArgs`, then (from
    `run_scheduler_process`) a `SchedulerReady` or an error string.
    """
    os.environ["OMP_NUM_THREADS"] = str(num_threads)
    import torch

    torch.set_num_threads(num_threads)
    logging.basicConfig(level=server_args.log_level.upper(), format="[%(asctime)s scheduler] %(message)s")
    try:
        server_args.resolve()
    except (ValueError, FileNotFoundError) as e:
        writer.send(InvalidServerArgs(str(e)))
        return
    if server_args.device == "cpu":
        from hiserve.hardware import detect_cpu

        logger.info("CPU: %s -> --dtype %s, attention prefill %s / decode %s", detect_cpu().describe(),
                    server_args.dtype, server_args.prefill_attention_backend, server_args.decode_attention_backend)
    writer.send(server_args)
    from hiserve.engine.scheduler import run_scheduler_process

    run_scheduler_process(server_args, port_args, writer)


def _limit_api_threads() -> None:
    """One OpenMP thread in this process: its work is tokenizing and HTTP."""
    os.environ["OMP_NUM_THREADS"] = "1"


def _receive(proc: mp.Process, reader: Any) -> Any:
    """The scheduler process's next pipe message; raises RuntimeError if it dies first or
    sends an error string."""
    while not reader.poll(0.5):
        if not proc.is_alive() and not reader.poll(0):
            raise RuntimeError(f"the scheduler process exited with code {proc.exitcode} before it was ready")
    try:
        msg = reader.recv()
    except EOFError:
        raise RuntimeError("the scheduler process closed its pipe before it was ready") from None
    if isinstance(msg, str):
        raise RuntimeError(msg)
    return msg


def _wait_for_resolved_args(proc: mp.Process, reader: Any) -> ServerArgs:
    """The frozen ServerArgs the scheduler process resolved.

    Raises:
        InvalidServerArgs: resolve() refused the flags.
        RuntimeError: the scheduler process died or failed first.
    """
    msg = _receive(proc, reader)
    if isinstance(msg, InvalidServerArgs):
        raise msg
    if not isinstance(msg, ServerArgs):
        raise RuntimeError(f"the scheduler process sent {type(msg).__name__} instead of the resolved ServerArgs")
    return msg


def _log_server_args(server_args: ServerArgs) -> None:
    # The key itself never reaches a log (nor /get_server_info, which redacts it too).
    shown = dataclasses.replace(server_args, api_key="<redacted>") if server_args.api_key else server_args
    logger.info("server_args: %s", shown)


def _stop_scheduler(proc: mp.Process) -> None:
    if proc.is_alive():
        proc.terminate()
        proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join()


def _local_url(server_args: ServerArgs) -> str:
    host = server_args.host
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{server_args.port}"


async def _warm_up(server_args: ServerArgs) -> None:
    """One greedy /generate through the real HTTP path, so the first user request is not the first."""
    import httpx

    headers = {"Authorization": f"Bearer {server_args.api_key}"} if server_args.api_key else {}
    body = {"text": _WARMUP_PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
    async with httpx.AsyncClient(timeout=_WARMUP_TIMEOUT_S) as client:
        r = await client.post(_local_url(server_args) + "/generate", json=body, headers=headers)
    if r.status_code != 200:
        raise RuntimeError(f"warm-up /generate answered {r.status_code}: {r.text}")
    logger.info("Warm-up output: %r", r.json()["text"])


async def _serve(app: Any, tm: Any, server_args: ServerArgs, proc: mp.Process) -> bool:
    """Run uvicorn with the warm-up and the scheduler watchdog beside it; False if warm-up failed."""
    import uvicorn

    config = uvicorn.Config(app, host=server_args.host, port=server_args.port,
                            log_level=server_args.log_level, timeout_keep_alive=5,
                            access_log=server_args.log_level == "debug")
    server = uvicorn.Server(config)
    warm_up_failed = False

    async def watch_scheduler() -> None:
        while proc.is_alive():
            await asyncio.sleep(0.5)
        tm.scheduler_died(f"the scheduler process exited with code {proc.exitcode}")

    async def warm_up() -> None:
        nonlocal warm_up_failed
        while not server.started:
            await asyncio.sleep(0.05)
        try:
            if not server_args.skip_server_warmup:
                await _warm_up(server_args)
        except Exception as e:
            logger.error("Warm-up failed, shutting down: %s", e)
            warm_up_failed = True
            server.should_exit = True
            return
        tm.is_warm = True
        logger.info("The server is fired up and ready to roll!")

    tasks = [asyncio.create_task(watch_scheduler()), asyncio.create_task(warm_up())]
    try:
        await server.serve()
    finally:
        for t in tasks:
            t.cancel()
    return not warm_up_failed


def launch_server(server_args: ServerArgs) -> int:
    """Start everything and serve until stopped; the exit status.

    Args:
        server_args: the flags, resolved or not: the scheduler process resolves them (a
            no-op for resolved ones) and serving uses the resolved copy it sends back.
    Raises:
        InvalidServerArgs: `ServerArgs.resolve()` refused the flags.
    """
    from hiserve.engine.http_server import create_app
    from hiserve.engine.tokenizer_manager import TokenizerManager

    port_args = PortArgs.init_new()
    spawn = mp.get_context("spawn")
    reader, writer = spawn.Pipe(duplex=False)
    threads, why = scheduler_threads()
    logger.info("Scheduler compute threads: %d (%s); API process: 1", threads, why)
    _limit_api_threads()  # before the spawn too: the child starts from this environment
    proc = spawn.Process(target=_run_scheduler, args=(threads, server_args, port_args, writer),
                         name="hiserve-scheduler")
    start = time.monotonic()
    proc.start()
    writer.close()  # ours; the child holds its own copy, so its death closes the pipe
    try:
        server_args = _wait_for_resolved_args(proc, reader)
        _log_server_args(server_args)
        ready = _receive(proc, reader)
        logger.info("Scheduler ready in %.1f s: max_total_num_tokens=%d, max_req_input_len=%d, "
                    "context_len=%d, max_running_requests=%d", time.monotonic() - start,
                    ready.max_total_num_tokens, ready.max_req_input_len, ready.context_len,
                    ready.max_running_requests)
        tm = TokenizerManager(server_args, port_args, ready)  # tokenizer rebuilt from ready.tokenizer_spec
        ok = asyncio.run(_serve(create_app(tm), tm, server_args, proc))
        return 0 if ok else 1
    except RuntimeError as e:
        logger.error("%s", e)
        return 1
    finally:
        _stop_scheduler(proc)
        for name in (port_args.scheduler_input_ipc_name, port_args.tokenizer_ipc_name):
            try:
                os.unlink(name.removeprefix("ipc://"))
            except OSError:
                pass


def main(argv: list[str] | None = None) -> int:
    """Parse the flags (argv, default sys.argv) and serve; the exit status (2: bad flags)."""
    # SIGTERM leaves through SystemExit, so `finally` blocks (killing the scheduler) run.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    parser = server_args_parser()
    server_args = ServerArgs.from_cli_args(parser.parse_args(argv))  # resolved by the scheduler process
    logging.basicConfig(level=server_args.log_level.upper(),
                        format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    try:
        return launch_server(server_args)
    except InvalidServerArgs as e:
        parser.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
