"""The ``dflash-trt`` command as a user runs it: happy paths on the real model, and bad input
giving one line on stderr, exit status 2 and no traceback (in-process through ``main``, and once
in a subprocess for the exit-status contract); every flag declared in one place; every command
line of README.md accepted by the real parser, the cheap ones run."""

from __future__ import annotations

import ast
import json
import re
import shlex
import shutil
from collections import Counter
from dataclasses import fields
from pathlib import Path

import pytest
from helpers import error_line, main_error, run

from dflash_trt.cli import build_parser, main

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def mismatched_drafter(tmp_path_factory, smollm2, random_drafter):
    """A drafter whose config says it was made for a 24-layer target (SmolLM2 has 30)."""
    from dflash_trt.checkpoints.zlab import save_drafter

    good = save_drafter(random_drafter, tmp_path_factory.mktemp("d") / "drafter")
    bad = good.parent / "mismatched"
    shutil.copytree(good, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["num_target_layers"] = 24
    (bad / "config.json").write_text(json.dumps(cfg))
    return bad


@pytest.mark.parametrize(
    "args, expect",
    [
        (["bench", "--dataset", "foo"], "unknown dataset 'foo'"),
        (["generate", "--prompt", "hi", "--target", "/nonexistent/model"], "target not found"),
        (["generate", "--prompt", "hi", "--drafter", "/nonexistent/drafter"], "drafter not found"),
        (["generate", "--prompt", "hi", "--block-size", "32"], "above the drafter's block_size 8"),  # shipped
        (["generate", "--prompt", "hi", "--temperature", "-0.5"], "temperature must be a finite number >= 0"),
        (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["bench", "--peers", "tgi"], "unknown peer 'tgi'"),
        (["generate", "--prompt", "hi", "--dtype", "int3"], "--dtype 'int3' is unknown"),
        (["generate"], "--prompt"),
        (["generate", "--prompt", "hi", "--cuda-graphs", "--device", "cpu"], "--cuda-graphs needs a CUDA device"),
        (["bench", "--cuda-graphs", "--device", "cpu", "--concurrency", "2"], "--cuda-graphs needs a CUDA device"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_input_one_line(args, expect, capsys):
    assert expect in main_error(capsys, *args)


def test_exit_status_contract_in_a_subprocess():
    """What a shell sees: status 2 and the one line, from a real process (the other bad-input
    cases run in-process through ``main``)."""
    assert "above the drafter's block_size 8" in error_line(run("generate", "--prompt", "hi", "--block-size", "32"))


def _settings_flags(cls) -> list[str]:
    """The flags a settings dataclass declares through its fields' metadata."""
    from dflash_trt.argspec import flag_of

    out = []
    for f in fields(cls):
        if "help" in f.metadata:
            out += list(f.metadata["flags"]) or [flag_of(cls, f.name)]
    return out


def test_no_flag_declared_twice():
    """Each flag of ``dflash-trt`` is written once: in an ``add_argument`` call of the command
    modules, in the shared table (``cli/flags.SHARED``) or as a settings field (``EngineArgs``,
    ``TrainConfig``); commands take shared ones from there. Fails on any second declaration."""
    from dflash_trt.cli import flags
    from dflash_trt.engine_args import EngineArgs
    from dflash_trt.training.config import TrainConfig

    declared: Counter = Counter()
    for path in sorted((ROOT / "dflash_trt" / "cli").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                for a in node.args:
                    if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("--"):
                        declared[a.value] += 1
    for names, _ in flags.SHARED.values():
        declared.update(names)
    declared.update(_settings_flags(EngineArgs) + _settings_flags(TrainConfig))
    twice = {f: n for f, n in declared.items() if n > 1}
    assert not twice, f"flags declared more than once: {twice}"
    # every flag a command takes comes from one of those declarations
    parser = build_parser()
    sub = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict))
    seen = {opt for p in sub.choices.values() for a in p._actions for opt in a.option_strings if opt.startswith("--")}
    seen -= {"--help"}
    assert seen <= set(declared) | {f"--no-{f[2:]}" for f in declared}, seen - set(declared)


def readme_commands() -> list[list[str]]:
    """Every ``dflash-trt`` command line in README.md's shell blocks (continuation lines joined,
    comments and an ``mpiexec -n N`` prefix dropped), as argument lists."""
    text = (ROOT / "README.md").read_text()
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if "dflash-trt " not in line or line.startswith("#"):
                continue
            words = shlex.split(line[line.index("dflash-trt ") :])
            cmds.append(words[1:])
    return cmds


def test_readme_commands_run_as_written(tmp_path, capsys):
    """Every command line of the README parses with the real parser (a flag it names that no
    longer exists fails here); the cheap ones run: ``plan`` of a shape, and ``init-drafter``."""
    cmds = readme_commands()
    assert len(cmds) >= 15, cmds
    parser = build_parser()
    for argv in cmds:
        try:
            parser.parse_args(argv)
        except Exception as e:  # (the parser raises DFlashError with argparse's message)
            pytest.fail(f"README: dflash-trt {' '.join(argv)}: {e}")
    plans = [a for a in cmds if a[0] == "plan"]
    assert plans
    for argv in plans:
        assert main(argv) == 0, capsys.readouterr().err
        assert "KV" in capsys.readouterr().out
    [init] = [a for a in cmds if a[0] == "init-drafter"]
    out = tmp_path / "drafter"
    argv = [x if x != "path/to/hf_dir" else "" for x in init]
    argv[argv.index("--out") + 1] = str(out)
    argv = [x for i, x in enumerate(argv) if not (x == "--target" or (i and argv[i - 1] == "--target"))]
    assert main(argv) == 0, capsys.readouterr().err
    assert (out / "config.json").is_file()


def test_corrupt_target_files(tmp_path, capsys):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"not a gguf at all")
    assert "not a GGUF file" in main_error(capsys, "generate", "--prompt", "hi", "--target", str(gguf))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama", "vocab_size": 10')
    assert "not valid JSON" in main_error(capsys, "generate", "--prompt", "hi", "--target", str(hf))


def test_corrupt_drafter_weights(tmp_path, mismatched_drafter, capsys):
    bad = tmp_path / "corrupt"
    shutil.copytree(mismatched_drafter, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 3])
    assert "corrupt" in main_error(capsys, "generate", "--prompt", "hi", "--drafter", str(bad))


def test_drafter_target_mismatch(mismatched_drafter, capsys):
    line = main_error(capsys, "generate", "--prompt", "hi", "--drafter", str(mismatched_drafter))
    assert "drafter does not match target" in line and "24-layer" in line


def test_generate_streams_and_reports(tmp_path, random_drafter, capsys):
    """In this process (``main``); the subprocess test above holds the process's exit status."""
    from dflash_trt.checkpoints.zlab import save_drafter

    d = save_drafter(random_drafter, tmp_path / "drafter")
    capsys.readouterr()
    args = ["generate", "--prompt-from", "gsm8k:0", "--max-new-tokens", "12", "--block-size", "4", "--drafter", str(d)]
    rc = main(args)
    out, err = capsys.readouterr()
    assert rc == 0, err[-2000:]
    last = out.strip().splitlines()[-1]
    assert "tau" in last and "tok/s" in last and "12 tokens" in last
    assert "Janet" in out  # the prompt is echoed


def test_bench_json(tmp_path, capsys):
    """In this process (``main``): a subprocess added ~15 s of imports and loading to the run."""
    out = tmp_path / "bench.json"
    capsys.readouterr()
    rc = main(
        [
            "bench",
            "--dataset",
            "humaneval",
            "--num-prompts",
            "2",
            "--max-new-tokens",
            "8",
            "--block-size",
            "4",
            "--peers",
            "hf",
            "--prompt-lookup-min",
            "2",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "b.png"),
        ]
    )
    proc = capsys.readouterr()
    assert rc == 0, proc.err[-2000:]
    r = json.loads(out.read_text())
    for key in (
        "dataset",
        "num_prompts",
        "max_new_tokens",
        "block_size",
        "temperature",
        "target",
        "drafter",
        "device",
        "threads",
        "lossless",
        "tau",
        "acceptance_per_position",
        "ar_tokens_per_s",
        "dflash_tokens_per_s",
        "speedup",
        "verify_cost_ratio",
        "draft_cost_ratio",
        "peers",
    ):
        assert key in r, key
    assert r["dataset"] == "humaneval" and r["num_prompts"] == 2 and r["block_size"] == 4
    assert r["lossless"] is True and r["adaptive"] is False and r["mean_draft_tokens"] > 0
    assert len(r["acceptance_per_position"]) == 3
    assert 1.0 <= r["tau"] <= 4.0
    assert r["peers"]["hf"]["tokens_per_s"] > 0 and r["peers"]["hf"]["identical_to_ar"] is True
    lk = r["prompt_lookup"]  # the third mode, DFlash with prompt-lookup tokens merged in (fp32: exact)
    assert lk["tokens_per_s"] > 0 and lk["lossless"] is True and len(lk["acceptance_per_position"]) == 3
    assert (lk["min_n"], lk["max_n"]) == (2, 4) and 0 <= lk["lookup_step_share"] <= 1
    assert "plain decoding" in proc.out and "peer: hf" in proc.out and "DFlash + lookup" in proc.out
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_batch1_adaptive(tmp_path, capsys):
    """``bench --adaptive`` without ``--concurrency``: the DFlash mode runs the adaptive
    draft-length controller as serving does (at most block size - 1 drafts a step, as many as it
    chooses), still token for token plain decoding's; the table says so."""
    out = tmp_path / "bench.json"
    capsys.readouterr()
    argv = ["bench", "--num-prompts", "2", "--max-new-tokens", "12", "--block-size", "4", "--adaptive"]
    rc = main([*argv, "--json", str(out)])
    proc = capsys.readouterr()
    assert rc == 0, proc.err[-2000:]
    r = json.loads(out.read_text())
    assert r["adaptive"] is True and 0 <= r["mean_draft_tokens"] <= 3 and r["lossless"] is True
    assert "DFlash (ours, K<=4)" in proc.out and "drafts/step" in proc.out and "(mean, adaptive)" in proc.out


def test_init_drafter_writes_loadable_drafter(tmp_path, capsys):
    out = tmp_path / "d"
    proc = run("init-drafter", "--layers", "1", "--block-size", "8", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    from dflash_trt.checkpoints.zlab import load_drafter

    d = load_drafter(out)
    assert d.cfg.num_layers == 1 and d.cfg.block_size == 8 and d.cfg.num_target_layers == 30
    assert "already exists" in main_error(capsys, "init-drafter", "--out", str(out))


def test_distill_then_train(tmp_path, capsys):
    """The training path from the command line (``main``, in this process: two subprocesses added
    ~30 s of imports and loading): self-distilled data, a few steps, a drafter."""
    data, run_dir = tmp_path / "data", tmp_path / "run"
    distill = ["distill", "--out", str(data), "--word-problems", "--num-prompts", "3", "--max-new-tokens", "6"]
    assert main([*distill, "--batch", "3", "--dtype", "fp32"]) == 0, capsys.readouterr().err[-2000:]
    assert json.loads((data / "manifest.json").read_text())["source"] == "synthetic word problems (seed 0)"
    train = ["train", "--data", str(data), "--out", str(run_dir), "--steps", "2", "--block-size", "4"]
    assert main([*train, "--anchors", "4", "--batch", "2", "--save-every", "2"]) == 0, capsys.readouterr().err[-2000:]
    from dflash_trt.checkpoints.zlab import load_drafter

    assert load_drafter(run_dir / "drafter").cfg.block_size == 4
    x = str(tmp_path / "x")
    assert "must be in [0, 1]" in main_error(capsys, "distill", "--out", x, "--sampled-fraction", "2")
    both = main_error(capsys, "distill", "--out", x, "--word-problems", "--prompts-file", str(tmp_path / "p.jsonl"))
    assert "not both" in both
