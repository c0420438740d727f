"""FP4 attention under diffusers' context parallelism (``fp4vis.patching.context_parallel``), on the CPU.

Two gloo processes run a patched tiny Wan transformer (96 tokens: shards of 48, not a multiple of 32)
under Ulysses and under ring and must give one process's output bit for bit (reference backend;
``KEY_CHUNK`` = 32 so that the ring's key shards end inside the reference's key chunks); the
configurations fp4vis refuses raise the same error on every rank before any work; ``run_generate(...,
cp="ulysses=2")`` under torchrun's environment (what ``fp4vis generate --cp`` runs) gives one process's
latents and writes on rank 0 only; the benchmark's dry run measures. Four processes run Ulysses and
ring together on the collective path itself.

diffusers 0.42's ``enable_parallelism`` cannot run on a machine without an accelerator (it divides by
the accelerator count); ``fp4vis.pipelines.context_parallel.enable_context_parallel`` takes the same
steps through diffusers' hook API there, and is what these tests use. diffusers' own ring attention
does not run on the CPU either (its native backend returns no log-sum-exp), so exact layers are
checked under Ulysses only.

One spawn of four processes runs every scenario (four, then two of them): the processes' imports
dominate (torch, diffusers, transformers: about 10 s of CPU each); the tests read the results.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16, out_channels=16,
            text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
# Ulysses runs fp4vis.attention per head whatever the policy: one policy of each kind (fixed row reference,
# anchored, the FP8 control); the ring has two paths: key streaming (both Q/K formats) and gathered keys
POLICIES = {"ulysses": ("fast", "guard", "nv_fp8", "fp8"), "ring": ("fast", "fast_fp8qk", "accurate", "fp8")}
STREAMED = ("fast", "wan_fast", "fast_fp8qk")     # the ring adds key-shard sums; the others gather the keys
KEY_CHUNK = 32


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _inputs(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(1, 16, 3, 8, 16, generator=g), timestep=torch.tensor([500]),
                encoder_hidden_states=torch.randn(1, 8, 32, generator=g), return_dict=False)


def _model(**changes):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(**{**TINY, **changes}).eval()


def _benchmark():
    """benchmarks/wan_context_parallel.py (a script, not a package module)."""
    spec = importlib.util.spec_from_file_location("wan_cp_bench", ROOT / "benchmarks" / "wan_context_parallel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _error(fn) -> str | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test compares type and message
        return f"{type(exc).__name__}: {exc}"
    return None


@torch.no_grad()
def _run(model, policy, **kw):
    import fp4vis

    with warnings.catch_warnings(record=True) as caught, fp4vis.patch(model, policy, backend="reference", **kw) as h:
        warnings.simplefilter("always")
        out = model(**_inputs())[0]
        calls = {name: st.calls for name, st in h.layers.items() if st is not None}
    gathered = [str(w.message) for w in caught if "ring attention gathers" in str(w.message)]
    return out, calls, gathered


# ------------------------------------------------------------------------------------------------
# one spawn: four processes for Ulysses and ring together, then two for every other scenario


def _worker(rank: int, out_dir: str, tiny_wan: str, ports: list[int]) -> None:
    out = Path(out_dir)
    torch.set_num_threads(1)   # several processes on a 2-core CI machine
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    res: dict = {"together": _together(rank, ports[3])}
    if rank >= 2:   # the rest runs on two ranks (diffusers' mesh covers the whole world)
        torch.save(res, out / f"rank{rank}.pt")
        return
    world = 2
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))

    # `fp4vis generate --cp` as torchrun starts it: the process group comes from the environment (and
    # goes at the end); rank 0 writes. Rank 1 gets a path of its own, which must stay untouched
    # (torchrun gives every rank the same arguments).
    from fp4vis.pipelines.wan_generate import GenerateOptions, run_generate

    os.environ["MASTER_PORT"] = str(ports[0])
    target = out / ("gen" if rank == 0 else "gen_rank1") / "fox.mp4"
    gen = run_generate(GenerateOptions(tiny_wan, "a red fox", output=target, frames=5, height=32, width=32, steps=2,
                                      policy="fast", backend="reference", device="cpu", progress=False, cp="ulysses=2"))
    res["generate"] = (gen["video"], gen["result"].latents)

    # the benchmark's dry run over both ranks (its own process group)
    os.environ["MASTER_PORT"] = str(ports[1])
    _benchmark().main(["--dry-run", "--no-warmup", "--steps", "1", "--policies", "fast", "--out",
                       str(out / ("bench.json" if rank == 0 else "bench_rank1.json"))])

    os.environ["MASTER_PORT"] = str(ports[2])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import fp4vis
    from fp4vis import reference
    from fp4vis.pipelines.context_parallel import ContextParallel, enable_context_parallel, enable_without_accelerator

    reference.KEY_CHUNK = KEY_CHUNK
    for mode in ("ulysses", "ring"):
        single, parallel = _model(), _model()
        enable_context_parallel(parallel, ContextParallel(**{mode: world}))
        for policy in POLICIES[mode]:
            res[mode, policy, "single"] = _run(single, policy)[0]
            res[mode, policy, "cp"] = _run(parallel, policy)
        with torch.no_grad():
            res[mode, "exact", "single"] = single(**_inputs())[0]
        if mode == "ulysses":   # layer 1 exact through diffusers' own Ulysses attention
            res[mode, "layers", "single"] = _run(single, "fast", layers={1: None})[0]
            res[mode, "layers", "cp"] = _run(parallel, "fast", layers={1: None})
            with torch.no_grad():
                res[mode, "exact", "cp"] = parallel(**_inputs())[0]
        else:                   # a guarded layer (gathered keys) beside a streamed one
            res[mode, "layers", "single"] = _run(single, "wan_fast", layers={0: "guard"})[0]
            res[mode, "layers", "cp"] = _run(parallel, "wan_fast", layers={0: "guard"})

    # refused configurations: the same error on every rank, before the layer's first FP4 call
    three_heads = _model(num_attention_heads=3)
    res["heads_usage"] = _error(lambda: enable_context_parallel(three_heads, ContextParallel(ulysses=2)))
    from diffusers import ContextParallelConfig

    enable_without_accelerator(three_heads, ContextParallelConfig(ulysses_degree=2))  # as enable_parallelism
    h = fp4vis.patch(three_heads, "fast", backend="reference")
    res["heads_processor"] = _error(lambda: three_heads(**_inputs()))
    res["heads_calls"] = sum(st.calls for st in h.states)
    h.remove()
    ring = _model()
    enable_context_parallel(ring, ContextParallel(ring=2))
    h = fp4vis.patch(ring, "fast", guard="auto", backend="reference")
    res["auto_guard"] = _error(lambda: ring(**_inputs()))
    res["auto_guard_calls"] = sum(st.calls for st in h.states)
    h.remove()
    res["calibrate"] = _error(lambda: fp4vis.calibrate(ring, [_inputs()], policy="fast"))
    res["global_scale"] = _error(lambda: _run(ring, fp4vis.Policy("fast_gs", qk_global_scale=True)))

    dist.destroy_process_group()
    torch.save(res, out / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks_run(tmp_path_factory, tiny_wan):
    pytest.importorskip("diffusers")
    out = tmp_path_factory.mktemp("cp")
    mp.spawn(_worker, args=(str(out), str(tiny_wan), _free_ports(4)), nprocs=4)
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(4)]


@pytest.fixture(scope="module")
def two_ranks(ranks_run):
    out, ranks = ranks_run
    return out, ranks[:2]


def test_ulysses_and_ring_together_on_four_ranks(ranks_run):
    _, ranks = ranks_run
    for rank, res in enumerate(ranks):
        assert res["together"] == {**{p: (True, 0.0, 1) for p in ("fast", "fast_fp8qk", "guard")},
                                   **{(p, "streams"): (True, 0.0, 1) for p in ("fast", "guard")}}, (rank, res)


@pytest.mark.parametrize(("mode", "policy"), [(m, p) for m, ps in POLICIES.items() for p in ps])
def test_two_ranks_give_one_process_output_bit_for_bit(two_ranks, mode, policy):
    _, ranks = two_ranks
    single = ranks[0][mode, policy, "single"]
    for r in ranks:
        out, calls, gathered = r[mode, policy, "cp"]
        assert torch.equal(out, single), (mode, policy, (out - single).abs().max())
        assert calls == {"blocks.0.attn1": 1, "blocks.1.attn1": 1}   # FP4 ran in both layers
    assert not torch.equal(single, ranks[0][mode, "exact", "single"])  # and it is not exact attention
    # the ring streams key shards where Direct-P's sums add, and says where it gathers the keys instead
    out, _, gathered = ranks[0][mode, policy, "cp"]
    if mode == "ring" and policy not in STREAMED:
        assert len(gathered) == 1 and f"policy {policy!r}" in gathered[0]
    else:
        assert gathered == []
    assert ranks[1][mode, policy, "cp"][2] == []   # the warning comes from rank 0 only


@pytest.mark.parametrize("mode", ["ulysses", "ring"])
def test_per_layer_policies_and_exact_layers(two_ranks, mode):
    _, ranks = two_ranks
    single = ranks[0][mode, "layers", "single"]
    out, calls, _ = ranks[1][mode, "layers", "cp"]
    assert torch.equal(out, single)
    if mode == "ulysses":   # blocks.1 runs diffusers' Ulysses attention (exact), bit for bit too
        assert calls == {"blocks.0.attn1": 1}
        assert torch.equal(ranks[1][mode, "exact", "cp"], ranks[0][mode, "exact", "single"])
    else:
        assert calls == {"blocks.0.attn1": 1, "blocks.1.attn1": 1}


def test_refused_configurations_say_why_before_any_work(two_ranks):
    _, ranks = two_ranks
    for key in ("heads_usage", "heads_processor", "auto_guard", "calibrate", "global_scale"):
        assert ranks[0][key] == ranks[1][key] is not None, key   # every rank stops with the same error
    r = ranks[0]
    assert r["heads_usage"].startswith("UsageError: --cp ulysses=2: ulysses=2 does not divide the transformer's "
                                       "3 heads")
    assert r["heads_processor"].startswith("ContextParallelError: fp4vis: layer 'blocks.0.attn1' under context "
                                           "parallelism: ulysses_degree 2 does not divide its 3 heads")
    assert 'guard="auto" would see one rank' in r["auto_guard"] and "calibrate on one GPU" in r["auto_guard"]
    assert "guard calibration would see one rank" in r["calibrate"]
    assert "qk_global_scale" in r["global_scale"] and r["global_scale"].startswith("ContextParallelError")
    assert r["heads_calls"] == 0 and r["auto_guard_calls"] == 0


def test_generate_under_torchrun_writes_on_rank_zero_only(two_ranks, tiny_wan):
    from fp4vis.pipelines.wan_video import generate, load_wan_pipeline

    out, ranks = two_ranks
    one = generate(load_wan_pipeline(str(tiny_wan), device="cpu"), prompt="a red fox", height=32, width=32, frames=5,
                   steps=2, policy="fast", backend="reference", decode=False, progress=False).latents
    for r in ranks:
        assert torch.equal(r["generate"][1], one)   # every rank ends with one process's latents
    assert ranks[0]["generate"][0] == out / "gen" / "fox.mp4" and ranks[1]["generate"][0] is None
    assert sorted(p.name for p in (out / "gen").iterdir()) == ["fox.json", "fox.mp4"]
    side = json.loads((out / "gen" / "fox.json").read_text())
    assert side["context_parallel"] == {"ulysses": 2, "ring": 1, "world_size": 2} and side["policy"] == "fast"
    assert not (out / "gen_rank1").exists() and not (out / "bench_rank1.json").exists()


def test_benchmark_dry_run(two_ranks):
    out, _ = two_ranks
    r = json.loads((out / "bench.json").read_text())
    assert r["world_size"] == 2 and r["random_weights"] and r["environment"]["versions"]["torch"]
    runs = {(x["mode"], x["policy"]): x for x in r["runs"]}
    assert set(runs) == {("single", "fast"), ("ulysses=2", "fast"), ("ring=2", "fast")}
    for (mode, _), x in runs.items():
        assert x["mean_s_per_step"] > 0 and len(x["seconds_per_step_per_rank"]) == 2
        assert len(set(x["weights_checksum_per_rank"])) == 1
        if mode != "single":
            assert x["bit_identical_vs_single"] and x["latents_rel_l2_vs_single"] == 0 and x["speedup_vs_single"] > 0


def test_benchmark_dry_run_on_one_process(tmp_path, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    r = _benchmark().main(["--dry-run", "--no-warmup", "--steps", "1", "--policies", "fast", "--out",
                           str(tmp_path / "b.json")])
    assert [x["mode"] for x in r["runs"]] == ["single"] and "torchrun" in r["skipped"]
    assert json.loads((tmp_path / "b.json").read_text())["runs"][0]["mean_s_per_step"] > 0


def _together(rank: int, port: int) -> dict:
    """Ulysses and ring at once on four ranks, on the collective path itself (no diffusers): diffusers'
    mesh (ring, ulysses) = (2, 2), where rank = ring index * 2 + Ulysses index holds sequence shard `rank`."""
    import fp4vis
    from fp4vis import reference
    from fp4vis.patching import context_parallel
    from fp4vis.patching.layer import LayerSpec, LayerState

    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=4)
    reference.KEY_CHUNK = 64
    ulysses = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ring = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    groups = context_parallel.ContextParallelGroups(ulysses_degree=2, ring_degree=2, ulysses_group=ulysses[rank // 2],
                                                    ring_group=ring[rank % 2], ring_rank=rank // 2)
    g = torch.Generator().manual_seed(0)
    # D = 32, where 1/sqrt(D) and D ** -0.5 differ in the last bit (the ring takes attention's default_scale)
    q, k, v = (torch.randn(1, 200, 4, 32, generator=g) for _ in range(3))  # shards of 50, ring shards of 100
    shard = slice(50 * rank, 50 * (rank + 1))
    spec = LayerSpec(name="attn", module=torch.nn.Identity(), index=0, group="self", default=True, patcher="wan",
                     num_heads=4, head_dim=32)
    res = {}
    for policy in ("fast", "fast_fp8qk", "guard"):
        state = LayerState(spec, fp4vis.get_policy(policy), backend="reference", range_check="raise", strict=False,
                           handle=None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = context_parallel.shard_attention(state, q[:, shard], k[:, shard], v[:, shard], state.policy, groups)
        one = fp4vis.attention(q, k, v, policy=policy, layout="bshd", backend="reference")[:, shard]
        res[policy] = (torch.equal(out, one), float((out - one).abs().max()), state.calls)
    # a joint layer's two streams (each rank: its 20 text and 30 image tokens) with a key-padding mask: one GPU's
    # sequence is every text shard, then every image shard
    mask = torch.rand(1, 200, generator=g) > 0.3
    local = torch.cat((torch.arange(20 * rank, 20 * rank + 20), torch.arange(80 + 30 * rank, 110 + 30 * rank)))
    for policy in ("fast", "guard"):
        state = LayerState(spec, fp4vis.get_policy(policy), backend="reference", range_check="raise", strict=False,
                           handle=None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = context_parallel.shard_attention(state, q[:, local], k[:, local], v[:, local], state.policy, groups,
                                             key_mask=mask[:, local], streams=(20, 30))
        one = fp4vis.attention(q, k, v, policy=policy, layout="bshd", backend="reference", key_mask=mask)[:, local]
        res[policy, "streams"] = (torch.equal(out, one), float((out - one).abs().max()), state.calls)
    dist.destroy_process_group()
    reference.KEY_CHUNK = 4096
    return res
