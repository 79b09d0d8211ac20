"""Foundation: runtime, token collectives, reference model, weights (CPU, gloo, several ranks)."""

import importlib
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import tpweave
import workers
from tpweave.models import build_model, get_preset, random_hf_state, save_hf_checkpoint
from tpweave.models.weights import Piece, SafetensorsFetch
from tpweave.ops.collectives import shard_rows

TOKEN_COUNTS = [1, 2, 3, 7, 64, 129]
TOL = {"float32": 1e-4, "bfloat16": 6e-2}


@pytest.fixture(scope="module")
def reference_logits():
    return workers.eager_logits(tpweave.TPContext.single(), "tiny", TOKEN_COUNTS, ("float32", "bfloat16"))


@pytest.mark.parametrize("tp", [2, 3, 4, 8])  # 8: what the 8-GPU runs use (CPU: 8 gloo ranks)
def test_tp_logits_match_single_rank(tp, reference_logits):
    results = tpweave.launch(workers.eager_logits, "tiny", TOKEN_COUNTS, ("float32", "bfloat16"), nprocs=tp)
    for rank_out in results:
        for (dtype, m), logits in rank_out.items():
            ref = reference_logits[(dtype, m)]
            assert logits.shape == (m, get_preset("tiny").vocab_size)
            err = (logits - ref).abs().max().item()
            assert err <= TOL[dtype] * max(1.0, ref.abs().max().item()), (tp, dtype, m, err)


def test_one_rank_group_runs_no_collectives():
    """A model on a process group of one rank (what `-tp 1` through the CLI makes) sums and gathers nothing: a
    one-rank all-reduce is a copy, and in a decode CUDA graph a node PDL chains cannot cross. Same logits, bit for
    bit, as the model without a group; two ranks still communicate."""
    names, logits = tpweave.launch(workers.collectives_and_logits, "tiny", 5, nprocs=1)[0]
    assert names == []
    single_names, single = workers.collectives_and_logits(tpweave.TPContext.single(), "tiny", 5)
    assert single_names == [] and torch.equal(logits, single)
    two = tpweave.launch(workers.collectives_and_logits, "tiny", 5, nprocs=2)
    assert all(any("all_reduce" in n for n in rank_names) for rank_names, _ in two)


def test_qwen_style_bias_and_tied_head():
    overrides = {"qkv_bias": True, "tie_word_embeddings": True}
    ref = workers.eager_logits(tpweave.TPContext.single(), "tiny", [5, 33], **overrides)
    results = tpweave.launch(workers.eager_logits, "tiny", [5, 33], nprocs=2, **overrides)
    for key, logits in results[1].items():
        torch.testing.assert_close(logits, ref[key], atol=1e-4, rtol=1e-4)


def test_random_weights_do_not_depend_on_tp():
    full = workers.state_dict_cpu(tpweave.TPContext.single(), "tiny")
    shards = tpweave.launch(workers.state_dict_cpu, "tiny", nprocs=2)
    name = "model.layers.1.mlp.down_proj.weight"  # row-parallel: split along dim 1
    torch.testing.assert_close(torch.cat([s[name] for s in shards], dim=1), full[name], atol=0, rtol=0)
    name = "model.embed_tokens.weight"
    torch.testing.assert_close(torch.cat([s[name] for s in shards], dim=0), full[name], atol=0, rtol=0)


@pytest.mark.parametrize("overrides", [{}, {"qkv_bias": True, "tie_word_embeddings": True}, {"quantization": "fp8"}])
def test_model_memory_is_its_weights_and_one_rope_table(overrides):
    """The weights in memory are what weight_bytes (the CLI's memory check) counts, and every layer reads one
    cos/sin table (a table per layer was 67 MB a layer at llama3-8b's 131072 positions)."""
    from tpweave.models.weights import weight_bytes

    model = build_model("tiny", tp=tpweave.TPContext.single(), dtype=torch.bfloat16, **overrides)
    held = {id(t): t for t in model.state_dict(keep_vars=True).values()}  # a tied head counted once
    assert sum(t.numel() * t.element_size() for t in held.values()) == weight_bytes(model.config, torch.bfloat16)
    buffers = dict(model.named_buffers())
    assert list(buffers) == ["model.layers.0.self_attn.rotary.cos_sin"], list(buffers)
    assert all(layer.self_attn.rotary is model.model.layers[0].self_attn.rotary for layer in model.model.layers)


def test_safetensors_roundtrip(tmp_path):
    cfg = get_preset("tiny")
    save_hf_checkpoint(tmp_path / "ckpt", cfg, random_hf_state(cfg, seed=7, dtype=torch.float32), num_files=2)
    loaded = tpweave.launch(workers.state_dict_cpu, str(tmp_path / "ckpt"), nprocs=2)
    random = tpweave.launch(workers.state_dict_cpu, "tiny", 7, nprocs=2)
    for rank in range(2):
        assert loaded[rank].keys() == random[rank].keys()
        for k in loaded[rank]:
            torch.testing.assert_close(loaded[rank][k], random[rank][k], atol=0, rtol=0, msg=k)
    ref = workers.eager_logits(tpweave.TPContext.single(), "tiny", [9], seed=7)
    got = tpweave.launch(workers.eager_logits, str(tmp_path / "ckpt"), [9], nprocs=2)
    torch.testing.assert_close(got[0][("float32", 9)], ref[("float32", 9)], atol=1e-4, rtol=1e-4)


def test_checkpoint_errors_name_the_tensor(tmp_path):
    cfg = get_preset("tiny")
    state = random_hf_state(cfg, seed=0, dtype=torch.float32)
    missing = dict(state)
    del missing["model.layers.1.mlp.up_proj.weight"]
    save_hf_checkpoint(tmp_path / "missing", cfg, missing)
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight.*missing"):
        build_model(str(tmp_path / "missing"), tp=tpweave.TPContext.single(), dtype=torch.float32)
    bad = dict(state)
    bad["model.norm.weight"] = torch.ones(cfg.hidden_size + 1)
    save_hf_checkpoint(tmp_path / "bad", cfg, bad)
    with pytest.raises(ValueError, match=r"model.norm.weight.*shape \(385,\)"):
        build_model(str(tmp_path / "bad"), tp=tpweave.TPContext.single(), dtype=torch.float32)
    with pytest.raises(ValueError, match="no config.json|no such directory"):
        build_model(str(tmp_path / "nothing-here"), tp=tpweave.TPContext.single())
    (tmp_path / "not-json").mkdir()
    (tmp_path / "not-json" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"not-json/config.json: not a readable JSON file"):
        build_model(str(tmp_path / "not-json"), tp=tpweave.TPContext.single())
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "config.json").write_text((tmp_path / "bad" / "config.json").read_text())
    (tmp_path / "corrupt" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00garbage")
    with pytest.raises(ValueError, match="cannot read"):
        SafetensorsFetch(tmp_path / "corrupt", cfg, dtype=torch.float32, device=torch.device("cpu"))(
            Piece("model.norm.weight", None)
        )


def test_tp_not_dividing_heads():
    ctx = tpweave.TPContext(rank=0, world_size=5, group_name=None, device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"TP=5 does not divide num_heads=48, num_kv_heads=24"):
        build_model("tiny", tp=ctx)
    with pytest.raises(ValueError, match="is neither a model preset .* nor an HF-format model directory"):
        build_model("llama9-1t", tp=tpweave.TPContext.single())


def test_ranks_that_disagree_fail_with_the_difference():
    with pytest.raises(tpweave.WorkerError, match=r"ranks disagree on the model: 'seed': rank 0 has 0, rank 1 has 1"):
        tpweave.launch(workers.build_with_rank_seed, nprocs=2)


def test_rank_that_raises_surfaces_with_traceback():
    start = time.monotonic()
    with pytest.raises(
        tpweave.WorkerError, match=r"(?s)rank 1 failed:.*Traceback.*ValueError: boom from rank 1"
    ) as info:
        tpweave.launch(workers.raise_on_rank, 1, nprocs=2)
    assert info.value.rank == 1
    assert time.monotonic() - start < 60


def test_rank_that_dies_ends_the_run():
    start = time.monotonic()
    with pytest.raises(tpweave.WorkerError, match=r"(?s)rank 1 failed:.*exited with code 3"):
        tpweave.launch(workers.die_on_rank, 1, nprocs=2)
    assert time.monotonic() - start < 60


def test_rank_killed_by_a_signal_names_it():
    """SIGKILL, what the kernel's out-of-memory killer sends, is named as such, not as a bare exit code."""
    oom = r"(?s)rank 1 failed:.*killed by SIGKILL \(the kernel's out-of-memory killer"
    with pytest.raises(tpweave.WorkerError, match=oom):
        tpweave.launch(workers.killed_on_rank, 1, nprocs=2)


def test_rank_that_hangs_times_out():
    with pytest.raises(TimeoutError, match=r"ranks \[1\] had not finished"):
        tpweave.launch(workers.hang_on_rank, 1, nprocs=2, timeout_s=10)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_ranks_start_from_the_fork_server_with_the_launchers_environment(monkeypatch):
    """Ranks fork from a server that imported tpweave once (their parent is the server, not the launcher) and see the
    launcher's environment as it is at launch: pytest's per-test variable as it is now, and a variable set since the
    server started (the server started again, with it)."""
    from multiprocessing import forkserver

    launching = importlib.import_module("tpweave.runtime.launch")  # the module (the package exports its function)
    if launching._FORK_SERVER.context() is None:
        pytest.skip("no fork server of tpweave's in this process")
    server = forkserver._forkserver._forkserver_pid
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "a value the fork server did not start with")
    ranks = tpweave.launch(workers.env_and_parent, "PYTEST_CURRENT_TEST", nprocs=2)
    assert ranks == [("a value the fork server did not start with", server)] * 2
    assert forkserver._forkserver._forkserver_pid == server  # pytest's variable restarts nothing
    monkeypatch.setenv("TPWEAVE_SET_AFTER_THE_SERVER", "1")
    ranks = tpweave.launch(workers.env_and_parent, "TPWEAVE_SET_AFTER_THE_SERVER", nprocs=2)
    restarted = forkserver._forkserver._forkserver_pid
    assert restarted not in (server, os.getpid()) and ranks == [("1", restarted)] * 2


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_workers_exit_when_the_launcher_is_killed(tmp_path):
    code = f"import tpweave, workers; tpweave.launch(workers.write_pid_and_sleep, {str(tmp_path)!r}, nprocs=2)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    launcher = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("rank*.pid"))) < 2:
            assert time.monotonic() < deadline and launcher.poll() is None, "workers did not start"
            time.sleep(0.2)
        pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 30
        while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        alive = [pid for pid in pids if _running(pid)]
        for pid in alive:
            os.kill(pid, signal.SIGKILL)
        assert not alive, f"workers {alive} outlived their killed launcher"
    finally:
        launcher.kill()


def test_symmetric_memory_waits_end_at_the_group_timeout():
    """tpweave's signal waits (GPU kernels) give up after the group's collective timeout, like NCCL's
    collectives; on GPUs, test_dead_peer_stops_the_kernel_with_a_message_on_emulated_ranks."""
    assert tpweave.launch(workers.symm_wait_timeout_ms, nprocs=2, collective_timeout_s=42) == [42000, 42000]


@pytest.mark.parametrize("tp,feature_shape", [(2, (4,)), (3, (2, 3)), (4, (5,))])
def test_token_collectives_any_m(tp, feature_shape):
    counts = [1, 2, 3, 5, 7, 64]
    results = tpweave.launch(workers.token_collectives, counts, feature_shape, nprocs=tp)
    for m in counts:
        rows = shard_rows(m, tp)  # max(ceil(m / tp), 2)
        for rank, out in enumerate(results):
            reduced, gathered, shard, local = out[m]
            expected = sum(
                torch.arange(m * torch.Size(feature_shape).numel(), dtype=torch.float32) + 1000 * r for r in range(tp)
            )
            torch.testing.assert_close(reduced, expected.reshape(m, *feature_shape))
            torch.testing.assert_close(gathered, reduced)  # reduce_scatter + all_gather == all_reduce, a sum
            assert shard.shape == (rows, *feature_shape)
            torch.testing.assert_close(shard, local)  # the shard of the reduction == local slice of all_reduce
            lo = min(rank * rows, m)
            torch.testing.assert_close(shard[: max(0, min(rows, m - lo))], reduced[lo : lo + rows])


def test_token_collectives_compile_for_every_m():
    counts = [1, 2, 3, 5, 64, 129, 1000]
    results = tpweave.launch(workers.compiled_collectives_recompiles, counts, nprocs=3)
    for num_compiles, err in results:
        assert num_compiles == 2  # M = 1 (static), every other M (shards have >= 2 rows: no size-1 guard)
        assert err < 1e-4


@pytest.mark.gpu(gpus=2)
def test_gpu_nccl_logits_match_single_rank():
    counts = [1, 7, 64, 129]
    ref = tpweave.launch(workers.eager_logits, "tiny", counts, ("float32", "bfloat16"), nprocs=1)[0]
    got = tpweave.launch(workers.eager_logits, "tiny", counts, ("float32", "bfloat16"), nprocs=2, backend="nccl")
    for (dtype, m), logits in got[1].items():
        err = (logits - ref[(dtype, m)]).abs().max().item()
        assert err <= 2 * TOL[dtype] * max(1.0, ref[(dtype, m)].abs().max().item()), (dtype, m, err)


@pytest.mark.gpu(gpus=2)
def test_gpu_nccl_token_collectives():
    counts = [1, 2, 3, 5, 7, 64]
    results = tpweave.launch(workers.token_collectives, counts, (4,), nprocs=2, backend="nccl")
    for m in counts:
        reduced, gathered, shard, local = results[0][m]
        torch.testing.assert_close(gathered, reduced)
        torch.testing.assert_close(shard, local)
    results = tpweave.launch(
        workers.compiled_collectives_recompiles, [1, 2, 3, 5, 64, 129, 1000], nprocs=2, backend="nccl"
    )
    assert all(n <= 3 and err < 1e-3 for n, err in results)


def test_demo_command(capsys):
    """The README's first command: TP=2 on gloo, compiled == eager, every rank the same tokens."""
    from tpweave.cli import main

    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "all 2 ranks agree on the output: True" in out
    assert "within 0.001" in out and "compiled graphs: 2 " in out
