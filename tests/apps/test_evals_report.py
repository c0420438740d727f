"""evals/report.py (JSON + Markdown, environment, statistics) and evals/plots.py."""

import importlib.util
import json
import math

import pytest

from fp4vis.evals.plots import skipped_backends, speed_error_plot, summarize
from fp4vis.evals.report import (
    fmt,
    markdown_table,
    mean_ci95,
    paired_rate_difference_ci95,
    t_quantile,
    wilson_ci95,
    write_report,
)
from fp4vis.services.environment import environment

# scipy.stats.t.ppf(0.975, df), 6 decimals
T975 = {1: 12.706205, 2: 4.302653, 3: 3.182446, 5: 2.570582, 9: 2.262157, 10: 2.228139, 30: 2.042272,
        100: 1.983972}


@pytest.mark.parametrize("df", sorted(T975))
def test_t_quantile_matches_table(df):
    assert t_quantile(0.975, df) == pytest.approx(T975[df], abs=1e-4)


def test_mean_ci95_known_values():
    r = mean_ci95([1.0, 2.0, 3.0, 4.0])
    assert r["n"] == 4 and r["mean"] == pytest.approx(2.5)
    half = 3.182446 * math.sqrt(5 / 3) / 2  # t(0.975, 3) * sd / sqrt(n)
    assert r["ci95_low"] == pytest.approx(2.5 - half, abs=1e-5)
    assert r["ci95_high"] == pytest.approx(2.5 + half, abs=1e-5)
    one = mean_ci95([0.7])
    assert one["mean"] == 0.7 and one["ci95_low"] is None


def test_wilson_interval_known_values():
    # Wilson's score interval: 5/10 -> [0.2366, 0.7634]; 0/10 and 10/10 keep a width (Wald's would not)
    half = wilson_ci95(5, 10)
    assert half["rate"] == 0.5 and half["ci95_low"] == pytest.approx(0.2366, abs=1e-4)
    assert half["ci95_high"] == pytest.approx(0.7634, abs=1e-4)
    none, every = wilson_ci95(0, 10), wilson_ci95(10, 10)
    assert none["ci95_low"] == 0.0 and none["ci95_high"] == pytest.approx(0.2775, abs=1e-4)
    assert every["ci95_high"] == 1.0 and every["ci95_low"] == pytest.approx(0.7225, abs=1e-4)
    with pytest.raises(ValueError):
        wilson_ci95(11, 10)


def test_paired_rate_difference_keeps_a_width_where_nothing_changed():
    same = paired_rate_difference_ci95(0, 0, 200)
    assert same["mean"] == 0.0 and same["ci95_low"] < 0 < same["ci95_high"] and same["ci95_high"] < 0.02
    worse = paired_rate_difference_ci95(1, 12, 200)   # 11 images lost on balance: a real difference
    assert worse["mean"] == pytest.approx(-0.055) and worse["ci95_high"] < 0
    # Agresti-Min: a Wald interval on the table with half a count in every cell
    b, c, m = 1.5, 12.5, 202.0
    assert worse["ci95_low"] == pytest.approx((b - c) / m - 1.959964 * math.sqrt(b + c - (b - c) ** 2 / m) / m)
    with pytest.raises(ValueError):
        paired_rate_difference_ci95(5, 6, 10)


def test_write_report_json_markdown_environment(tmp_path):
    files = write_report(tmp_path / "r", "demo", {"x": 1.5, "nan": float("nan")}, "# Demo\n\ntext")
    data = json.loads(files["json"].read_text())
    assert data["x"] == 1.5 and data["nan"] == "nan"
    env = data["environment"]
    assert env["versions"]["torch"] and "gpu" in env and env["timestamp_utc"].endswith("Z")
    md = files["markdown"].read_text()
    assert md.startswith("# Demo") and "Environment:" in md and "(demo.json)" in md
    assert environment()["python"]


def test_markdown_table_and_fmt():
    t = markdown_table(["a", "b"], [[1, 0.123456], [None, float("inf")]])
    assert t.splitlines()[0] == "| a | b |" and "0.1235" in t and "n/a" in t and "inf" in t
    assert fmt(1e-7) == "1.000e-07"


def test_speed_error_plot_png(tmp_path):
    rows = [{"backend": "reference", "policy": "fast", "time_ms": 4.0, "rel_l2": 0.3},
            {"backend": "reference", "policy": "fast", "time_ms": 6.0, "rel_l2": 0.32},
            {"backend": "sdpa", "policy": "bf16", "time_ms": 1.0, "rel_l2": 0.0},
            {"backend": "hopper", "skipped": True}]
    s = {p["label"]: p for p in summarize({"rows": rows})}
    assert s["reference / fast"]["time_ms"] == pytest.approx(5.0) and s["reference / fast"]["n"] == 2
    assert "hopper" not in s
    assert skipped_backends({"rows": rows}) == {"hopper": "True"}
    png = speed_error_plot({"rows": rows}, tmp_path / "p.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_speed_error_plot_makes_up_no_error(tmp_path, monkeypatch):
    """A row without a measured error (or an error of 0 on the log axis) is a speed line, not a point at a
    made-up x."""
    import matplotlib.axes

    points, lines = [], []
    monkeypatch.setattr(matplotlib.axes.Axes, "scatter", lambda self, x, y, **k: points.append((x[0], y[0])))
    monkeypatch.setattr(matplotlib.axes.Axes, "axhline", lambda self, y, **k: lines.append(y))
    rows = [{"backend": "reference", "policy": "fast", "time_ms": 4.0, "rel_l2": 0.3},
            {"backend": "sdpa", "policy": "bf16", "time_ms": 1.0, "rel_l2": 0.0},
            {"backend": "fa4", "time_ms": 2.0}]
    speed_error_plot({"rows": rows}, tmp_path / "p.png")
    assert points == [(0.3, 250.0)] and sorted(lines) == [500.0, 1000.0]


def test_speed_error_plot_names_the_route():
    """A row that ran through a named route (the Blackwell kernel's sm_90 verification build on an H200) keeps it in
    its label, so the plot alone does not pass it off as the product route."""
    rows = [{"backend": "blackwell", "policy": "fast", "time_ms": 4.0, "rel_l2": 0.3,
             "route": "sm_90 verification (not Blackwell)"},
            {"backend": "fa4", "time_ms": 1.0, "rel_l2": 0.003}]
    assert sorted(p["label"] for p in summarize({"rows": rows})) == [
        "blackwell / fast (sm_90 verification (not Blackwell))", "fa4"]


def test_bench_runs_the_blackwell_backend_where_it_exists():
    """`fp4vis bench` times the Blackwell backend with the others; where it cannot run, its row says why."""
    import torch

    from fp4vis.cli.bench import BENCH_BACKENDS
    from fp4vis.evals import kernel_bench as kb

    assert "blackwell" in BENCH_BACKENDS
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-side reasons")
    assert kb.available("blackwell") == "no CUDA device"
    q = torch.randn(1, 1, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="backend='blackwell'"):
        kb.blackwell_call("fast")(q, q, q, 0.125)


def test_bench_baselines_resolve_through_the_shared_module():
    """kernel_bench's BF16 baselines (fa4, sage, sdpa_*) are fp4vis.evals.baselines' functions in layout
    bhsd; the bshd ones give the same values (torch SDPA's flash backend also runs on the CPU)."""
    import torch

    from fp4vis.evals import baselines
    from fp4vis.evals import kernel_bench as kb

    assert baselines.unavailable("sdpa_nope") == "unknown baseline 'sdpa_nope'"
    if not torch.cuda.is_available():
        assert {b: kb.available(b) for b in ("fa4", "sage", "sdpa_cudnn")} == dict.fromkeys(
            ("fa4", "sage", "sdpa_cudnn"), "no CUDA device")
    q, k, v = (torch.randn(1, 2, 40, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    bhsd = baselines.attention_function("sdpa_flash", "bhsd")(q, k, v, 0.25)
    bshd = baselines.attention_function("sdpa_flash", "bshd")(q.transpose(1, 2), k.transpose(1, 2),
                                                                v.transpose(1, 2), 0.25)
    assert torch.equal(bshd.transpose(1, 2), bhsd)
    with pytest.raises(ValueError, match="layout"):
        baselines.attention_function("sdpa_flash", "bsd")


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_fa3_fp8_cast_is_e4m3_over_one_scale_per_batch_and_head(layout):
    """The FlashAttention-3 FP8 baseline's cast: each (batch, head) of q, k or v over its own amax / 448 (FA3's
    descale, shape (B, H)), so the largest magnitude becomes 448 and decoding gives the input back to E4M3's
    rounding; an all-zero head stays zero (no 0 / 0)."""
    import torch

    from fp4vis.evals.baselines import e4m3_per_head

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 40, 16, generator=gen) * torch.tensor([1.0, 300.0, 1e-3])[None, :, None, None]   # bhsd
    x[1, 2] = 0.0
    x = x if layout == "bhsd" else x.transpose(1, 2)
    x8, descale = e4m3_per_head(x, layout)
    assert x8.dtype == torch.float8_e4m3fn and descale.shape == (2, 3) and descale.dtype == torch.float32
    heads = (2, 3) if layout == "bhsd" else (1, 3)
    amax8 = x8.float().abs().amax(dim=heads)
    assert torch.equal(amax8, torch.tensor([[448.0, 448.0, 448.0], [448.0, 448.0, 0.0]]))
    d = descale[:, :, None, None] if layout == "bhsd" else descale[:, None, :, None]
    decoded = x8.float() * d
    assert torch.all((decoded - x).abs() <= 2.0 ** -4 * x.abs() + 2.0 ** -9 * d)   # E4M3: 3 bits, subnormals
    assert torch.equal(decoded[1, 2] if layout == "bhsd" else decoded[1, :, 2], torch.zeros(40, 16))


def test_fa3_backends_say_why_they_cannot_run(monkeypatch):
    """FlashAttention-3's BF16 and FP8 baselines, and its FP8 kernel alone, are kernel_bench backends (and `fp4vis
    bench`'s): where its package does not import, each one's row says so; a misspelt one is unknown."""
    import torch

    from fp4vis.cli.bench import BENCH_BACKENDS
    from fp4vis.evals import kernel_bench as kb

    assert {"fa3", "fa3_fp8", "fa3_fp8_kernel"} <= set(BENCH_BACKENDS)
    if importlib.util.find_spec("flash_attn_interface") is not None:
        pytest.skip("FlashAttention-3 imports here")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # past the device check, to the import
    for backend in ("fa3", "fa3_fp8", "fa3_fp8_kernel"):
        assert kb.available(backend) == "ModuleNotFoundError: No module named 'flash_attn_interface'"
    assert kb.available("fa3_fp8_kernal") == "unknown backend 'fa3_fp8_kernal'"


def test_grid_speedups_and_geo_means_in_both_timings():
    """Every backend is timed per eager call and in GPU time (graph_ms): the speedups and the
    geo-mean of the summary are given for both, each from its own timing."""
    from fp4vis.evals import kernel_bench as kb

    rows = []
    for s, (fa4, hop, fa4_g, hop_g) in {4096: (1.0, 0.8, 0.9, 0.9), 8192: (4.0, 4.0, 3.6, 3.0)}.items():
        common = dict(shape=f"B1 S{s}", s=s, d=128)
        rows += [dict(common, backend="fa4", policy=None, ms=fa4, graph_ms=fa4_g),
                 dict(common, backend="hopper", policy="fast", ms=hop, graph_ms=hop_g),
                 dict(common, backend="fa3_fp8_kernel", policy=None, ms=fa4 / 2, graph_ms=fa4_g / 4)]
    kb.add_speedups(rows)
    hop = [r for r in rows if r["backend"] == "hopper"]
    assert [r["speedup_vs_fa4"] for r in hop] == [1.25, 1.0] and [r["graph_speedup_vs_fa4"] for r in hop] == [1.0, 1.2]
    assert kb.geo_mean_speedup(rows) == pytest.approx(math.sqrt(1.25))
    assert kb.geo_mean_speedup(rows, timing="graph") == pytest.approx(math.sqrt(1.2))
    summary = kb.summary_table(rows)
    assert "hopper/fast over flash-attn-4 at S >= 4096, D = 128: 1.118x per eager call, 1.095x in GPU time" in summary
    # a peer's geo-mean beside fp4vis's (FlashAttention-3's FP8 kernel here)
    assert "fa3_fp8_kernel over flash-attn-4 at S >= 4096, D = 128: 2.000x per eager call, 4.000x in GPU" in summary


@pytest.mark.gpu(capability=(9, 0))
@pytest.mark.parametrize("name, tol", [("fa3", 1e-2), ("fa3_fp8", 6e-2)])
def test_fa3_baselines_give_sdpa_attention(name, tol):
    """FlashAttention-3's baselines, where its package is built (flash-attention's hopper/): SDPA's attention within
    BF16's rounding (fa3) or E4M3's (fa3_fp8, per-head scales) in both layouts; compiled (bhsd), the eager values."""
    import torch

    from fp4vis.evals.baselines import attention_function, unavailable
    from fp4vis.metrics import rel_l2

    if unavailable(name) is not None:
        pytest.skip(unavailable(name))
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, 300, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v).float()
    bhsd = attention_function(name, "bhsd")
    assert rel_l2(bhsd(q, k, v).float(), ref) <= tol
    bshd = attention_function(name, "bshd")
    out = bshd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    assert rel_l2(out.float(), ref) <= tol
    compiled = torch.compile(lambda q, k, v: bhsd(q, k, v), fullgraph=True)
    assert torch.equal(compiled(q, k, v), bhsd(q, k, v))
