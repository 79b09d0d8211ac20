"""The command line as a user meets it, called through a subprocess: one-line errors before any rank
starts, exit statuses that tell the truth, help that documents itself, results that never land on an
earlier run's files, torchrun, and the README's examples as written."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tpweave.cli.main import COMMANDS
from tpweave.cli.parser import build_parser

ROOT = Path(__file__).resolve().parent.parent


def tpweave(*args: str, cwd: Path | None = None, timeout: float = 600, env: dict | None = None):
    """Run `python -m tpweave ARGS` as a user would; (exit status, stdout, stderr, seconds)."""
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "tpweave", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, **(env or {})},
    )
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["demo", "--model", "llama9-1t"], "--model llama9-1t: 'llama9-1t' is neither a model preset"),
        (["demo", "-tp", "5"], "--tensor-parallel-size 5: TP=5 does not divide num_heads=48"),
        (["demo", "--num-tokens", "0"], "argument --num-tokens: must be >= 1, got 0"),
        (["demo", "--tp", "0"], "argument -tp/--tensor-parallel-size/--tp: must be >= 1, got 0"),
        (["demo", "--model", "./no/such/dir"], "no such directory"),
        (["bench", "serve", "--model", "tiny", "--request-rate", "0"], "rates must be > 0"),
        (["bench", "serve", "--model", "tiny", "--workload", "chatty"], "--workload 'chatty': choose from"),
        (["generate", "--model", "tiny", "--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
        (["generate", "--model", "tiny", "--logprobs", "21"], "--logprobs must be in [0, 20], got 21"),
        (["report", "missing.json"], "missing.json: not a readable JSON file"),
        (["bench", "engine", "--model", "tiny", "--context", "50"], "--context 50 must exceed --num-iters"),
        (["bench", "engine", "--model", "tiny", "--prefill", "4096"], "--prefill 4096 need 4104 positions"),
    ],
)
def test_bad_input_is_one_line_before_any_rank_starts(args, message, tmp_path):
    code, out, err, seconds = tpweave(*args, cwd=tmp_path)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tpweave: error: ") and message in lines[0], err
    assert seconds < 60, seconds  # no rank was started (they take 10-30 s to import and compile)
    assert not (tmp_path / "tpweave-results").exists()  # nothing written


def test_invariant_flag_refuses_the_uncompiled_model_before_any_rank(capsys):
    """--invariant batch needs the compiler (it swaps the invariant kernels in): with --no-compile, one line naming
    both flags and exit status 2, before any rank starts; an unknown level is argparse's one line."""
    from tpweave.cli.main import main

    assert main(["generate", "--model", "tiny", "-tp", "1", "--invariant", "batch", "--no-compile"]) == 2
    line = capsys.readouterr().err.strip()
    assert line == "tpweave: error: --invariant batch needs the compiled model: drop --no-compile", line
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", "tiny", "--invariant", "full"])
    assert e.value.code == 2 and "invalid choice: 'full'" in capsys.readouterr().err


def test_ranks_on_a_cpu_without_the_memory_for_the_model_stop_before_starting(monkeypatch, capsys):
    """On a CPU the ranks share the machine's memory: a model whose weights (+ each rank's share of building
    them) do not fit is refused in one line naming --model and the sizes, instead of a rank killed mid-build."""
    import argparse

    from tpweave.cli import common
    from tpweave.cli.main import main

    monkeypatch.setattr(common.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(common, "available_host_memory", lambda: 20e9)
    assert main(["generate", "--model", "llama3-8b", "-tp", "2"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("tpweave: error: --model llama3-8b: 2 rank(s) on this machine's CPU need about 24.5 GB")
    assert "16.1 GB of bfloat16 weights" in line and "20.0 GB is available" in line, line
    # fewer layers (where the command takes --num-layers) or fewer ranks on this machine fit
    fits = dict(model="llama3-8b", dtype="bfloat16", tp=2)
    common.check_cpu_memory(argparse.Namespace(**fits, num_layers=8))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # torchrun: one of the two ranks here
    common.check_cpu_memory(argparse.Namespace(**fits, num_layers=None))


def test_an_error_inside_the_ranks_is_one_line_and_a_hint(monkeypatch, capsys):
    """A failure only a rank can see (every input check passed): the root rank's message and one hint line
    (exit 1); --debug adds every rank's traceback."""
    from tpweave.cli import generate
    from tpweave.cli.main import main
    from tpweave.runtime import WorkerError

    trace = 'Traceback (most recent call last):\n  File "x.py", line 1\nRuntimeError: CUDA error: out of memory'

    def failing(*args, **kwargs):
        raise WorkerError(0, trace + "\nrank 1: RuntimeError: CUDA error: out of memory")

    monkeypatch.setattr(generate, "run_ranks", failing)
    args = ["generate", "--model", "tiny", "--no-compile", "--dtype", "float32"]
    assert main(args) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["tpweave: error: rank 0: RuntimeError: CUDA error: out of memory",
                     "tpweave: (run with --debug for every rank's traceback)"], lines  # fmt: skip
    assert main(["--debug", *args]) == 1
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_bench_engine_passes_baseline_and_invariant_to_the_engine(monkeypatch, tmp_path):
    """`bench engine --baseline --invariant batch` (the reference of the TP >= 2 cost of invariance): the engine the
    ranks build gets plain TP and the invariant level; without the flags, neither."""
    from tpweave.cli import bench
    from tpweave.cli.main import main

    seen = []

    class Stop(Exception):
        pass

    def ranks(fn, *worker_args, opts):
        seen.append(worker_args[-1])  # engine_kwargs
        raise Stop

    monkeypatch.setattr(bench, "run_ranks", ranks)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("tpweave.bench.provenance.gpu_state", lambda: {})
    for flags in (["--baseline", "--invariant", "batch"], []):
        with pytest.raises(Stop):
            main(["bench", "engine", "--model", "tiny", "--output-dir", str(tmp_path), "--overwrite", *flags])
    assert seen[0]["baseline"] is True and seen[0]["invariant"] == "batch"
    assert seen[1]["baseline"] is False and seen[1]["invariant"] is None


def test_a_broken_checkpoint_is_refused_before_any_rank_starts(tmp_path):
    """A model directory whose checkpoint is unreadable, lacks a tensor, holds one in another shape, or holds no
    *.safetensors at all: one line naming --model and what is wrong, exit 2, for the commands that load the
    weights and for those that only take the shapes (bench latency / layer time random weights in them)."""
    from safetensors.torch import save_file

    from tpweave.models import get_preset, random_hf_state

    cfg = get_preset("tiny", num_layers=1)
    state = random_hf_state(cfg, seed=0, dtype=torch.float32)

    def model_dir(name, tensors=None, raw=None):
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps(cfg.to_hf()))
        if raw is not None:
            (path / "model.safetensors").write_bytes(raw)
        elif tensors is not None:
            save_file(tensors, str(path / "model.safetensors"))
        return str(path)

    generate, latency = ["generate"], ["bench", "latency", "--prefill", "1x8"]
    cases = [
        (generate, model_dir("garbage", raw=b"\x10\x00\x00\x00garbage"), "cannot read"),
        (latency, model_dir("truncated", {k: v for k, v in state.items() if "down_proj" not in k}), "is missing from"),
        (latency, model_dir("reshaped", {**state, "model.norm.weight": torch.ones(7)}), "has shape (7,), config.json"),
        (generate, model_dir("empty"), "holds no *.safetensors files"),
    ]
    for command, path, message in cases:
        code, out, err, seconds = tpweave(*command, "--model", path, "--dtype", "float32", cwd=tmp_path)
        line = err.strip().splitlines()
        assert code == 2 and len(line) == 1 and line[0].startswith(f"tpweave: error: --model {path}: "), err
        assert message in line[0] and seconds < 60, (line, seconds)


def test_prompt_ids_outside_the_vocabulary_are_refused_before_any_rank_starts(tmp_path):
    code, _, err, seconds = tpweave("generate", "--model", "tiny", "--prompt-ids", "1,2,999999", cwd=tmp_path)
    assert code == 2 and "--prompt-ids '1,2,999999': token id(s) [999999] outside the model's vocabulary" in err, err
    assert seconds < 60


def test_model_directory_with_a_broken_config_names_the_file(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{not json")
    code, _, err, _ = tpweave("generate", "--model", str(tmp_path / "m"), cwd=tmp_path)
    assert code == 2 and f"{tmp_path / 'm' / 'config.json'}: not a readable JSON file" in err, err


def test_report_refuses_what_is_not_a_result_and_writes_nothing(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"meta": {}, "rows": [{"foo": 1}]}))
    code, _, err, _ = tpweave("report", str(bad), "--output-dir", str(tmp_path / "out"), cwd=tmp_path)
    assert code == 2 and "bad.json: not a tpweave results file" in err, err
    assert not (tmp_path / "out").exists()


def _every_action(parser: argparse.ArgumentParser, path: str = "tpweave"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _every_action(sub, f"{path} {name}")
        else:
            yield path, action


def test_help_documents_every_option():
    parser = build_parser(COMMANDS)
    for path, action in _every_action(parser):
        if action.help == argparse.SUPPRESS:
            continue
        assert action.help, f"{path} {action.option_strings or action.dest} has no help text"
    code, out, _, _ = tpweave("bench", "serve", "--help")
    assert code == 0 and "(default: 2,8,32,inf)" in out and "requests per second" in out and "--num-prompts" in out
    for cmd in (["--help"], ["bench", "--help"]):
        code, out, _, _ = tpweave(*cmd)
        assert code == 0 and "bench_cmd" not in out and "{demo" not in out
        assert "COMMAND" in out or "BENCHMARK" in out
    code, out, _, _ = tpweave("--version")
    assert code == 0 and re.fullmatch(r"tpweave \d+\.\d+\.\d+\n", out), out
    code, _, err, _ = tpweave()
    assert code == 2 and "tpweave: error:" in err and "cmd" not in err.replace("COMMAND", ""), err
    # each option says its default once, and none says "None"; an unknown option points to its command's help
    for path, sub in _every_parser(parser):
        text = re.sub(r"\s+", " ", sub.format_help())
        assert "(default: None)" not in text and "(default: False)" not in text, path
        assert not re.search(r"\(default:[^)]*\) \(default:", text), path
    code, _, err, _ = tpweave("bench", "latency", "--bogus")
    assert (
        code == 2
        and err.strip() == "tpweave: error: unrecognized arguments: --bogus (see `tpweave bench latency --help`)"
    )


def _every_parser(parser, path="tpweave"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _every_parser(sub, f"{path} {name}")


def test_one_flag_name_per_concept_across_commands():
    """vLLM's names where the concept is the same, and the same name in every tpweave command."""
    parser = build_parser(COMMANDS)
    flags = {opt for _, action in _every_action(parser) for opt in action.option_strings}
    assert {"-tp", "--tensor-parallel-size", "--num-prompts", "--request-rate", "--num-iters", "--num-layers"} <= flags
    assert not {"--num-requests", "--layers", "--reps", "--rates", "--out"} & flags


def test_generate_where_every_prompt_is_rejected_fails(tmp_path):
    too_long = ",".join(["1"] * 4100)  # the tiny model has 4096 positions
    code, out, err, _ = tpweave("generate", "--model", "tiny", "-tp", "1", "--prompt-ids", too_long, "--no-compile",
                                cwd=tmp_path)  # fmt: skip
    assert code == 1, (out, err)
    assert "[0] rejected:" in out and "does not fit the model's context of 4096" in out, out
    assert "1 of 1 prompt(s) rejected" in out


def test_serve_where_every_request_fails_says_so_and_fails(tmp_path):
    requests = tmp_path / "requests.csv"
    requests.write_text("input_len,output_len\n500,4\n600,3\n")  # longer than --max-model-len
    args = ["bench", "serve", "--model", "tiny", "-tp", "1", "--dtype", "float32", "--dataset-path", str(requests)]
    args += ["--request-rate", "inf", "--max-model-len", "128", "--max-num-batched-tokens", "64", "--arms", "auto"]
    args += ["--rounds", "1"]
    code, out, err, _ = tpweave(*args, "--output-dir", str(tmp_path / "out"), cwd=tmp_path)
    assert code == 1, (out, err)
    assert "FAILED: auto/requests.csv/rate inf: 2 of 2 requests failed" in out, out
    md = next((tmp_path / "out").glob("*.md")).read_text()
    assert "**Failures:** auto/requests.csv/rate inf: 2 of 2 requests failed" in md
    # what the arm's engine cost: no step ran (every request was rejected), no graph on a CPU
    assert "## Engines per arm" in md
    engine_row = next(line for line in md.splitlines() if line.startswith("| auto |"))
    assert engine_row.split(" | ")[6:10] == ["0", "0", "0", "0"], engine_row


def test_results_go_to_a_new_folder_and_never_overwrite(tmp_path):
    from tpweave.bench.results import write_results

    rows = [{"what": "layer", "tokens": m, "arm": arm, "vs_baseline": 1.0} for m in (4, 8) for arm in ("a", "b")]
    write_results(tmp_path / "runs", "layer-x", {"model": "x"}, rows)
    result = str(tmp_path / "runs" / "layer-x.json")
    for _ in range(2):
        code, _, err, _ = tpweave("report", result, cwd=tmp_path)
        assert code == 0, err
    reports = sorted((tmp_path / "tpweave-results").glob("report-*/REPORT.md"))
    assert len(reports) == 2  # a new timestamped folder each time
    code, _, _, _ = tpweave("report", result, "--output-dir", str(tmp_path / "mine"), cwd=tmp_path)
    assert code == 0
    code, _, err, _ = tpweave("report", result, "--output-dir", str(tmp_path / "mine"), cwd=tmp_path)
    assert code == 2 and "already holds REPORT.md from an earlier run" in err and "--overwrite" in err
    code, _, _, _ = tpweave("report", result, "--output-dir", str(tmp_path / "mine"), "--overwrite", cwd=tmp_path)
    assert code == 0


def test_recorded_commit_is_tpweaves_own(tmp_path, monkeypatch):
    from tpweave.bench.provenance import PACKAGE_DIR, code_version
    from tpweave.bench.results import run_metadata

    monkeypatch.chdir(tmp_path)  # not a git checkout: the commit must still be tpweave's
    code = code_version()
    head = subprocess.run(["git", "-C", str(PACKAGE_DIR), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert code["commit"] == head.stdout.strip() and isinstance(code["dirty"], bool)
    else:
        assert code["commit"] is None
    assert len(code["source_hash"]) == 16 and run_metadata()["code"] == code


def test_demo_prints_progress_and_one_readable_report(tmp_path):
    code, out, err, _ = tpweave("demo", cwd=tmp_path)
    assert code == 0, (out, err)
    assert "[tpweave" in err and "compiling and running M=37" in err  # progress on stderr
    assert out.count("tpweave report:") == 1 and "graph 1 [sp]" in out and "graph 2 [sp]" in out
    assert "M >= 0" not in out and "the sequence-parallel graph serves every M" in out
    assert "strategies that ran: M=37: sequential; M=1: sequential" in out
    assert "symm_mem_fused" in out and "not available on cpu" in out  # named by the policies, said not to run


def test_commands_run_under_torchrun(tmp_path):
    """`torchrun --nproc-per-node 2 -m tpweave demo`: each process is one rank; rank 0 alone prints."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "tpweave", "demo"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("all 2 ranks agree on the output: True") == 1, proc.stdout
    bad = subprocess.run([*cmd, "-tp", "4"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert bad.returncode != 0 and "--tensor-parallel-size 4 differs from torchrun's WORLD_SIZE=2" in bad.stderr


def _readme_python_example() -> str:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    return next(b for b in blocks if "tpweave.launch(" in b)


def test_readme_launch_example_runs_as_written(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(_readme_python_example())
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.fullmatch(r"greedy next token at each of the 127 positions: \[\d+(, \d+){126}\]\n", proc.stdout)


def test_readme_reproducible_generation_example_gives_the_same_bits(tmp_path):
    """The README's --invariant commands as written: the first prompt's tokens and logprobs alone and among others
    ("batch"), and at TP 1 and TP 2 ("tp"), line for line the same."""
    readme = (ROOT / "README.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", readme, re.S) if "--invariant batch" in b)
    commands = [line for line in block.splitlines() if line.startswith("tpweave generate")]
    assert len(commands) == 4, block
    firsts = []
    for command in commands:
        argv = [sys.executable, "-m", "tpweave", *shlex.split(command)[1:]]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = proc.stdout.splitlines()
        first = lines[: next((i for i, x in enumerate(lines) if x.startswith("[1]")), len(lines))]
        assert first[0].startswith("[0] 3 prompt tokens -> [") and len(first) == 5, proc.stdout
        firsts.append(first)
    assert firsts[0] == firsts[1] and firsts[2] == firsts[3], firsts


def test_launch_without_a_main_guard_says_what_to_do(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import tpweave\n\ndef worker(ctx):\n    return ctx.rank\n\nprint(tpweave.launch(worker, nprocs=2))\n"
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode != 0
    assert 'if __name__ == "__main__":' in proc.stderr, proc.stderr[-3000:]


def test_results_record_whether_kernels_launch_with_pdl(monkeypatch):
    """Provenance says whether PDL was on (off on CPU, and off by TPWEAVE_PDL=0 on any device)."""
    import torch

    from tpweave.bench.results import provenance_lines, run_metadata
    from tpweave.ops import pdl

    meta = run_metadata()
    assert meta["pdl"] is (torch.cuda.is_available() and pdl.enabled(torch.device("cuda")))
    assert f"- programmatic dependent launch: {'on' if meta['pdl'] else 'off'}" in provenance_lines(meta)
    monkeypatch.setenv("TPWEAVE_PDL", "0")
    assert run_metadata()["pdl"] is False and not pdl.enabled(torch.device("cuda"))
    assert not pdl.enabled(torch.device("cpu"))


def test_an_output_dir_that_cannot_be_written_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "a-file").write_text("")
    for out in (tmp_path / "a-file" / "results", tmp_path / "a-file"):
        code, _, err, seconds = tpweave(
            "bench", "latency", "--model", "tiny", "--prefill", "1x8", "--output-dir", str(out), cwd=tmp_path
        )
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith(f"tpweave: error: --output-dir {out}"), err
        assert seconds < 60


def test_user_guide_hf_launch_example_runs_as_written(tmp_path):
    """The user guide's example of a Hugging Face model over tpweave.launch ranks, run as the guide says
    (`python example.py /path/to/hf-model`) on a tiny random Llama checkpoint: no warning from transformers' API."""
    import transformers

    guide = (ROOT / "docs" / "user_guide.md").read_text()
    block = next(
        b for b in re.findall(r"```python\n(.*?)```", guide, re.S) if "DistributedConfig(" in b and "launch(" in b
    )
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf-model")
    (tmp_path / "example.py").write_text(block)
    proc = subprocess.run(
        [sys.executable, "-W", "error::FutureWarning", "example.py", str(tmp_path / "hf-model")],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "greedy next tokens: [[" in proc.stdout and "(the same on every rank: True )" in proc.stdout, proc.stdout
