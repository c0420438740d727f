"""The demo's video section: ``fp4vis:digits-wan`` under every policy, over a set of prompts, in float32.

Why float32: in BF16 the CPU's own BF16 kernels (which differ between CPUs: AVX2 emulation, AVX-512
BF16, AMX) decide the last bits of every matrix product; Direct-P's codes are a step function of the
scores, so those bits flip codes, and after 12 denoising steps one clip's latent cosine moved from
0.958 to 0.969 between two machines at the same commit. In float32 the products are IEEE float32 on
every CPU, up to the summation order of the BLAS (threads, vector width); the demo states how much
that moves its figures (docs/demo.md).

Why several prompts: one clip is one draw. ``clips`` prompts spread over the digits and directions
(``fp4vis.zoo.moving_digits.balanced_prompts``), clip i from seed ``SEED + i``, run as one batch
with the same initial noise and prompt embeddings under every policy. Per policy:

- the latents after 1, 4 and all steps against BF16's (cosine, relL2), per clip, then the mean over
  clips with its 95 % Student-t interval;
- the decoded frames against BF16's (PSNR, SSIM per frame, then per clip), the same way;
- what the reader (``fp4vis.zoo.moving_digits.read_clips``) sees in each clip: the prompted digit and
  direction or not, with the 95 % Wilson interval of the rate, BF16 included (the model's own rate);
- the paired difference of every FP4 policy to ``fast`` over the same clips (cos @all, PSNR), with its
  interval: what decides whether two policies differ;
- operator error: each self-attention layer re-run under the policy on the BF16 run's inputs after
  1, 4 and all steps (``fp4vis.evals.wan_fidelity.OperatorError``), per layer and its mean;
- the layers' logits: ``fp4vis.calibrate`` (the project's guard calibration, ``full=True``) on the
  transformer calls of the BF16 run at those steps: per layer the largest logit z·log2(e) over all
  keys and over the guard's sampled keys, the policy's limit and the calibration rule's decision. That
  is what says whether the guard has anything to guard here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fp4vis import zoo
from fp4vis.evals.common import error_metrics, frame_metrics
from fp4vis.evals.demo_defaults import DEFAULT_CLIPS
from fp4vis.evals.plots import frame_strip
from fp4vis.evals.report import fmt, markdown_table, mean_ci95, wilson_ci95, write_report
from fp4vis.evals.wan_fidelity import OperatorError
from fp4vis.pipelines.media_files import mp4_unavailable, save_mp4
from fp4vis.pipelines.wan_sizes import tokens_per_frame_sequence
from fp4vis.pipelines.wan_video import (
    GenerationConfig,
    decode_clips,
    encode_prompt,
    generate,
    initial_latents,
    load_wan_pipeline,
)
from fp4vis.services.policies import resolve_policies
from fp4vis.services.sources import display_source
from fp4vis.services.timing import Timer
from fp4vis.services.usage import UsageError
from fp4vis.zoo import moving_digits as md

VIDEO_DTYPE = "float32"   # machine-independent figures (module docstring)
LATENT_STEPS = (1, 4)     # and all steps: as the method's authors report the latent error
STRIP = ("bf16", "fast", "accurate", "guard")   # the rows of the frame strip and the clip sheet, those that ran
PAIRED_WITH = "fast"      # every other FP4 policy is compared with this one, clip by clip
BACKEND = "reference"
SEED = 0
NAME = "demo_wan"


def video_record(video_model: str, source: str) -> dict[str, Any]:
    """The video model's training record: the shipped one checked against its weights (sha256)."""
    if zoo.is_zoo_source(video_model):
        return zoo.verify(zoo.get(video_model).name)
    record = Path(source) / "training.json"
    if not record.is_file():
        raise UsageError(f"--video-model: {video_model!r} has no training.json with its generation settings (size, "
                         "frames, steps); scripts/train_digits_video.py writes one")
    return json.loads(record.read_text())


def min_travel(gen: dict[str, Any]) -> float:
    """Half the shortest motion of the model's clips: below it the reader says 'still'."""
    return 0.5 * min(md.MIN_SPEED, md.max_speed(gen["height"], gen["frames"])) * (gen["frames"] - 1)


class TransformerCalls:
    """Keeps the transformer's inputs (args, kwargs) of the denoising steps in ``steps`` (1 = the first),
    every call of the step (both passes under guidance): the calibration inputs of ``fp4vis.calibrate``.
    Install the hook around the run and pass the object as a ``callback_on_step_end``."""

    tensor_inputs = ["latents"]

    def __init__(self, transformer: torch.nn.Module, steps: Sequence[int]):
        self.transformer, self.steps = transformer, set(int(s) for s in steps)
        self.kept: list[tuple[tuple, dict]] = []
        self._step: list[tuple[tuple, dict]] = []
        self._handle: Any = None

    def __enter__(self) -> TransformerCalls:
        def hook(module, args, kwargs):
            self._step.append((args, dict(kwargs)))
        self._handle = self.transformer.register_forward_pre_hook(hook, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()

    def __call__(self, pipeline, step_index: int, timestep, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
        if step_index + 1 in self.steps:
            self.kept += self._step
        self._step = []
        return callback_kwargs

    def inputs(self) -> list[dict[str, Any]]:
        """The kept calls as ``fp4vis.calibrate`` inputs (keyword arguments: the pipeline passes everything
        by keyword)."""
        if any(args for args, _ in self.kept):
            raise RuntimeError("the pipeline called its transformer with positional arguments")
        return [kwargs for _, kwargs in self.kept]


def run_video(video_model: str | None, source: str | None, names: Sequence[str], out: Path, *,
              clips: int = DEFAULT_CLIPS, progress: bool, say: Callable[[str], Any]) -> dict[str, Any]:
    """The video section (module docstring): returns its result and writes ``demo_wan.json`` / ``.md``, the
    frame strip, the clip sheet and the first clip of every policy (MP4) under ``out``."""
    if video_model is None:
        return {"model": None, "status": "left out", "note": "left out (--no-video)"}
    shown = display_source(video_model)
    if source is None:
        return {"model": shown, "status": "missing",
                "note": f"the weights of {shown} are not installed here; scripts/train_digits_video.py writes them"}
    if not 1 <= clips <= len(md.PROMPTS):
        raise UsageError(f"--video-clips: between 1 and {len(md.PROMPTS)} (the model's prompts), got {clips}")
    record = video_record(video_model, source)
    gen = record["generation"]
    prompts = md.balanced_prompts(clips)
    texts = [md.PROMPTS[i] for i in prompts]
    seeds = [SEED + i for i in range(clips)]
    fp4 = [p for p in resolve_policies([n for n in names if n != "bf16"], allow_bf16=False)]
    say(f"video {shown}: {clips} prompts, {gen['width']}x{gen['height']}, {gen['frames']} frames, {gen['steps']} "
        f"steps, guidance {gen['guidance_scale']}, {VIDEO_DTYPE}, policies {', '.join(names)}")
    timings: dict[str, float] = {}
    with Timer() as t:
        pipe = load_wan_pipeline(source, device="cpu", dtype=VIDEO_DTYPE)
        pe, npe, _ = encode_prompt(pipe, texts, guidance_scale=gen["guidance_scale"])
        if npe is not None:
            npe = npe.expand(clips, -1, -1).contiguous()
        latents = torch.cat([initial_latents(pipe, height=gen["height"], width=gen["width"], frames=gen["frames"],
                                             seed=s) for s in seeds])
    timings["load_s"] = t.seconds
    steps = int(gen["steps"])
    keep = tuple(k for k in LATENT_STEPS if k < steps)
    measured = (*keep, steps)
    common = GenerationConfig(prompt_embeds=pe, negative_prompt_embeds=npe, height=gen["height"], width=gen["width"],
                              frames=gen["frames"], steps=steps, guidance_scale=gen["guidance_scale"], seed=SEED,
                              backend=BACKEND, progress=progress, latents=latents, decode=False, latents_after=keep)
    reader = md.load_reader()
    op_error = OperatorError(pipe, fp4, backend=BACKEND, steps=measured)
    calls = TransformerCalls(pipe.transformer, measured)
    runs: dict[str, dict[str, Any]] = {}
    frames: dict[str, np.ndarray] = {}
    for name in names:
        with Timer() as t:
            if name == "bf16":
                with op_error.recorder, calls:
                    res = generate(pipe, common, policy=name, callbacks=(op_error, calls))
            else:
                res = generate(pipe, common, policy=name)
            frames[name] = decode_clips(pipe, res.latents)
            seen = md.read_clips(md.from_frames(frames[name]), reader, min_travel=min_travel(gen))
        runs[name] = {"result": res, "reading": seen, "seconds": t.seconds}
        timings[f"{name}_s"] = t.seconds
    if op_error.recorder.calls:
        timings["bf16_s"] -= op_error.seconds
        timings["operator_error_s"] = op_error.seconds
    with Timer() as t:
        logits = logit_ranges(pipe.transformer, calls.inputs(), fp4, measured)
    timings["logits_s"] = t.seconds
    rows = per_clip_rows(names, runs, frames, prompts, seeds, measured)
    ops = op_error.summary()
    result = {
        "model": shown, "status": "measured", "dtype": VIDEO_DTYPE, "backend": BACKEND, "generation": gen,
        "clips": clips, "prompts": texts, "seeds": seeds,
        "prompt_choice": "fp4vis.zoo.moving_digits.balanced_prompts: digit d moving DIRECTIONS[(d + k) % 4]",
        "tokens": tokens_per_frame_sequence(pipe, height=gen["height"], width=gen["width"], frames=gen["frames"]),
        "latent_steps": list(measured), "policies": summarize(names, rows, ops, measured),
        "paired_with": PAIRED_WITH if PAIRED_WITH in names else None,
        "logits": logits, "per_clip": rows, "seconds": timings, "cpu": cpu_record(),
        "weights_sha256": record.get("weights_sha256"), "trained": record.get("final"),
    }
    if result["paired_with"]:
        result["paired"] = paired_differences(names, rows, PAIRED_WITH, steps)
    result["files"] = write_video_files(result, frames, out, fps=gen.get("fps", 8))
    files = write_report(out, NAME, result, video_markdown(result))
    result["files"]["report"] = {k: str(v) for k, v in files.items()}
    return result


def cpu_record() -> dict[str, Any]:
    """What decides the last bits of a float32 product here: the CPU, the vector ISA torch dispatches to,
    the threads (the BLAS's summation order)."""
    model = None
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:   # not Linux: the platform string in the environment record says what it can
        pass
    return {"model": model, "capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}


def logit_ranges(transformer: torch.nn.Module, inputs: list, fp4: Sequence[Any],
                 steps: Sequence[int]) -> dict[str, Any]:
    """Per self-attention layer: the logit statistics of ``fp4vis.calibrate`` (base policy ``fast``,
    ``full=True``) on the recorded transformer calls, the limit of every Direct-P policy that ran and the
    rule's decision."""
    from fp4vis import calibrate
    from fp4vis.patching.guard_plan import policy_limit

    plan = calibrate(transformer, inputs, policy="fast", full=True, model_id="digits-wan transformer")
    layers = {}
    for name, st in plan.stats.items():
        layers[name] = {"full_max_log2": st.full_max_log2, "sampled_max_log2": st.sampled_max_log2,
                        "anchor_gap_log2": st.anchor_gap_log2, "calls": st.calls, "scale": st.scale,
                        "limit_log2": {p.name: policy_limit(p, st.scale) for p in fp4 if p.method == "direct_p"}}
    return {"layers": layers, "steps": list(steps), "calls": plan.num_inputs, "rule": plan.rule.describe(plan.policy),
            "guarded": plan.decide(), "n_samples": plan.n_samples,
            "max_full_log2": max(v["full_max_log2"] for v in layers.values())}


def per_clip_rows(names: Sequence[str], runs: dict[str, dict[str, Any]], frames: dict[str, np.ndarray],
                  prompts: Sequence[int], seeds: Sequence[int], steps: Sequence[int]) -> list[dict[str, Any]]:
    """One row per clip: its prompt and seed, and per policy the latent and frame figures against BF16
    and what the reader saw."""
    cosine, rel_l2 = error_metrics()
    ref = runs["bf16"]["result"]
    last = steps[-1]
    rows = []
    for i, (p, seed) in enumerate(zip(prompts, seeds)):
        digit, direction = divmod(p, len(md.DIRECTIONS))
        row: dict[str, Any] = {"prompt": md.PROMPTS[p], "seed": seed, "policies": {}}
        for name in names:
            res, seen = runs[name]["result"], runs[name]["reading"]
            d = int(seen.direction[i])
            fig: dict[str, Any] = {
                "read_digit": int(seen.digit[i]), "read_direction": md.DIRECTIONS[d] if d != md.STILL else "still",
                "digit_right": int(seen.digit[i]) == digit, "direction_right": d == direction}
            if name != "bf16":
                pairs = {k: (res.step_latents[k][i], ref.step_latents[k][i]) for k in steps if k != last}
                pairs[last] = (res.latents[i], ref.latents[i])
                fig["latent_cosine_after"] = {str(k): cosine(a, b) for k, (a, b) in pairs.items()}
                fig["latent_rel_l2_after"] = {str(k): rel_l2(a, b) for k, (a, b) in pairs.items()}
                m = frame_metrics(frames[name][i], frames["bf16"][i])
                fig["psnr_db"], fig["ssim"] = m["psnr_mean"], m["ssim_mean"]
            row["policies"][name] = fig
        rows.append(row)
    return rows


def summarize(names: Sequence[str], rows: list[dict[str, Any]], ops: dict[str, dict[str, Any]],
              steps: Sequence[int]) -> dict[str, dict[str, Any]]:
    """Per policy: the mean over clips with its 95 % interval of every figure, the reader's rates with
    their Wilson intervals, the operator error."""
    out = {}
    for name in names:
        figs = [r["policies"][name] for r in rows]
        s: dict[str, Any] = {
            "digit_read": wilson_ci95(sum(f["digit_right"] for f in figs), len(figs)),
            "direction_read": wilson_ci95(sum(f["direction_right"] for f in figs), len(figs)),
            "same_digit_as_bf16": sum(f["read_digit"] == r["policies"]["bf16"]["read_digit"]
                                      for f, r in zip(figs, rows))}
        if name != "bf16":
            s["latent_cosine_after"] = {
                str(k): _at_most_one(mean_ci95([f["latent_cosine_after"][str(k)] for f in figs])) for k in steps}
            s["latent_rel_l2_after"] = {str(k): mean_ci95([f["latent_rel_l2_after"][str(k)] for f in figs])
                                        for k in steps}
            s["psnr_db"] = mean_ci95([f["psnr_db"] for f in figs])
            s["ssim"] = mean_ci95([f["ssim"] for f in figs])
            s["attention_rel_l2"] = ops.get(name, {}).get("rel_l2_mean")
            s["attention_rel_l2_per_layer"] = ops.get(name, {}).get("rel_l2_mean_per_layer")
        out[name] = s
    return out


def _at_most_one(ci: dict[str, Any]) -> dict[str, Any]:
    """A cosine's t-interval, its upper end cut at 1 (no mean cosine is above it)."""
    if ci.get("ci95_high") is not None and ci["ci95_high"] > 1.0:
        ci = {**ci, "ci95_high": 1.0}
    return ci


def paired_differences(names: Sequence[str], rows: list[dict[str, Any]], base: str, steps: int) -> dict[str, Any]:
    """Every FP4 policy minus ``base``, clip by clip: latent cosine after all steps and frames' PSNR."""
    out = {}
    for name in names:
        if name in ("bf16", base):
            continue
        a = [r["policies"][name] for r in rows]
        b = [r["policies"][base] for r in rows]
        out[name] = {"latent_cosine": mean_ci95([x["latent_cosine_after"][str(steps)] - y["latent_cosine_after"]
                                                 [str(steps)] for x, y in zip(a, b)]),
                     "psnr_db": mean_ci95([x["psnr_db"] - y["psnr_db"] for x, y in zip(a, b)])}
    return out


def write_video_files(r: dict[str, Any], frames: dict[str, np.ndarray], out: Path, *, fps: int) -> dict[str, Any]:
    """The frame strip of the first clip, the sheet of every clip's middle frame, the first clip's MP4 per
    policy (the demo says so when ffmpeg is missing)."""
    rows = {p: frames[p] for p in STRIP if p in frames}
    first = r["prompts"][0]
    strip = frame_strip({p: f[0] for p, f in rows.items()}, out / "demo_frames.png",
                        title=f"\"{first}\", seed {r['seeds'][0]}, {r['generation']['steps']} steps, {r['dtype']}")
    middle = r["generation"]["frames"] // 2
    sheet = frame_strip({p: f[:, middle] for p, f in rows.items()}, out / "demo_clips.png", every=1,
                        columns=[p.replace("digit ", "").replace("moving ", "") for p in r["prompts"]],
                        title=f"frame {middle} of every clip (column i: clip i, seed i, its prompt above)")
    files: dict[str, Any] = {"strip": str(strip), "sheet": str(sheet), "mp4": {}}
    skip = mp4_unavailable()
    if skip:
        files["mp4_skipped"] = skip
        return files
    for p, f in frames.items():
        files["mp4"][p] = str(save_mp4(f[0], out / f"{NAME}_{p}.mp4", fps=fps))
    return files


# --------------------------------------------------------------------------------------------------
# tables


def _ci(c: dict[str, Any] | None, digits: int = 3) -> str:
    if not c or c.get("mean") is None:
        return "n/a"
    if c.get("ci95_low") is None:
        return f"{c['mean']:.{digits}f}"
    return f"{c['mean']:.{digits}f} [{c['ci95_low']:.{digits}f}, {c['ci95_high']:.{digits}f}]"


def rate(c: dict[str, Any]) -> str:
    """``9/10 [60, 98] %``: the count and the 95 % Wilson interval of the rate."""
    return f"{c['k']}/{c['n']} [{100 * c['ci95_low']:.0f}, {100 * c['ci95_high']:.0f}] %"


def video_headers(r: dict[str, Any]) -> list[str]:
    steps = r["latent_steps"]
    return (["policy"] + [f"cos @{k}" for k in steps[:-1]] + [f"cos @{steps[-1]} [95 %]", "frames PSNR dB [95 %]",
                                                                "SSIM", "attn relL2", "digit read [95 %]",
                                                                "direction read [95 %]"])


def video_rows(r: dict[str, Any]) -> list[list[Any]]:
    steps = [str(k) for k in r["latent_steps"]]
    rows = []
    for name, s in r["policies"].items():
        reads = [rate(s["digit_read"]), rate(s["direction_read"])]
        if name == "bf16":
            rows.append([name] + ["1"] * len(steps) + ["inf (itself)", "1", "0", *reads])
            continue
        cos = s["latent_cosine_after"]
        rows.append([name, *(f"{cos[k]['mean']:.6f}" for k in steps[:-1]), _ci(cos[steps[-1]], 4),
                     _ci(s["psnr_db"], 2), f"{s['ssim']['mean']:.4f}", fmt(s["attention_rel_l2"], 4), *reads])
    return rows


def paired_rows(r: dict[str, Any]) -> list[list[Any]]:
    return [[f"{name} - {r['paired_with']}", _ci(d["latent_cosine"], 4), _ci(d["psnr_db"], 2)]
            for name, d in r.get("paired", {}).items()]


def logit_rows(r: dict[str, Any]) -> list[list[Any]]:
    lg = r["logits"]
    rows = []
    for layer, st in lg["layers"].items():
        ops = [r["policies"][p].get("attention_rel_l2_per_layer", {}).get(layer) for p in r["policies"] if p != "bf16"]
        rows.append([layer, f"{st['full_max_log2']:.2f}", f"{st['sampled_max_log2']:.2f}",
                     *(fmt(e, 4) for e in ops)])
    return rows


def logit_headers(r: dict[str, Any]) -> list[str]:
    return (["layer", "max logit z*log2(e)", "over sampled keys"]
            + [f"{p} attn relL2" for p in r["policies"] if p != "bf16"])


def video_caption(r: dict[str, Any]) -> str:
    g = r["generation"]
    return (f"video {r['model']}, {r['dtype']}: {r['clips']} clips (prompts spread over the digits and directions, "
            f"clip i from seed {r['seeds'][0]} + i), {g['steps']} steps, guidance {g['guidance_scale']}, "
            f"{r['tokens']} tokens; against bf16 (exact attention), mean over clips [95 % interval]")


def logit_note(r: dict[str, Any]) -> str:
    """What the calibration says about the guard here, from the measured statistics."""
    lg = r["logits"]
    limits = {p: v for layer in lg["layers"].values() for p, v in layer["limit_log2"].items()}
    guarded = ", ".join(lg["guarded"]) or "none"
    return (f"self-attention logits (fp4vis.calibrate on the bf16 run's {lg['calls']} transformer calls after steps "
            f"{', '.join(map(str, lg['steps']))}): the largest z*log2(e) of any layer is {lg['max_full_log2']:.1f}; "
            f"P blocks saturate above {min(limits.values()):.0f} (fast); the rule ({lg['rule']}) guards: {guarded}")


def text_table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [headers] + [[c if isinstance(c, str) else fmt(c, 4) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def video_summary(r: dict[str, Any]) -> str:
    """What the command prints for the video: the policies, the paired differences, the logit note."""
    text = video_caption(r) + "\n" + text_table(video_headers(r), video_rows(r))
    if r.get("paired"):
        text += ("\n\npaired over the same clips (mean [95 % interval]; an interval that holds 0: no difference "
                 "shown)\n" + text_table(["difference", f"cos @{r['latent_steps'][-1]}", "frames PSNR dB"],
                                         paired_rows(r)))
    return text + "\n\n" + logit_note(r)


def video_markdown(r: dict[str, Any]) -> str:
    g = r["generation"]
    lines = [
        f"# fp4vis demo, video: `{r['model']}`", "",
        f"{r['clips']} clips, one per prompt of {', '.join(r['prompts'])}; clip i from seed {r['seeds'][0]} + i, the "
        f"same initial noise and prompt embeddings under every policy; {g['width']}x{g['height']}, {g['frames']} "
        f"frames, {g['steps']} steps, guidance {g['guidance_scale']}, the whole pipeline in {r['dtype']} on the CPU, "
        f"FP4 policies on the `{r['backend']}` backend.", "",
        markdown_table(video_headers(r), video_rows(r)), "",
        "cos @k: the latents after k denoising steps against BF16's (fp4vis.metrics), per clip, then the mean over "
        "clips with its 95 % Student-t interval. Frames PSNR / SSIM: each decoded frame against BF16's (torchmetrics, "
        "[0, 1]), the mean over frames per clip, then over clips. attn relL2: the operator error of the "
        "self-attention, each layer re-run under the policy on the BF16 run's inputs after "
        f"{', '.join(map(str, r['latent_steps']))} steps, mean over steps and layers. Digit / direction read: how "
        "many clips the reader (fp4vis:digits-vit on 28 px crops around the digit, and the digit's path; "
        "fp4vis.zoo.moving_digits) reads as the prompted digit / direction, with the 95 % Wilson interval.", "",
    ]
    if r.get("paired"):
        lines += [f"Paired over the same clips, each FP4 policy minus `{r['paired_with']}` (mean [95 % interval]):", "",
                  markdown_table(["difference", f"cos @{r['latent_steps'][-1]}", "frames PSNR dB"], paired_rows(r)),
                  ""]
    lines += [logit_note(r) + ".", "", markdown_table(logit_headers(r), logit_rows(r)), "",
              "max logit: the largest logit z*log2(e) = q.k * scale * log2(e) of the layer over all keys, rows, heads, "
              f"clips and calls; over sampled keys: against the guard's {r['logits']['n_samples']} sampled keys "
              "(docs/numerics.md section 4).", "",
              "Per clip (read as: digit and direction per policy):", "",
              markdown_table(["clip", "seed"] + list(r["policies"]),
                             [[c["prompt"], c["seed"]] + [f"{f['read_digit']} {f['read_direction']}"
                                                          for f in c["policies"].values()] for c in r["per_clip"]]),
              "", f"![first clip]({Path(r['files']['strip']).name}) ![every clip]({Path(r['files']['sheet']).name})"]
    return "\n".join(lines)
