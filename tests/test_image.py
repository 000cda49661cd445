"""The CPU image (docker/Dockerfile, target ``cpu``), built with real podman from this checkout
(``make image-cpu``; podman's layer cache makes a rebuild after a code change ~1-2 min) and run
for real. The reference is ``dflash-trt generate`` on the host, greedy, on a real prompt (GSM8K
test 0):

* ``podman run IMAGE generate`` on the same prompt prints the same text and token count;
* ``podman run IMAGE serve`` (OpenAI server, port published to the host): the ``openai`` client's
  chat completion from the host returns the same text and token count;
* ``podman run IMAGE triton-serve`` on the image's Triton repository (host network: tritonserver
  binds 127.0.0.1): HTTP ``generate`` and a tritonclient gRPC stream from the host return the same
  text and token count;
* the image's labels and torch build say CPU;
* the GPU architecture check of the entrypoint (the script the hopper and blackwell images run),
  with a fake ``nvidia-smi`` bind-mounted into the container: a mismatching GPU (or none) gets one
  line and exit status 2, a matching one runs ``dflash-trt``.

podman is required: without it every test here fails (CI installs it, see ``.ci/run``).
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import wait_for_image_build
from helpers import TLS, free_ports

ROOT = Path(__file__).resolve().parents[1]
IMAGE = os.environ.get("DFLASH_TRT_TEST_IMAGE", "localhost/dflash-trt:cpu")
PROMPT_FROM = "gsm8k:0"
MAX_NEW = 32
PODMAN_ENV = {
    **os.environ,
    "CONTAINERS_CONF": str(ROOT / "docker" / "podman" / "containers.conf"),
    "CONTAINERS_STORAGE_CONF": str(ROOT / "docker" / "podman" / "storage.conf"),
}
STATS = re.compile(r"^\[(\d+) tokens in .*finish: (\w+)\]$")
#: the test process's OpenMP thread count, given to the containers that run the model: under
#: pytest-xdist (`make test`) conftest sets OMP_NUM_THREADS=1 for the commands tests start, and a
#: container does not inherit it; with all cores' threads beside the other worker, the servers'
#: start-up (the adaptive draft length's calibration) ran ~4x slower on the 2-core machine
THREADS = ["-e", f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"] if os.environ.get("OMP_NUM_THREADS") else []


def podman(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["podman", *args], env=PODMAN_ENV, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode:
        pytest.fail(f"podman {' '.join(args[:3])} ... exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return proc


def parse_generate(stdout: str, prompt: str) -> tuple[str, int, str]:
    """(completion text, token count, finish reason) from ``dflash-trt generate --prompt-from``'s output:
    the prompt echo, the streamed text, then one stats line."""
    head = f"[{PROMPT_FROM}] {prompt}\n\n"
    assert stdout.startswith(head), stdout[:300]
    body, _, last = stdout[len(head) :].rstrip("\n").rpartition("\n")
    m = STATS.match(last)
    assert m, f"no stats line at the end of generate's output: {last!r}"
    return body, int(m.group(1)), m.group(2)


@pytest.fixture(scope="module")
def image():
    """``make image-cpu`` (fails, does not skip, without podman): the build conftest started in
    the background at collection, waited for here, or (when there is none) a build run now."""
    if shutil.which("podman") is None:
        pytest.fail("podman is not installed: the image tests need it (apt-get install podman runc ..., see .ci/run)")
    build = wait_for_image_build()
    if build is not None:
        code, out, took = build
    else:
        t = time.time()
        proc = subprocess.run(["make", "image-cpu"], cwd=ROOT, capture_output=True, text=True, timeout=3600)
        code, out, took = proc.returncode, proc.stdout + proc.stderr, f"{time.time() - t:.0f} s"
    assert code == 0, f"make image-cpu failed:\n{out[-4000:]}"
    print(f"\nmake image-cpu: {took}", file=sys.stderr)
    return IMAGE


@pytest.fixture(scope="module")
def prompt():
    from dflash_trt.prompts import load_prompts

    return load_prompts("gsm8k", 1)[0]


@pytest.fixture(scope="module")
def host_reference(prompt):
    """``dflash-trt generate`` on the host, as a user runs it (no TRITON_INTERPRET from conftest)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    exe = Path(sys.executable).parent / "dflash-trt"
    proc = subprocess.run(
        [str(exe), "generate", "--prompt-from", PROMPT_FROM, "--max-new-tokens", str(MAX_NEW)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return parse_generate(proc.stdout, prompt)


@pytest.fixture()
def container():
    """Start containers (``podman run -d``) and remove them at the end of the test."""
    names = []

    def start(*args: str) -> str:
        name = f"dflash-test-{uuid.uuid4().hex[:8]}"
        names.append(name)
        podman("run", "-d", "--rm", "--init", "--name", name, *args)
        return name

    yield start
    for name in names:
        podman("rm", "-f", "-t", "0", name, check=False)


def wait_ready(url: str, name: str, timeout_s: float = 600) -> None:
    end = time.time() + timeout_s
    while time.time() < end:
        try:
            if httpx.get(url, timeout=2, verify=TLS).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if podman("container", "exists", name, check=False).returncode:
            pytest.fail(f"container {name} exited before {url} was ready")
        time.sleep(1)
    logs = podman("logs", name, check=False)
    pytest.fail(f"{url} not ready within {timeout_s:.0f} s; container log: {(logs.stdout + logs.stderr)[-2000:]}")


def test_labels_and_cpu_torch(image):
    labels = podman("image", "inspect", "--format", "{{json .Labels}}", image).stdout
    assert '"dflash-trt.flavor":"cpu"' in labels and "CPU build" in labels, labels
    versions = podman("run", "--rm", "--entrypoint", "cat", image, "/opt/dflash-trt/versions.txt").stdout
    assert re.search(r"^torch==2\.\d+\.\d+\+cpu$", versions, re.M), versions
    assert not re.search(r"^nvidia-cu", versions, re.M), "a CUDA library is installed in the CPU image"


def test_generate_in_container_matches_host(image, prompt, host_reference):
    proc = podman(
        "run", "--rm", *THREADS, image, "generate", "--prompt-from", PROMPT_FROM, "--max-new-tokens", str(MAX_NEW)
    )
    assert parse_generate(proc.stdout, prompt) == host_reference
    print(f"\ngenerate (host = container): {host_reference[1]} tokens: {host_reference[0]!r}", file=sys.stderr)


def test_openai_server_in_container(image, container, prompt, host_reference):
    from openai import OpenAI

    (port,) = free_ports(1)
    name = container("-p", f"127.0.0.1:{port}:8000", *THREADS, image, "serve", "--host", "0.0.0.0", "--port", "8000")
    wait_ready(f"http://127.0.0.1:{port}/health", name)
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    model = client.models.list().data[0].id
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_NEW, temperature=0
    )
    assert (r.choices[0].message.content, r.usage.completion_tokens, r.choices[0].finish_reason) == host_reference


def test_triton_server_in_container(image, container, prompt, host_reference):
    import tritonclient.grpc as grpcclient
    from transformers import AutoTokenizer

    from dflash_trt.checkpoints.sources import resolve_target
    from dflash_trt.prompts import chat_prompt_ids

    # Triton's text_input is tokenized as is: send the chat-templated prompt, as TensorRT-LLM clients do
    tok = AutoTokenizer.from_pretrained(str(resolve_target(None)))
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    assert tok.encode(text) == chat_prompt_ids(tok, prompt)
    http, grpc, metrics = free_ports(3)
    name = container(
        "--network", "host", *THREADS, image, "triton-serve", "--repo", "/opt/dflash-trt/triton-repo",
        "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
    )  # fmt: skip
    url = f"http://127.0.0.1:{http}"
    wait_ready(f"{url}/v2/models/dflash/ready", name)

    body = {"text_input": text, "max_tokens": MAX_NEW, "exclude_input_in_output": True}
    r = httpx.post(f"{url}/v2/models/dflash/generate", json=body, timeout=600).json()
    assert (r["text_output"], r["num_output_tokens"], r["finish_reason"]) == host_reference, r

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc}")
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    inputs = []
    for key, arr, dtype in (
        ("text_input", np.array([[text.encode()]], dtype=np.object_), "BYTES"),
        ("max_tokens", np.array([[MAX_NEW]], dtype=np.int32), "INT32"),
        ("stream", np.array([[True]], dtype=bool), "BOOL"),
    ):
        inputs.append(grpcclient.InferInput(key, list(arr.shape), dtype))
        inputs[-1].set_data_from_numpy(arr)
    client.async_stream_infer("dflash", inputs, request_id="0")
    pieces, count, reason = [], 0, ""
    while not reason:
        result, error = got.get(timeout=600)
        assert error is None, error
        pieces.append(result.as_numpy("text_output").reshape(-1)[0].decode())
        count += int(result.as_numpy("num_output_tokens").reshape(-1)[0])
        reason = result.as_numpy("finish_reason").reshape(-1)[0].decode()
    client.stop_stream()
    client.close()
    assert ("".join(pieces), count, reason) == host_reference


def _fake_nvidia_smi(tmp_path: Path, caps: list[str]) -> Path:
    f = tmp_path / "nvidia-smi"
    lines = "".join(f"echo {c}\n" for c in caps)
    f.write_text(f"#!/bin/sh\n# fake nvidia-smi: --query-gpu=compute_cap answers\n{lines}")
    f.chmod(0o755)
    return f


@pytest.mark.parametrize(
    "archs, caps, bad",
    [
        ("sm_90a", ["8.0"], "8.0"),  # an A100 under the hopper image
        ("sm_90a", ["9.0", "8.6"], "8.6"),  # one of two GPUs does not match
        ("sm_90a", [], "none"),  # no GPU visible
        ("sm_90a", ["9.0", "9.0"], None),
        ("sm_100a,sm_103a", ["9.0"], "9.0"),  # an H100 under the blackwell image
        ("sm_100a,sm_103a", ["10.3"], None),
    ],
)
def test_gpu_arch_check(image, tmp_path, archs, caps, bad):
    """The GPU images' entrypoint check, in the CPU image with the GPU images' environment and a
    fake nvidia-smi (the hopper / blackwell images run the same script)."""
    mount = [] if not caps else ["-v", f"{_fake_nvidia_smi(tmp_path, caps)}:/usr/local/bin/nvidia-smi:ro"]
    env = ["-e", f"DFLASH_TRT_CUDA_ARCHS={archs}", "-e", "DFLASH_TRT_FLAVOR=gpu-test"]
    proc = podman("run", "--rm", *env, *mount, image, "--help", check=False)
    if bad is None:
        assert proc.returncode == 0 and "usage: dflash-trt" in proc.stdout, proc.stderr
        return
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and proc.stdout == "", proc.stderr
    expect = "no NVIDIA GPU visible" if bad == "none" else f"compute capability {bad} "
    assert expect in lines[0] and archs in lines[0], lines[0]
    print(f"\n{lines[0]}", file=sys.stderr)
