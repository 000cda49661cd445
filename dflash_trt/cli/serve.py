"""``dflash-trt serve`` (the OpenAI-compatible server), ``triton-repo`` (a Triton Inference Server
model repository serving the runtime) and ``triton-serve`` (tritonserver on such a repository)."""

from __future__ import annotations

import os
import sys

from ..engine_args import EngineArgs
from ..errors import DFlashError
from . import flags

#: serving's engine defaults: the adaptive draft length (never slower than plain decoding by its model)
SERVE_DEFAULTS = {"adaptive": True}


def register(sub) -> None:
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (vLLM's wire format) on the runtime")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument(
        "--api-key",
        default=os.environ.get("DFLASH_TRT_API_KEY"),
        help="require `Authorization: Bearer KEY` on /v1 endpoints (default: $DFLASH_TRT_API_KEY; none)",
    )
    _serving_flags(sv)
    flags.add(sv, "threads")
    sv.set_defaults(run=run_serve)

    tr = sub.add_parser("triton-repo", help="write a Triton Inference Server model repository serving the runtime")
    flags.add(tr, "out", out={"help": "model repository to create"})
    tr.add_argument("--instances", type=int, default=1, help="model instances (each its own engine)")
    _serving_flags(tr)
    tr.set_defaults(run=run_triton_repo)

    ts = sub.add_parser("triton-serve", help="run tritonserver (from the nvidia-pytriton wheel) on a repository")
    ts.add_argument("--repo", required=True, help="model repository from `dflash-trt triton-repo`")
    ts.add_argument("--http-port", type=int, default=8001)
    ts.add_argument("--grpc-port", type=int, default=8002)
    ts.add_argument("--metrics-port", type=int, default=8003)
    ts.set_defaults(run=run_triton_serve)


def _serving_flags(p) -> None:
    """What both servers take: the engine's settings and the serving limits."""
    flags.add(p, "model_name")
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=256,
        help="most requests waiting for admission; beyond it HTTP 503 with Retry-After (-1: no bound)",
    )
    EngineArgs.add_cli_args(p, defaults=SERVE_DEFAULTS)


def serve_config(args):
    """The :class:`~dflash_trt.serving.service.ServeConfig` of the flags."""
    from ..serving.service import ServeConfig

    limit = None if args.max_waiting_requests == -1 else args.max_waiting_requests
    return ServeConfig(EngineArgs.from_cli_args(args), args.model_name, limit)


def run_serve(args) -> None:
    import socket

    try:
        import uvicorn

        from ..serving.openai_api import build_app
        from ..serving.service import EngineService
    except ImportError as e:
        raise DFlashError(f"serve needs fastapi, uvicorn and prometheus_client (pip install them): {e}") from None
    if not 0 < args.port < 65536:
        raise DFlashError(f"--port must be 1..65535, got {args.port}")
    with socket.socket() as s:  # fail early and in one line when the address is taken
        try:
            s.bind((args.host, args.port))
        except OSError as e:
            raise DFlashError(f"cannot listen on {args.host}:{args.port} ({e.strerror})") from None
    flags.setup_threads(args.threads)
    service = EngineService(serve_config(args))
    if service.worker:  # a TP worker rank under mpiexec: rank 0 served and has stopped
        return
    print(
        f"serving {service.model_name} ({service.dtype}, {service.device}) on http://{args.host}:{args.port}/v1",
        file=sys.stderr,
        flush=True,
    )
    try:
        uvicorn.run(build_app(service, api_key=args.api_key), host=args.host, port=args.port, log_level="warning")
    finally:
        service.close()


def run_triton_repo(args) -> None:
    from ..serving.triton_repo import write_repo

    out = write_repo(args.out, serve_config(args), args.max_batch_size, args.instances)
    print(f"wrote {out} (model dflash); start it with: dflash-trt triton-serve --repo {out}")


def run_triton_serve(args) -> None:
    from ..serving.triton_repo import start_server

    proc = start_server(args.repo, args.http_port, args.grpc_port, args.metrics_port)
    print(
        f"tritonserver ready: HTTP http://127.0.0.1:{args.http_port}, gRPC 127.0.0.1:{args.grpc_port}, "
        f"metrics http://127.0.0.1:{args.metrics_port}/metrics (Ctrl-C stops it)",
        flush=True,
    )
    try:
        proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait(30)
        raise
    if proc.returncode:
        raise DFlashError(f"tritonserver exited with status {proc.returncode}")
