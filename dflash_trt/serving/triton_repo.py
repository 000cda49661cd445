"""A Triton Inference Server model repository for dflash-trt, and the server itself from the
``nvidia-pytriton`` wheel (tritonserver 2.51 with the python backend).

Repository (``dflash-trt triton-repo --out REPO``)::

    REPO/dflash/config.pbtxt   python backend, decoupled, max_batch_size > 0, TensorRT-LLM's
                               ensemble tensor names (:mod:`.triton_model`), the served model and
                               engine knobs as the ``dflash_config`` parameter (JSON)
    REPO/dflash/1/model.py     imports :class:`dflash_trt.serving.triton_model.TritonPythonModel`

Server (``dflash-trt triton-serve --repo REPO``): the wheel's ``tritonserver`` folder is copied
(once per Python version, under the cache) with the python-backend stub built for the running
interpreter; the server runs with this interpreter's environment first on ``PATH`` (the stub
imports ``dflash_trt`` and ``numpy`` from there: it must have numpy < 2) and its ``LIBDIR`` first
on ``LD_LIBRARY_PATH`` (the stub must load the same libpython), bound to 127.0.0.1.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from ..atomic import atomic_dir
from ..errors import ConfigError, DFlashError
from .service import ServeConfig
from .triton_model import INPUTS, OUTPUTS

MODEL_NAME = "dflash"
MODEL_SHIM = '''"""dflash-trt's Triton python-backend model (the code lives in the dflash_trt package)."""

from dflash_trt.serving.triton_model import TritonPythonModel  # noqa: F401
'''


def config_pbtxt(cfg: ServeConfig, max_batch_size: int, instances: int, cancellation_check_period_ms: int) -> str:
    """The model's ``config.pbtxt`` text."""

    def tensor(name, dtype, dims, optional=False):
        opt = " optional: true" if optional else ""
        return f'  {{ name: "{name}" data_type: {dtype} dims: [ {", ".join(map(str, dims))} ]{opt} }}'

    inputs = ",\n".join(tensor(*x) for x in INPUTS)
    outputs = ",\n".join(tensor(*x) for x in OUTPUTS)
    params = {
        "dflash_config": cfg.to_json(),
        "cancellation_check_period_ms": str(cancellation_check_period_ms),
    }
    param_text = "\n".join(
        f'parameters {{ key: "{k}" value: {{ string_value: {json.dumps(v)} }} }}' for k, v in params.items()
    )
    return (
        f'name: "{MODEL_NAME}"\nbackend: "python"\nmax_batch_size: {max_batch_size}\n'
        "model_transaction_policy { decoupled: true }\n"
        f"input [\n{inputs}\n]\noutput [\n{outputs}\n]\n"
        f"instance_group [ {{ count: {instances} kind: KIND_CPU }} ]\n{param_text}\n"
    )


def write_repo(
    out: str | os.PathLike,
    cfg: ServeConfig,
    max_batch_size: int = 64,
    instances: int = 1,
    cancellation_check_period_ms: int = 100,
) -> Path:
    """Write the model repository (layout in the module docstring), atomically.

    Raises:
        DFlashError: ``out`` exists, ``max_batch_size`` < 1, ``instances`` < 1, or a checkpoint /
            engine path that does not exist.
    """
    out = Path(out).expanduser()
    if out.exists():
        raise DFlashError(f"{out} already exists; choose a new directory for the model repository")
    if max_batch_size < 1 or instances < 1:
        raise DFlashError(f"max_batch_size and instances must be >= 1, got {max_batch_size} and {instances}")
    paths = {}
    for key in ("model", "drafter", "engine"):  # absolute: tritonserver runs the model elsewhere
        v = getattr(cfg.engine_args, key)
        if v is not None:
            p = Path(v).expanduser().resolve()
            if not p.exists():
                raise ConfigError(key, f"{v} does not exist")
            paths[key] = str(p)
    cfg = dataclasses.replace(cfg, engine_args=cfg.engine_args.replace(**paths))
    with atomic_dir(out) as tmp:
        (tmp / MODEL_NAME / "1").mkdir(parents=True)
        (tmp / MODEL_NAME / "config.pbtxt").write_text(
            config_pbtxt(cfg, max_batch_size, instances, cancellation_check_period_ms)
        )
        (tmp / MODEL_NAME / "1" / "model.py").write_text(MODEL_SHIM)
    return out


def _server_dir() -> Path:
    """tritonserver from the nvidia-pytriton wheel with this interpreter's python-backend stub."""
    try:
        import pytriton
    except ImportError:
        raise DFlashError("triton-serve needs the nvidia-pytriton wheel (pip install nvidia-pytriton)") from None
    from ..checkpoints.sources import cache_root

    src = Path(pytriton.__file__).parent / "tritonserver"
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    stub = src / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise DFlashError(f"nvidia-pytriton has no python-backend stub for Python {version}")
    dest = cache_root() / "tritonserver" / version
    if not (dest / "backends" / "python" / "triton_python_backend_stub").is_file():
        with atomic_dir(dest, replace=True) as tmp:
            shutil.copytree(
                src,
                tmp,
                dirs_exist_ok=True,
                ignore=shutil.ignore_patterns("python_backend_stubs", "triton_python_backend_stub"),
            )
            shutil.copy(stub, tmp / "backends" / "python" / "triton_python_backend_stub")
    return dest


def server_command(
    repo: str | os.PathLike, http_port: int, grpc_port: int, metrics_port: int
) -> tuple[list[str], dict]:
    """The ``tritonserver`` command line and environment for ``repo`` (see the module docstring).

    Raises:
        DFlashError: nvidia-pytriton missing, ``repo`` not a dflash model repository.
    """
    repo = Path(repo).expanduser().resolve()
    if not (repo / MODEL_NAME / "config.pbtxt").is_file():
        raise DFlashError(f"{repo} is not a dflash-trt model repository (no {MODEL_NAME}/config.pbtxt)")
    srv = _server_dir()
    import pytriton

    libs = Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs"
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    ld = [sysconfig.get_config_var("LIBDIR") or "", str(libs), env.get("LD_LIBRARY_PATH", "")]
    env["LD_LIBRARY_PATH"] = ":".join(p for p in ld if p)
    cmd = [
        str(srv / "bin" / "tritonserver"),
        f"--model-repository={repo}",
        f"--backend-directory={srv / 'backends'}",
        f"--cache-directory={srv / 'caches'}",
        "--http-address=127.0.0.1",
        f"--http-port={http_port}",
        "--grpc-address=127.0.0.1",
        f"--grpc-port={grpc_port}",
        "--metrics-address=127.0.0.1",
        f"--metrics-port={metrics_port}",
        "--allow-metrics=true",
        "--log-verbose=0",
        "--exit-on-error=true",
    ]
    return cmd, env


def start_server(
    repo: str | os.PathLike,
    http_port: int = 8001,
    grpc_port: int = 8002,
    metrics_port: int = 8003,
    timeout_s: float = 600.0,
    log_path: str | os.PathLike | None = None,
) -> subprocess.Popen:
    """Start tritonserver on ``repo`` (its output to ``log_path``, default
    ``<cache>/tritonserver/server-<http_port>.log``) and wait until ``dflash`` is ready.

    Raises:
        DFlashError: the server exits or is not ready within ``timeout_s`` (the last line of
            its log is in the message).
    """
    import urllib.request

    from ..checkpoints.sources import cache_root

    cmd, env = server_command(repo, http_port, grpc_port, metrics_port)
    log_path = Path(log_path or cache_root() / "tritonserver" / f"server-{http_port}.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    end = time.time() + timeout_s
    url = f"http://127.0.0.1:{http_port}/v2/models/{MODEL_NAME}/ready"
    while time.time() < end:
        if proc.poll() is not None:
            lines = [x for x in log_path.read_text(errors="replace").splitlines() if x.strip()]
            raise DFlashError(
                f"tritonserver exited with status {proc.returncode} ({log_path}): {lines[-1] if lines else 'no output'}"
            )
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise DFlashError(f"tritonserver was not ready within {timeout_s:.0f} s")
