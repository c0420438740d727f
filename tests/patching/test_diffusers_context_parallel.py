"""FP4 attention of the generic diffusers layers under diffusers' context parallelism, on the CPU.

Two gloo processes run patched tiny FLUX, Qwen-Image (text padding as a key mask) and LTX-Video
transformers under diffusers' split (``fp4vis.pipelines.context_parallel.enable_context_parallel``: the
model's own ``_cp_plan``), and HunyuanVideo's double and single blocks (text padding) under a plan of the
test's own (diffusers ships none for HunyuanVideo), and must give one process's output bit for bit
(reference backend): under Ulysses for every policy, under ring where the contract allows it
(``fp4vis.patching.context_parallel``). The joint layers join a text and an image shard on each rank, which
the FP4 path puts back in one GPU's order, the padding mask with its keys. LTX's cross-attention keeps
exact attention (its additive mask), through diffusers' own Ulysses attention; under ring that needs a
backend returning the log-sum-exp, which no CPU has.

One spawn of two processes runs every scenario; the tests read the results.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from diffusers.models.attention_dispatch import AttentionBackendName
from test_diffusers_attention import TEXT, B, _cogvideox, _flux, _hunyuan, _ltx, _qwen, _text_mask
from test_wan_context_parallel import _error, _free_ports

from fp4vis.policy import POLICIES

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

FP4 = tuple(p for p in POLICIES if p != "bf16")


class HunyuanVideoBlocks(torch.nn.Module):
    """HunyuanVideo's double and single blocks, under a context-parallel plan of this module's own (diffusers ships
    none for HunyuanVideo): the image and text streams and their padding masks are split separately, and the joint
    mask is built per rank from its shards, so that each rank's keys carry their own mask."""

    _parallel_config = None
    _cp_plan = {
        "": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
             "encoder_hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
             "image_mask": ContextParallelInput(split_dim=1, expected_dims=2, split_output=False),
             "text_mask": ContextParallelInput(split_dim=1, expected_dims=2, split_output=False)},
        "rope": {0: ContextParallelInput(split_dim=0, expected_dims=2, split_output=True),
                 1: ContextParallelInput(split_dim=0, expected_dims=2, split_output=True)},
        "image_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
        "text_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }

    class Rope(torch.nn.Module):
        def __init__(self, tokens: int, dim: int):
            super().__init__()
            angles = torch.randn(tokens, dim)
            self.register_buffer("cos", angles.cos())
            self.register_buffer("sin", angles.sin())

        def forward(self):
            return self.cos, self.sin

    def __init__(self):
        super().__init__()
        from diffusers.models.transformers.transformer_hunyuan_video import (
            HunyuanVideoSingleTransformerBlock,
            HunyuanVideoTransformerBlock,
        )

        self.config = SimpleNamespace(num_attention_heads=2)
        self.transformer_blocks = torch.nn.ModuleList([HunyuanVideoTransformerBlock(2, 16, mlp_ratio=2.0)])
        self.single_transformer_blocks = torch.nn.ModuleList([HunyuanVideoSingleTransformerBlock(2, 16, mlp_ratio=2.0)])
        self.rope = self.Rope(16, 16)
        self.image_out, self.text_out = torch.nn.Identity(), torch.nn.Identity()

    def forward(self, hidden_states, encoder_hidden_states, temb, image_mask, text_mask):
        mask = torch.cat([image_mask, text_mask], dim=1)[:, None, None, :]   # HunyuanVideo's: image, then text
        rope = self.rope()
        for block in (*self.transformer_blocks, *self.single_transformer_blocks):
            hidden_states, encoder_hidden_states = block(hidden_states, encoder_hidden_states, temb, mask, rope)
        return (torch.cat([self.image_out(hidden_states), self.text_out(encoder_hidden_states)], dim=1),)


def _hunyuan_blocks():
    model = HunyuanVideoBlocks()
    g = torch.Generator().manual_seed(5)
    return model, dict(hidden_states=torch.randn(B, 16, 32, generator=g), encoder_hidden_states=torch.randn(
        B, TEXT, 32, generator=g), temb=torch.randn(B, 32, generator=g), image_mask=torch.ones(B, 16, dtype=torch.bool),
        text_mask=_text_mask())   # 5 of 8 text tokens valid: rank 0's text shard all valid, rank 1's one of 4


MODELS = {"flux": _flux, "qwen": _qwen, "ltx": _ltx, "hunyuan": _hunyuan_blocks}
# ring: FP4 in every layer they use
RING = {"flux": ("fast", "accurate", "fp8"), "qwen": ("fast", "guard"), "hunyuan": ("fast", "nv_fp8")}


def _build(name: str):
    torch.manual_seed(0)   # the same weights in every process and model
    model, inputs = MODELS[name]()
    if name == "flux":   # positions that differ per token, so that the rotary embedding is split with its tokens
        g = torch.Generator().manual_seed(3)
        inputs.update(img_ids=torch.randint(0, 8, (16, 3), generator=g).float(),
                      txt_ids=torch.randint(0, 8, (8, 3), generator=g).float())
    if name == "ltx":   # diffusers 0.42's Ulysses attention fails on LTX's additive text mask (exact cross-attn)
        inputs["encoder_attention_mask"] = None
    return model.eval(), inputs


@torch.no_grad()
def _run(model, inputs, policy, **kw):
    import fp4vis

    with warnings.catch_warnings(record=True) as caught, fp4vis.patch(model, policy, backend="reference", **kw) as h:
        warnings.simplefilter("always")
        out = model(**inputs)[0]
        calls = {name: st.calls for name, st in h.layers.items() if st is not None}
    return out, calls, sorted({str(w.message) for w in caught if "fp4vis" in str(w.message)})


def _worker(rank: int, out_dir: str, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from fp4vis.pipelines.context_parallel import ContextParallel, enable_context_parallel

    res: dict = {}
    for name in MODELS:
        for mode, policies in (("ulysses", FP4), ("ring", RING.get(name, ()))):
            if not policies:
                continue
            single, inputs = _build(name)
            parallel, _ = _build(name)
            enable_context_parallel(parallel, ContextParallel(**{mode: 2}))
            for policy in policies:
                res[name, mode, policy, "single"] = _run(single, inputs, policy)[0]
                res[name, mode, policy, "cp"] = _run(parallel, inputs, policy)
            with torch.no_grad():
                res[name, mode, "exact"] = single(**inputs)[0]
                if mode == "ulysses":   # diffusers' own Ulysses attention, unpatched
                    res[name, mode, "exact_cp"] = parallel(**inputs)[0]
    # ring on a GPU: enable_context_parallel gives the exact self-attention diffusers' cuDNN backend, whose function
    # without a parallel config ends in SDPA as well: the FP4 layers keep running FP4 (set here by hand on the CPU)
    single, inputs = _build("flux")
    parallel, _ = _build("flux")
    enable_context_parallel(parallel, ContextParallel(ring=2))
    for module in parallel.modules():
        if hasattr(getattr(module, "processor", None), "_attention_backend"):
            module.processor._attention_backend = AttentionBackendName("_native_cudnn")
    res["flux_ring_cudnn"] = (_run(single, inputs, "fast")[0], _run(parallel, inputs, "fast"))
    # FLUX's double block left exact: its single block cannot learn the joint order, and says so
    flux, inputs = _build("flux")
    enable_context_parallel(flux, ContextParallel(ulysses=2))
    res["flux_single_alone"] = _run(flux, inputs, "fast", layers={"transformer_blocks.0.attn": None})
    # LTX's cross-attention patched too: under context parallelism it keeps diffusers' attention, saying why
    single, inputs = _build("ltx")
    parallel, _ = _build("ltx")
    enable_context_parallel(parallel, ContextParallel(ulysses=2))
    res["ltx_cross"] = (_run(single, inputs, "fast")[0], _run(parallel, inputs, "fast", cross_attention=True))
    # LTX under ring: its exact cross-attention goes to diffusers' ring attention, which the CPU cannot run
    ltx, inputs = _build("ltx")
    enable_context_parallel(ltx, ContextParallel(ring=2))
    res["ltx_ring"] = _error(lambda: _run(ltx, inputs, "fast"))
    # diffusers ships no context-parallel plan for these (where to split and gather): refused up front
    res["eval"] = _eval(rank, Path(out_dir))
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))   # as torchrun starts the benchmark
    res["bench"] = _benchmark().main(["--dry-run", "--no-warmup", "--steps", "1", "--archs", "flux.1-dev,hunyuanvideo",
                                      "--policies", "bf16,fast", "--out", str(Path(out_dir) / f"bench{rank}.json")])
    res["bench_written"] = (Path(out_dir) / f"bench{rank}.json").exists()
    res["no_plan"] = [_error(lambda b=build: enable_context_parallel(b()[0], ContextParallel(ulysses=2)))
                      for build in (_hunyuan, _cogvideox)]
    dist.destroy_process_group()
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")


def _benchmark():
    """benchmarks/published_context_parallel.py (a script, not a package module)."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "published_context_parallel.py"
    spec = importlib.util.spec_from_file_location("published_cp_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _eval(rank: int, out: Path):
    """``fp4vis eval pipeline --speed-only ... --cp ulysses=2``'s run on this process group: rank 0 writes."""
    import sys

    from fp4vis.evals import published_configs as pc
    from fp4vis.evals.pipeline_eval import PipelineEvalConfig, run_pipeline_eval

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "apps"))
    from test_evals_pipeline import tiny_arch

    pc.PUBLISHED_DENOISERS["tiny-flux.1-dev"] = tiny_arch("flux.1-dev")
    return run_pipeline_eval(PipelineEvalConfig(speed_only="tiny-flux.1-dev", policies="fast", steps=2, warmup=False,
                                                backend="reference", device="cpu", progress=False, cp="ulysses=2",
                                                out_dir=out / f"eval{rank}"))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("diffusers_cp")
    mp.spawn(_worker, args=(str(out), _free_ports(1)[0]), nprocs=2)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("policy", FP4)
def test_ulysses_gives_one_process_output_bit_for_bit(ranks, name, policy):
    single = ranks[0][name, "ulysses", policy, "single"]
    for r in ranks:
        out, calls, _ = r[name, "ulysses", policy, "cp"]
        assert torch.equal(out, single), (name, policy, (out - single).abs().max())
        assert calls and all(n > 0 for n in calls.values()), calls   # FP4 ran in every patched layer
    assert not torch.equal(single, ranks[0][name, "ulysses", "exact"])


@pytest.mark.parametrize("name", list(MODELS))
def test_diffusers_own_ulysses_attention_is_close_and_bit_identical_only_for_one_stream(ranks, name):
    """Unpatched, diffusers' Ulysses attention gathers a joint layer's keys in its own order (each rank's text and
    image shards in turn): close to one process, not bit for bit, where the FP4 path above is."""
    single, cp = ranks[0][name, "ulysses", "exact"], ranks[0][name, "ulysses", "exact_cp"]
    assert torch.allclose(cp, single, atol=1e-5, rtol=0)
    assert torch.equal(cp, single) == (name == "ltx")


@pytest.mark.parametrize(("name", "policy"), [(n, p) for n, ps in RING.items() for p in ps])
def test_ring_gives_one_process_output_and_says_why_it_gathers(ranks, name, policy):
    single = ranks[0][name, "ring", policy, "single"]
    for r in ranks:
        out, calls, _ = r[name, "ring", policy, "cp"]
        assert torch.equal(out, single), (name, policy, (out - single).abs().max())
        assert calls and all(n > 0 for n in calls.values()), calls
    gathered = [m for m in ranks[0][name, "ring", policy, "cp"][2] if "ring attention gathers" in m]
    if (name, policy) == ("hunyuan", "fast"):   # Qwen-Image's fast run gave this reason already: once a process
        assert gathered == []
        return
    why = "several token streams" if name == "flux" and policy == "fast" else (
        "padding mask" if name == "qwen" and policy == "fast" else f"policy {policy!r}")
    assert len(gathered) == 1 and why in gathered[0], gathered


def test_eval_pipeline_under_context_parallelism_writes_on_rank_zero(ranks):
    r = ranks[0]["eval"]
    assert r["complete"] and r["context_parallel"] == {"ulysses": 2, "ring": 1, "world_size": 2}
    assert set(r["runs"]) == {"bf16", "fast"} and 0 < r["runs"]["fast"]["latent_cosine"] < 1
    assert Path(r["files"]["json"]).parent.name == "eval0" and ranks[1]["eval"] is None
    assert not Path(r["files"]["json"]).parent.with_name("eval1").exists()


def test_benchmark_dry_run_over_two_ranks(ranks):
    r = ranks[0]["bench"]
    runs = {(x["arch"], x["mode"], x["policy"]): x for x in r["runs"]}
    assert set(runs) == {("FLUX.1-dev", m, p) for m in ("single", "ulysses=2") for p in ("bf16", "fast")} | {
        ("HunyuanVideo", "single", p) for p in ("bf16", "fast")}
    assert "no context-parallel plan" in r["skipped"]["hunyuanvideo ulysses=2"]
    fp4 = runs["FLUX.1-dev", "ulysses=2", "fast"]
    assert fp4["bit_identical_vs_single"] and fp4["latents_rel_l2_vs_single"] == 0
    assert fp4["speedup_vs_diffusers_cp_bf16"] > 0 and fp4["speedup_vs_single_bf16"] > 0
    assert len(set(fp4["weights_checksum_per_rank"])) == 1 and len(fp4["seconds_per_step_per_rank"]) == 2
    assert ranks[0]["bench_written"] and not ranks[1]["bench_written"]   # rank 0 alone writes


def test_benchmark_dry_run_on_one_process(tmp_path, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    r = _benchmark().main(["--dry-run", "--no-warmup", "--steps", "1", "--archs", "qwen-image", "--policies",
                           "bf16,fast", "--out", str(tmp_path / "b.json")])
    assert [(x["mode"], x["policy"]) for x in r["runs"]] == [("single", "bf16"), ("single", "fast")]
    assert "torchrun" in r["skipped"]["context parallelism"] and (tmp_path / "b.json").exists()


def test_models_without_a_context_parallel_plan_are_refused_naming_it(ranks):
    hunyuan, cogvideox = ranks[0]["no_plan"]
    assert hunyuan.startswith("UsageError: --cp ulysses=2: diffusers has no context-parallel plan for "
                              "HunyuanVideoTransformer3DModel"), hunyuan
    assert "CogVideoXTransformer3DModel" in cogvideox and ranks[1]["no_plan"] == ranks[0]["no_plan"]


def test_the_ring_exact_backend_of_gpus_leaves_fp4_layers_fp4(ranks):
    single, (out, calls, said) = ranks[0]["flux_ring_cudnn"]
    assert torch.equal(out, single) and calls and all(n == 1 for n in calls.values()), calls
    assert not any("keeps exact attention" in m for m in said), said


def test_a_single_stream_block_without_its_joint_order_keeps_diffusers_attention(ranks):
    _, calls, said = ranks[0]["flux_single_alone"]
    assert calls == {"single_transformer_blocks.0.attn": 0}, calls
    assert any("single_transformer_blocks.0.attn' keeps exact attention: context parallelism: this FluxAttnProcessor "
               "call attends over the text and image tokens its block joined" in m for m in said), said


def test_patched_cross_attention_keeps_diffusers_attention_under_context_parallelism(ranks):
    single, (out, calls, said) = ranks[0]["ltx_cross"]
    assert torch.equal(out, single)   # attn1 FP4, attn2 diffusers' Ulysses attention: as one process's attn1-only
    assert calls == {f"transformer_blocks.{i}.attn{j}": (1 if j == 1 else 0) for i in (0, 1) for j in (1, 2)}
    assert any("attn2' keeps exact attention: cross-attention under context parallelism" in m for m in said), said


def test_exact_cross_attention_under_ring_is_diffusers_and_fails_on_the_cpu(ranks):
    assert ranks[0]["ltx_ring"] == ranks[1]["ltx_ring"] and "return_lse" in ranks[0]["ltx_ring"]
