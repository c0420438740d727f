"""Guard calibration: the sampled-logit statistic, the rule, GuardPlan JSON, and guarded patching."""

from __future__ import annotations

import json
import math

import pytest
import torch

import fp4vis
from fp4vis.key_positions import anchor_indices
from fp4vis.patching.guard import logit_stats
from fp4vis.patching.guard_plan import EXP_LIMIT, GuardPlan, GuardRule, LayerStats, policy_limit

timm = pytest.importorskip("timm")

LOG2E = 1 / math.log(2)
EXTREME = (1, 3)  # timm blocks whose logits the tests make extreme


# ------------------------------------------------------------------------------------------------
# the statistic and the rule


@pytest.mark.parametrize("skv", [20, 300])
def test_logit_stats_match_brute_force(skv):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 7, 32, generator=g) * 4
    k = torch.randn(2, 3, skv, 32, generator=g) * 4
    scale = 0.3
    logits = (q @ k.mT) * scale * LOG2E
    idx = anchor_indices(skv, 128)
    st = logit_stats(q, k, scale, full=True)
    assert st["sampled_max_log2"] == pytest.approx(float(logits[..., idx].max()), rel=1e-5)
    assert st["full_max_log2"] == pytest.approx(float(logits.max()), rel=1e-5)
    gap = (logits.amax(-1) - logits[..., idx].amax(-1)).max()
    assert st["anchor_gap_log2"] == pytest.approx(float(gap), abs=1e-4)
    if skv <= 128:
        assert st["anchor_gap_log2"] == 0
    # layout bshd gives the same numbers
    st2 = logit_stats(q.transpose(1, 2), k.transpose(1, 2), scale, layout="bshd", full=True)
    assert st2 == pytest.approx(st)


def test_rule_limits_and_thresholds():
    fast, acc = fp4vis.get_policy("fast"), fp4vis.get_policy("accurate")
    assert policy_limit(fast, 0.125) == EXP_LIMIT == 127
    assert policy_limit(acc, 0.125) == pytest.approx(127 + 64 * 0.125)  # M*scale in the code's units
    assert policy_limit(acc.replace(margin_units="paper"), 0.125) == pytest.approx(127 + 64)
    st = LayerStats("l", scale=0.125, sampled_max_log2=100.0, full_max_log2=140.0, anchor_gap_log2=3.0)
    assert GuardRule().evaluate(st, fast) and st.value == 100 and st.headroom == 27
    assert not GuardRule(fraction=0.9).evaluate(st, fast)
    assert not GuardRule(threshold=120).evaluate(st, fast)
    assert GuardRule(threshold=120, statistic="full").evaluate(st, fast)
    assert not GuardRule().evaluate(st, acc) and st.value == 3.0  # anchored: the anchor gap
    with pytest.raises(ValueError):
        GuardRule(statistic="median")


# ------------------------------------------------------------------------------------------------
# a timm ViT whose blocks 1 and 3 have extreme logits


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.manual_seed(0)
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=64,
                          depth=4, num_heads=2, num_classes=10)
    with torch.no_grad():
        for i in EXTREME:
            w = m.blocks[i].attn.qkv.weight
            w[:128] *= 80        # q and k rows: logits z*log2(e) of several hundred
            w[128:] *= 2 ** 14   # v rows: saturated P blocks then overflow FP32 without the guard
    path = tmp_path_factory.mktemp("timm_guard") / "vit.pth"
    torch.save(m.state_dict(), path)
    return path


@pytest.fixture()
def vit(ckpt):
    return timm.create_model("vit_tiny_patch16_224", pretrained=True, img_size=32, patch_size=8, embed_dim=64,
                             depth=4, num_heads=2, num_classes=10,
                             pretrained_cfg_overlay=dict(file=str(ckpt), num_classes=10)).eval()


def _images(n=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, 32, 32, generator=g) for _ in range(n)]


NAMES = [f"blocks.{i}.attn" for i in range(4)]
GUARDED = [f"blocks.{i}.attn" for i in EXTREME]


@torch.no_grad()
def test_calibrate_picks_exactly_the_extreme_layers_and_guard_keeps_finite(vit, tmp_path):
    xs = _images()
    path = tmp_path / "plan.json"
    plan = fp4vis.calibrate(vit, xs, policy="fast", model_id="tiny-vit")
    plan.save(path)
    assert plan.guarded == GUARDED
    assert list(plan.stats) == NAMES
    for name, st in plan.stats.items():
        assert st.calls == len(xs)
        if name in GUARDED:
            assert st.sampled_max_log2 > 300
        else:
            assert st.sampled_max_log2 < 10
    assert plan.guard_policy == fp4vis.guard_policy_for_heads(2)

    # versioned JSON with the rule and the statistics
    d = json.loads(path.read_text())
    assert d["format"] == "fp4vis.guard_plan" and d["version"] == 1 and d["model_id"] == "tiny-vit"
    assert d["policy"]["name"] == "fast" and d["guard_policy"]["anchor"] == 128
    assert d["rule"]["statistic"] == "sampled" and d["rule"]["fraction"] == 0.75
    assert "sampled_max_log2 >= 0.75 * limit" in d["rule"]["description"]
    assert d["guarded"] == GUARDED and set(d["layers"]) == set(NAMES)
    assert d["layers"]["blocks.1.attn"]["limit"] == 127 and d["layers"]["blocks.1.attn"]["guarded"] is True
    loaded = GuardPlan.load(path)
    assert loaded.to_dict() == plan.to_dict()

    exact = vit(xs[0])
    # unguarded: the default range check raises; with it off the output is not finite
    with fp4vis.patch(vit, "fast"):
        with pytest.raises(fp4vis.RangeExceededError):
            vit(xs[0])
    with fp4vis.patch(vit, None, layers={1: "fast"}, range_check="off"):
        assert not torch.isfinite(vit(xs[0])).all()
    # guarded (plan from its JSON path): exactly the calibrated layers get the guard policy
    with fp4vis.patch(vit, "fast", guard=path, range_check="off") as h:
        assert h.policies == {n: ("guard" if n in GUARDED else "fast") for n in NAMES}
        out = vit(xs[0])
    assert torch.isfinite(out).all()
    assert fp4vis.cosine(out, exact) > 0.9
    # explicit exact layers stay exact; the guard only upgrades Direct-P layers
    with fp4vis.patch(vit, "fast", layers={1: None}, guard=plan) as h:
        assert h.policies["blocks.1.attn"] is None and h.policies["blocks.3.attn"] == "guard"
    # a plan calibrated for another base policy is applied, with a warning saying so
    with pytest.warns(RuntimeWarning, match="calibrated for policy 'fast'"):
        with fp4vis.patch(vit, "wan_fast", guard=plan):
            pass


@torch.no_grad()
def test_rule_is_an_option(vit):
    xs = _images(1)
    plan = fp4vis.calibrate(vit, (x for x in xs), rule=GuardRule(threshold=1e4))  # any iterable, consumed once
    assert plan.num_inputs == 1
    assert plan.guarded == [] and plan.rule.threshold == 1e4
    assert plan.redecide(GuardRule(fraction=0.75)).guarded == GUARDED
    assert plan.redecide(threshold=0.05).guarded == NAMES  # every layer above a tiny threshold
    full = fp4vis.calibrate(vit, xs, rule=GuardRule(statistic="full"))
    assert full.guarded == GUARDED
    assert all(st.full_max_log2 >= st.sampled_max_log2 for st in full.stats.values())
    # anchored base policy: the anchor covers all 17 keys, the gap is 0, nothing needs the guard
    acc = fp4vis.calibrate(vit, xs, policy="accurate")
    assert acc.guarded == [] and all(st.anchor_gap_log2 == 0 for st in acc.stats.values())
    with fp4vis.patch(vit, "accurate"):
        assert torch.isfinite(vit(xs[0])).all()


@torch.no_grad()
def test_guard_auto_calibrates_on_first_call(vit):
    x = _images(1)[0]
    with fp4vis.patch(vit, "fast", guard="auto", range_check="off") as h:
        out = vit(x)
        assert h.policies == {n: ("guard" if n in GUARDED else "fast") for n in NAMES}
        assert h.guard_plan.guarded == GUARDED and list(h.guard_plan.stats) == NAMES
        vit(x)
        assert all(st.calls == 2 for st in h.states)
    assert torch.isfinite(out).all()


def test_plan_errors(vit, tmp_path):
    plan = GuardPlan(model_id="m", policy=fp4vis.get_policy("fast"), guard_policy=fp4vis.get_policy("guard"),
                     guarded=["blocks.9.attn"])
    with pytest.raises(ValueError, match="blocks.9.attn"):
        fp4vis.patch(vit, guard=plan)
    d = plan.to_dict()
    (tmp_path / "v99.json").write_text(json.dumps({**d, "version": 99}))
    with pytest.raises(ValueError, match="version 99"):
        GuardPlan.load(tmp_path / "v99.json")
    (tmp_path / "other.json").write_text(json.dumps({**d, "format": "something"}))
    with pytest.raises(ValueError, match="not an fp4vis guard plan"):
        GuardPlan.load(tmp_path / "other.json")
    with pytest.raises(ValueError, match="Direct-P"):
        fp4vis.calibrate(vit, [], policy="bf16")
    with pytest.raises(ValueError, match="no calibration inputs"):
        fp4vis.calibrate(vit, iter([]))
    with pytest.raises(TypeError, match="rule: expected a GuardRule"):
        fp4vis.calibrate(vit, _images(1), rule=0.9)
    with pytest.raises(ValueError, match="full=False, but the rule needs the maxima over all keys"):
        fp4vis.calibrate(vit, _images(1), rule=GuardRule(statistic="full"), full=False)
    assert not any(hasattr(m, "_fp4vis_state") for m in vit.modules())  # calibration cleaned up


# ------------------------------------------------------------------------------------------------
# Wan and MAE


@torch.no_grad()
def test_wan_calibration_guards_the_extreme_block(tmp_path):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    tiny = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16, out_channels=16,
                text_dim=32, freq_dim=32, ffn_dim=32, num_layers=3, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    model = diffusers.WanTransformer3DModel(**tiny)
    model.blocks[1].attn1.norm_q.weight.mul_(12)  # q and k pass RMS norms: scale their gains
    model.blocks[1].attn1.norm_k.weight.mul_(12)
    model.save_pretrained(tmp_path)
    model = diffusers.WanTransformer3DModel.from_pretrained(tmp_path).eval()
    g = torch.Generator().manual_seed(0)
    inp = dict(hidden_states=torch.randn(1, 16, 2, 8, 8, generator=g), timestep=torch.tensor([500]),
               encoder_hidden_states=torch.randn(1, 8, 32, generator=g), return_dict=False)
    plan = fp4vis.calibrate(model, [inp], policy="wan_fast", cross_attention=True)
    assert plan.guarded == ["blocks.1.attn1"]
    assert set(plan.stats) == {f"blocks.{i}.attn{j}" for i in range(3) for j in (1, 2)}
    exact = model(**inp)[0]
    with fp4vis.patch(model, "wan_fast"), pytest.raises(fp4vis.RangeExceededError):
        model(**inp)
    with fp4vis.patch(model, "wan_fast", guard=plan) as h:
        assert h.policies == {"blocks.0.attn1": "wan_fast", "blocks.1.attn1": "guard", "blocks.2.attn1": "wan_fast",
                              "blocks.0.attn2": None, "blocks.1.attn2": None, "blocks.2.attn2": None}
        out = model(**inp)[0]
    assert torch.isfinite(out).all() and fp4vis.cosine(out, exact) > 0.9


@torch.no_grad()
def test_mae_needs_no_guard(tmp_path):
    tr = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tr.ViTMAEConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                          image_size=32, patch_size=8, decoder_hidden_size=32, decoder_num_hidden_layers=2,
                          decoder_num_attention_heads=2, decoder_intermediate_size=64, mask_ratio=0.5)
    tr.ViTMAEForPreTraining(cfg).save_pretrained(tmp_path)
    mae = tr.ViTMAEForPreTraining.from_pretrained(tmp_path).eval()
    plan = fp4vis.calibrate(mae, [dict(pixel_values=x) for x in _images(1)], decoder=True)
    assert plan.guarded == [] and len(plan.stats) == 4
    assert {st.group for st in plan.stats.values()} == {"encoder", "decoder"}


# ------------------------------------------------------------------------------------------------
# plans that do not fit, files that are not plans, statistics that are not numbers


def _tiny_timm(heads, depth=4, dim=64):
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=dim,
                             depth=depth, num_heads=heads, num_classes=10).eval()


def test_plan_is_refused_on_another_architecture(vit, tmp_path):
    """The plan's fingerprint (layer names, heads, head dims, model id): a plan made on the 2-head model
    is refused on a 4-head one and on a shallower one, even where it guards nothing; another model id
    with the same layers only warns."""
    plan = fp4vis.calibrate(vit, _images(1), policy="fast", model_id="tiny-vit", rule=GuardRule(fraction=0.99999))
    with pytest.raises(fp4vis.GuardPlanError, match="blocks.0.attn has 4 heads of dim 16 here, 2 of dim 32"):
        fp4vis.patch(_tiny_timm(heads=4), guard=plan)
    nothing = plan.redecide(threshold=1e9)
    assert nothing.guarded == []
    with pytest.raises(fp4vis.GuardPlanError, match="blocks.3.attn is not a layer of this model"):
        fp4vis.patch(_tiny_timm(heads=2, depth=2), guard=nothing)
    with pytest.raises(fp4vis.GuardPlanError, match="blocks.4.attn is not in the plan"):
        fp4vis.patch(_tiny_timm(heads=2, depth=6), guard=plan)   # deeper: blocks 4, 5 would go unguarded
    assert GuardPlan.from_dict(plan.to_dict()).architecture == {n: [2, 32] for n in NAMES}
    with pytest.warns(RuntimeWarning, match="calibrated on 'tiny-vit'"):
        fp4vis.patch(_tiny_timm(heads=2), guard=nothing).remove()


def test_bad_plan_files_raise_one_clear_error(vit, tmp_path):
    plan = fp4vis.calibrate(vit, _images(1), policy="fast", model_id="tiny-vit")
    good = tmp_path / "plan.json"
    plan.save(good)
    text = good.read_text()
    cases = {"truncated.json": text[: len(text) // 2], "empty.json": "", "list.json": "[1, 2]",
             "binary.json": b"\xff\xfe\x00".decode("latin-1"),
             "no_policy.json": json.dumps({k: v for k, v in json.loads(text).items() if k != "policy"})}
    for name, body in cases.items():
        (tmp_path / name).write_text(body, encoding="latin-1" if name == "binary.json" else "utf-8")
        with pytest.raises(fp4vis.GuardPlanError, match=name):
            GuardPlan.load(tmp_path / name)
    with pytest.raises(fp4vis.GuardPlanError, match="missing.json"):
        GuardPlan.load(tmp_path / "missing.json")


def test_failed_save_keeps_the_good_plan(vit, tmp_path, monkeypatch):
    """Written atomically: a full disk (the flush to disk fails) leaves the old file whole and no
    temporary file behind."""
    plan = fp4vis.calibrate(vit, _images(1), policy="fast", model_id="tiny-vit")
    path = tmp_path / "plan.json"
    plan.save(path)
    before = path.read_bytes()

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("fp4vis.files.os.fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        plan.redecide(threshold=1.0).save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before and GuardPlan.load(path).guarded == plan.guarded
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_non_finite_calibration_logits_raise_naming_the_layer(vit):
    with torch.no_grad():
        vit.blocks[2].attn.qkv.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="layer 'blocks.2.attn'.*non-finite logits"):
        fp4vis.calibrate(vit, _images(1), policy="fast")
    assert not any(hasattr(m, "_fp4vis_state") for m in vit.modules())


def _layer_edit(field, value):
    def edit(d):
        d["layers"]["blocks.1.attn"][field] = value
    return edit


# (how a saved plan is edited, the error it gives): each field of the saved form, checked on reading
PLAN_EDITS = {
    "layers as a list": (lambda d: d.update(layers=list(d["layers"].values())),
                         r"layers: expected an object \{layer name: statistics\}, got a list"),
    "guarded as a string": (lambda d: d.update(guarded="blocks.1.attn"),
                            "guarded: expected a list of layer names, got the string 'blocks.1.attn'"),
    "guarded with a number": (lambda d: d.update(guarded=[1]), r"guarded\[0\]: expected a string, got 1"),
    "policy as a name": (lambda d: d.update(policy="fast"),
                         "policy: expected the policy's fields as an object .* got the string 'fast'"),
    "guard policy of an unknown field": (lambda d: d["guard_policy"].update(anchors=128),
                                         "guard_policy: unknown field 'anchors'"),
    "policy of a bad value": (lambda d: d["policy"].update(shift="16"), r"policy: .*shift \(L\) must be an integer"),
    "a statistic of 1e999": (_layer_edit("sampled_max_log2", math.inf),
                             r"layers\['blocks.1.attn'\].sampled_max_log2: expected a finite number, got inf"),
    "a statistic as text": (_layer_edit("value", "95"),
                            r"layers\['blocks.1.attn'\].value: expected a finite number or null, got the string '95'"),
    "a decision as a number": (_layer_edit("guarded", 1),
                               r"layers\['blocks.1.attn'\].guarded: expected true or false, got 1"),
    "heads as true": (_layer_edit("num_heads", True),
                      r"layers\['blocks.1.attn'\].num_heads: expected an integer >= 0, got true"),
    "a layer under another name": (_layer_edit("name", "blocks.2.attn"),
                                   r"layers\['blocks.1.attn'\].name: expected the layer's key"),
    "a layer without its statistic": (lambda d: d["layers"]["blocks.1.attn"].pop("sampled_max_log2"),
                                      r"layers\['blocks.1.attn'\]: missing field 'sampled_max_log2'"),
    "an unknown field": (lambda d: d.update(guard_layers=[]), "unknown field 'guard_layers'"),
    "no guarded field": (lambda d: d.pop("guarded"), "missing field 'guarded'"),
    "a rule of an unknown statistic": (lambda d: d["rule"].update(statistic="median"),
                                       "rule.statistic: expected 'sampled' or 'full', got 'median'"),
    "a rule threshold of 1e999": (lambda d: d["rule"].update(threshold=math.inf),
                                  "rule.threshold: expected a finite number or null, got inf"),
    "a fingerprint of one number": (lambda d: d["architecture"].update({"blocks.1.attn": [2]}),
                                    r"architecture\['blocks.1.attn'\]: expected \[heads, head dim\].*"
                                    r"got the list \[2\]"),
    "a version that is true": (lambda d: d.update(version=True), "guard plan version True is not supported"),
    "samples as text": (lambda d: d.update(n_samples="128"), "n_samples: expected an integer >= 1"),
}


def test_plan_files_are_checked_field_by_field(vit, tmp_path):
    """Every field GuardPlan.save writes is checked on reading (types, finite statistics, required and unknown
    fields): one GuardPlanError naming the file and the field, where a list of layers raised AttributeError,
    a guarded name was read letter by letter, a policy name and a statistic of 1e999 (inf) were taken."""
    plan = fp4vis.calibrate(vit, _images(1), policy="fast", model_id="tiny-vit")
    saved = json.loads(json.dumps(plan.to_dict()))
    assert GuardPlan.from_dict(saved).to_dict() == plan.to_dict()
    for case, (edit, expected) in PLAN_EDITS.items():
        d = json.loads(json.dumps(saved))
        edit(d)
        path = tmp_path / "plan.json"
        path.write_text(json.dumps(d).replace("Infinity", "1e999"))   # how JSON writes a number read as inf
        with pytest.raises(fp4vis.GuardPlanError, match="plan.json': " + expected) as exc:
            GuardPlan.load(path)
        assert isinstance(exc.value, ValueError), case
    # what the writer writes for a layer never recorded ("-inf"), and plans written before fingerprints
    old = json.loads(json.dumps(saved))
    old.pop("architecture")
    old["layers"]["blocks.0.attn"].update(sampled_max_log2="-inf", calls=0)
    back = GuardPlan.from_dict(old)
    assert back.architecture == {} and back.stats["blocks.0.attn"].sampled_max_log2 == -math.inf
