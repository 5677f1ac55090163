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

With `--tp-size N` there are N scheduler processes, one per tensor-parallel rank: rank 0 is
started first and resolves the flags; ranks 1..N-1 are started with the resolved flags; all
meet at `--dist-init-addr` (default: a free local port) through torch.distributed. Only rank
0 talks to the API process; every rank's pipe reports its readiness (or its error).

The scheduler processes are killed whenever this process leaves, normally or by SIGTERM /
SIGINT. Ctrl-C: uvicorn stops accepting, gives open requests `_GRACEFUL_SHUTDOWN_S` to end,
then this process stops the schedulers and exits with status 130 (as a shell reports an
interrupted command), one log line and no traceback from either process. If the one
scheduler (TP 1) dies first, requests fail with 503 instead of waiting forever. With TP > 1
no rank can serve alone: when any rank exits, the server logs which one and with what code,
stops the others and exits with status 1 (the surviving ranks' pending collectives fail too,
or time out after `--dist-timeout`).

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

from hiserve.engine.signals import exit_on_sigterm
from hiserve.server_args import PortArgs, ServerArgs, server_args_parser

logger = logging.getLogger("hiserve.launch_server")

_WARMUP_PROMPT = "The capital city of France is"
_WARMUP_TIMEOUT_S = 600.0
# Ctrl-C / SIGTERM while serving: how long open requests (a long stream) may take to end
# before uvicorn closes them; unset, uvicorn waits for every one.
_GRACEFUL_SHUTDOWN_S = 5


class InvalidServerArgs(ValueError):
    """The flags cannot run here (`ServerArgs.resolve()` refused them in the scheduler
    process); `main` reports it as a usage error (exit status 2)."""


def scheduler_threads() -> tuple[int, str]:
    """Compute threads for the scheduler process and why (`hardware.cpu_compute_threads`),
    read before this process sets its own OMP_NUM_THREADS to 1."""
    from hiserve.hardware import cpu_compute_threads

    return cpu_compute_threads()


def _run_scheduler(num_threads: int, server_args: ServerArgs, port_args: PortArgs, writer: Any,
                   tp_rank: int = 0, dist_init_addr: str | None = None) -> None:
    """Scheduler process entry: size torch's and OpenMP's thread pools before torch loads,
    resolve the flags and send them back (the API process never imports torch to resolve
    them), then run the scheduler. Importing torch and the scheduler only here keeps them
    out of the API process, which pickles only a reference to this function.

    Pipe messages, in order: the resolved `ServerArgs` or an `InvalidServerArgs`, then (from
    `run_scheduler_process`) a `SchedulerReady` or an error string. TP ranks > 0 get resolved
    flags and send only the second message.
    """
    # Ctrl-C reaches the whole process group; the API process answers it by stopping this
    # one (SIGTERM), so a second traceback from here would only be noise. A do-nothing handler
    # rather than SIG_IGN: an ignored signal stays ignored in the compilers this process
    # starts (JIT builds), a handled one is reset to the default at their exec.
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    os.environ["OMP_NUM_THREADS"] = str(num_threads)
    import torch

    torch.set_num_threads(num_threads)
    tag = "scheduler" if server_args.tp_size == 1 else f"scheduler TP{tp_rank}"
    logging.basicConfig(level=server_args.log_level.upper(), format=f"[%(asctime)s {tag}] %(message)s")
    if tp_rank > 0:  # flags already resolved by rank 0
        from hiserve.engine.scheduler import run_scheduler_process

        run_scheduler_process(server_args, port_args, writer, tp_rank, dist_init_addr)
        return
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

    run_scheduler_process(server_args, port_args, writer, 0, dist_init_addr)


def _limit_api_threads() -> None:
    """One OpenMP thread in this process: its work is tokenizing and HTTP."""
    os.environ["OMP_NUM_THREADS"] = "1"


def _dead_ranks(procs: list[mp.Process]) -> str:
    """'' while every scheduler process lives, else which exited: 'the scheduler process
    (exit code c)' at TP 1, 'scheduler TP rank r (exit code c), ...' otherwise."""
    dead = [(r, p.exitcode) for r, p in enumerate(procs) if not p.is_alive()]
    if not dead:
        return ""
    if len(procs) == 1:
        return f"the scheduler process (exit code {dead[0][1]})"
    return ", ".join(f"scheduler TP rank {r} (exit code {c})" for r, c in dead)


def _peer_errors(readers: list[Any], skip: int) -> str:
    """Error strings other ranks have already sent (a rank that failed alone, e.g. out of
    memory on its GPU, says why there; the others only see a failed collective)."""
    errors = []
    for r, reader in enumerate(readers):
        try:
            if r != skip and reader.poll(0):
                msg = reader.recv()
                if isinstance(msg, str):
                    errors.append(f"TP rank {r}: {msg}")
        except (EOFError, OSError):
            pass
    return "".join("\n" + e for e in errors)


def _receive(procs: list[mp.Process], readers: list[Any], rank: int = 0) -> Any:
    """The next pipe message of scheduler rank `rank`; raises RuntimeError (with any error
    another rank sent) if any scheduler process dies first, or the rank sends an error string."""
    reader, tp = readers[rank], len(procs)
    who = "the scheduler process" if tp == 1 else f"scheduler TP rank {rank}"
    while not reader.poll(0.5):
        dead = _dead_ranks(procs)
        if dead and not reader.poll(0):
            raise RuntimeError(f"{dead} exited before the server was ready{_peer_errors(readers, rank)}")
    try:
        msg = reader.recv()
    except EOFError:
        raise RuntimeError(f"{who} closed its pipe before it was ready{_peer_errors(readers, rank)}") from None
    if isinstance(msg, str):
        raise RuntimeError(msg if tp == 1 else f"TP rank {rank}: {msg}{_peer_errors(readers, rank)}")
    return msg


def _wait_for_resolved_args(procs: list[mp.Process], readers: list[Any]) -> ServerArgs:
    """The frozen ServerArgs the scheduler process (TP rank 0) resolved.

    Raises:
        InvalidServerArgs: resolve() refused the flags.
        RuntimeError: the scheduler process died or failed first.
    """
    msg = _receive(procs, readers)
    if isinstance(msg, InvalidServerArgs):
        raise msg
    if not isinstance(msg, ServerArgs):
        raise RuntimeError(f"the scheduler process sent {type(msg).__name__} instead of the resolved ServerArgs")
    return msg


def _log_server_args(server_args: ServerArgs) -> None:
    # The key itself never reaches a log (nor /get_server_info, which redacts it too).
    shown = dataclasses.replace(server_args, api_key="<redacted>") if server_args.api_key else server_args
    logger.info("server_args: %s", shown)


def _stop_schedulers(procs: list[mp.Process]) -> None:
    """SIGTERM every scheduler process, then SIGKILL whichever is still alive after 5 s."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + 5
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def _free_local_addr() -> str:
    """127.0.0.1:<a free TCP port> where the TP ranks meet (no --dist-init-addr)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


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


async def _serve(app: Any, tm: Any, server_args: ServerArgs, procs: list[mp.Process]) -> bool:
    """Run uvicorn with the warm-up and the scheduler watchdog beside it; False if warm-up
    failed or (TP > 1) a rank exited, which stops the server."""
    import uvicorn

    config = uvicorn.Config(app, host=server_args.host, port=server_args.port,
                            log_level=server_args.log_level, timeout_keep_alive=5,
                            timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S,
                            access_log=server_args.log_level == "debug")
    server = uvicorn.Server(config)
    warm_up_failed = rank_died = False

    async def watch_scheduler() -> None:
        nonlocal rank_died
        while not (dead := _dead_ranks(procs)):
            await asyncio.sleep(0.5)
        if len(procs) == 1:
            tm.scheduler_died(f"the scheduler process exited with code {procs[0].exitcode}")
            return
        msg = f"{dead} exited; --tp-size {len(procs)} cannot serve without every rank: stopping the server"
        logger.error(msg)
        tm.scheduler_died(msg)
        rank_died = True
        server.should_exit = True

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
    return not (warm_up_failed or rank_died)


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
    tp = server_args.tp_size
    dist_addr = (server_args.dist_init_addr or _free_local_addr()) if tp > 1 else None
    threads, why = scheduler_threads()
    if tp > 1:  # the ranks share this machine's cores
        threads, why = max(1, threads // tp), f"{why}, shared by {tp} TP ranks"
    logger.info("Scheduler compute threads: %d (%s); API process: 1", threads, why)
    _limit_api_threads()  # before the spawn too: the child starts from this environment
    readers, procs = [], []

    def start_rank(rank: int, args: ServerArgs) -> None:
        reader, writer = spawn.Pipe(duplex=False)
        proc = spawn.Process(target=_run_scheduler, args=(threads, args, port_args, writer, rank, dist_addr),
                             name="hiserve-scheduler" if tp == 1 else f"hiserve-scheduler-tp{rank}")
        # The child inherits an ignored SIGINT until _run_scheduler installs its handler: a
        # Ctrl-C while it starts the interpreter and unpickles its arguments stays quiet too.
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            proc.start()
        finally:
            signal.signal(signal.SIGINT, old)
        writer.close()  # ours; the child holds its own copy, so its death closes the pipe
        readers.append(reader)
        procs.append(proc)

    start = time.monotonic()
    start_rank(0, server_args)
    try:
        server_args = _wait_for_resolved_args(procs, readers)
        _log_server_args(server_args)
        for rank in range(1, tp):  # with rank 0's resolved flags: every rank runs the same
            start_rank(rank, server_args)
        ready = _receive(procs, readers)
        for rank in range(1, tp):
            _receive(procs, readers, rank)
        logger.info("Scheduler ready in %.1f s: max_total_num_tokens=%d, max_req_input_len=%d, "
                    "context_len=%d, max_running_requests=%d, tp_size=%d", time.monotonic() - start,
                    ready.max_total_num_tokens, ready.max_req_input_len, ready.context_len,
                    ready.max_running_requests, tp)
        tm = TokenizerManager(server_args, port_args, ready)  # tokenizer rebuilt from ready.tokenizer_spec
        ok = asyncio.run(_serve(create_app(tm), tm, server_args, procs))
        return 0 if ok else 1
    except RuntimeError as e:
        logger.error("%s", e)
        return 1
    finally:
        _stop_schedulers(procs)
        for name in (port_args.scheduler_input_ipc_name, port_args.tokenizer_ipc_name):
            try:
                os.unlink(name.removeprefix("ipc://"))
            except OSError:
                pass


def main(argv: list[str] | None = None) -> int:
    """Parse the flags (argv, default sys.argv) and serve; the exit status (2: bad flags)."""
    # SIGTERM leaves through SystemExit, so `finally` blocks (killing the scheduler) run.
    exit_on_sigterm()
    parser = server_args_parser()
    server_args = ServerArgs.from_cli_args(parser.parse_args(argv))  # resolved by the scheduler process
    logging.basicConfig(level=server_args.log_level.upper(),
                        format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    try:
        return launch_server(server_args)
    except InvalidServerArgs as e:
        parser.error(str(e))
    # Ctrl-C: during start-up, or while serving (uvicorn shuts down, then re-raises the SIGINT
    # it caught; asyncio.run turns it into KeyboardInterrupt); `finally` stopped the schedulers.
    except KeyboardInterrupt:
        logger.info("Interrupted; the scheduler processes were stopped")
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
