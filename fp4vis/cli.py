"""The ``fp4vis`` command line: generate videos, run the evals and the kernel benchmark, calibrate
guard plans, and say which attention backends work on this machine.

    fp4vis info
    fp4vis bench --quick
    fp4vis generate --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --prompt "a red fox in the snow" --policy fast
    fp4vis eval vit --model timm/vit_base_patch16_224.augreg2_in21k_ft_in1k --data ~/imagenet/val --resolution 1008
    fp4vis eval mae --model facebook/vit-mae-base --data ~/photos
    fp4vis eval wan --speed-only 1.3B --steps 2
    fp4vis calibrate wan --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --prompt "a red fox" --out plan.json

Every command takes a Hub id or a local directory for its weights, never downloads implicitly for a
path, prints a one-line error (exit status 2) for bad options, missing paths or GPU-only options on
a machine without a GPU, and shows progress bars on long work (``--no-progress`` hides them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fp4vis.policy import POLICIES

POLICY_HELP = ", ".join(sorted(POLICIES))
BENCH_BACKENDS = ("hopper", "hopper_kernel", "prepass", "fa4", "sdpa_cudnn", "sdpa_flash", "sage")
EPILOG = ("Weights: a Hugging Face Hub id (org/name, downloaded by the Hub client as usual) or a local "
          "directory. Policies: " + POLICY_HELP + " (bf16 = the model's own attention). Docs: README.md.")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Shows every option's default (also for options without help text), but not 'None' / False."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = (action.help or "").strip()
        d = action.default
        if (d is not None and d is not False and d is not argparse.SUPPRESS and "%(default)" not in text
                and action.option_strings and not isinstance(
                    action, (argparse._HelpAction, argparse._StoreTrueAction, argparse._StoreFalseAction))):
            text = f"{text} (default: %(default)s)".strip()
        return text


def _fill_help(parser: argparse.ArgumentParser) -> None:
    """Give options without help text one, so that the formatter can show their default."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _fill_help(sub)
        elif (action.option_strings and not action.help and action.default is not None
              and not isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))):
            action.help = "(default: %(default)s)"


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}")
    return v


def _int_list(s: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def _policy(s: str) -> str:
    if s not in POLICIES:
        raise argparse.ArgumentTypeError(f"unknown policy {s!r}; known policies are {POLICY_HELP}")
    return s


def _policy_list(s: str) -> str:
    for p in (x.strip() for x in s.split(",")):
        if p and p not in POLICIES:
            raise argparse.ArgumentTypeError(f"unknown policy {p!r}; known policies are {POLICY_HELP}")
    return s


def _add_runtime(p: argparse.ArgumentParser, *, default_dtype: str = "bfloat16") -> None:
    g = p.add_argument_group("runtime")
    g.add_argument("--device", default="auto", help="auto (CUDA when visible, else CPU), cpu, cuda or cuda:N")
    g.add_argument("--dtype", default=default_dtype, choices=["bfloat16", "float16", "float32"],
                   help="model dtype (the BF16 baseline runs in this dtype too)")
    g.add_argument("--backend", default="auto", choices=["auto", "reference", "hopper"],
                   help="FP4 attention backend; auto picks the kernel for this GPU and falls back to the "
                        "reference emulation (hopper needs an sm_90 GPU)")
    g.add_argument("--guard-plan", metavar="JSON", help="guard plan written by `fp4vis calibrate`")
    g.add_argument("--no-progress", action="store_true", help="hide progress bars")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fp4vis", formatter_class=_Formatter, epilog=EPILOG,
        description="Direct-P FP4 attention for vision and video diffusion models: generate, evaluate, "
                    "benchmark, calibrate.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    # ---------------------------------------------------------------- info
    p = sub.add_parser("info", formatter_class=_Formatter, help="which backends work here and why the others do not",
                       description="Versions, GPU, and every attention backend: usable here, or why not.")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")

    # ---------------------------------------------------------------- bench
    p = sub.add_parser("bench", formatter_class=_Formatter, help="kernel benchmark: speed and error per backend",
                       description="Time every attention backend and baseline available here on the kernel "
                                   "shape grid; write JSON, a Markdown table and a speed-error plot (PNG).")
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes, reference backend on the CPU: runs anywhere in seconds (a smoke test)")
    p.add_argument("--policies", type=_policy_list, default="fast", help="FP4 policies of the fp4vis backends")
    p.add_argument("--backends", default=None,
                   help="comma-separated subset of " + ", ".join(BENCH_BACKENDS) + ", reference "
                        "(default: all but the slow reference; each one that cannot run here is listed "
                        "with its reason)")
    p.add_argument("--grid", default="d128", choices=["d128", "d64", "all"],
                   help="shape grid: the D=128 video grid, the D=64 ViT shapes, or both")
    p.add_argument("--out-dir", default="out", help="where to write NAME.json, NAME.md and NAME.png")
    p.add_argument("--name", default=None, help="base file name (default: kernel_bench or kernel_bench_quick)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")

    # ---------------------------------------------------------------- generate
    p = sub.add_parser("generate", formatter_class=_Formatter, help="generate a video with Wan2.1 (T2V or I2V)",
                       description="Generate a video with a Wan2.1 pipeline under an attention policy; write an "
                                   "MP4 and a JSON sidecar (model, prompt, seed, frames, steps, policy, guard "
                                   "plan, timings, versions, GPU).")
    p.add_argument("--model", required=True, help="Hub id (e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers) or local "
                                                  "diffusers folder")
    p.add_argument("--prompt", required=True)
    p.add_argument("--negative-prompt", default=None)
    p.add_argument("--image", default=None, help="conditioning image for image-to-video (I2V) models")
    p.add_argument("--policy", type=_policy, default="fast", help=f"one of {POLICY_HELP}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--frames", type=_positive_int, default=81, help="number of frames (4k+1)")
    p.add_argument("--steps", type=_positive_int, default=50, help="denoising steps")
    p.add_argument("--height", type=_positive_int, default=480)
    p.add_argument("--width", type=_positive_int, default=832)
    p.add_argument("--guidance", type=float, default=5.0, help="classifier-free guidance scale")
    p.add_argument("--fps", type=_positive_int, default=16)
    p.add_argument("--exact-steps", type=_int_list, default=None, metavar="I,J",
                   help="denoising steps that run exact attention, e.g. 0,-1 (first and last)")
    p.add_argument("--output", "-o", default="video.mp4", help="MP4 path (the sidecar gets the same name, .json)")
    _add_runtime(p)

    # ---------------------------------------------------------------- eval
    pe = sub.add_parser("eval", formatter_class=_Formatter, help="quality/speed evals: vit, mae, wan",
                        description="Measure what FP4 attention costs in quality (and gains in speed) against "
                                    "the model's own BF16 attention. Each eval writes NAME.json and NAME.md.")
    esub = pe.add_subparsers(dest="eval_command", metavar="EVAL")
    esub.required = True

    p = esub.add_parser("vit", formatter_class=_Formatter, help="ViT classifier: top-1, agreement, logit and "
                                                                "per-layer attention error",
                        description="A timm or transformers classifier on an ImageFolder dataset "
                                    "(ROOT/<class>/<image>). Sharded over GPUs with `accelerate launch -m "
                                    "fp4vis.cli eval vit ...`.")
    p.add_argument("--model", required=True, help="Hub id (timm/... or a transformers id), local folder, or "
                                                  "timm:<registry name> (with --random-weights: no download)")
    p.add_argument("--data", required=True, help="ImageFolder root: ROOT/<class>/<image>")
    p.add_argument("--resolution", type=_positive_int, default=None,
                   help="input size in px (e.g. 1008: ~4k tokens for a /16 ViT); position embeddings are "
                        "interpolated. Default: the model's own")
    p.add_argument("--labels", default="auto", choices=["auto", "index", "names", "order", "none"],
                   help="how class folders map to model classes: folder = class index, = label name/synset, "
                        "sorted order, or none (agreement and logit error only)")
    p.add_argument("--policies", type=_policy_list, default="fast,accurate", help="comma-separated FP4 policies")
    p.add_argument("--batch-size", type=_positive_int, default=8)
    p.add_argument("--limit", type=_positive_int, default=None, help="use only the first N images")
    p.add_argument("--random-weights", action="store_true", help="build the architecture with seeded random "
                                                                 "weights (numerics only; labelled in the report)")
    p.add_argument("--no-per-layer", action="store_true", help="skip the per-layer attention errors")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers")
    p.add_argument("--out-dir", default="out", help="directory for NAME.json and NAME.md")
    p.add_argument("--name", default="vit_top1")
    _add_runtime(p)

    p = esub.add_parser("mae", formatter_class=_Formatter, help="ViTMAE reconstruction PSNR with identical masks",
                        description="Masked-patch and full-image PSNR of ViTMAE reconstructions (same seeded "
                                    "masks for BF16 and FP4), the mean FP4-BF16 difference with its 95 %% "
                                    "t-interval, and FP4-vs-BF16 reconstruction PSNR.")
    p.add_argument("--model", required=True, help="Hub id (e.g. facebook/vit-mae-base), local folder, or "
                                                  "config:default (ViTMAEConfig defaults, random weights)")
    p.add_argument("--data", required=True, help="ImageFolder root: ROOT/<class>/<image>")
    p.add_argument("--resolution", type=_positive_int, default=None, help="input size (default: the model's)")
    p.add_argument("--mask-ratio", type=float, default=None, help="default: the model's (0.75)")
    p.add_argument("--decoder", action="store_true", help="also run the MAE decoder in FP4 (default: encoder only)")
    p.add_argument("--policies", type=_policy_list, default="fast,accurate")
    p.add_argument("--batch-size", type=_positive_int, default=8)
    p.add_argument("--limit", type=_positive_int, default=None)
    p.add_argument("--random-weights", action="store_true")
    p.add_argument("--seed", type=int, default=0, help="seed of the masks (and of random weights)")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--out-dir", default="out")
    p.add_argument("--name", default="mae_psnr")
    _add_runtime(p)

    p = esub.add_parser("wan", formatter_class=_Formatter, help="Wan2.1 fidelity vs BF16 and end-to-end speed",
                        description="BF16 and each policy with identical seed, latents and prompt embeddings: "
                                    "wall times (denoise, VAE decode, text encoding), speedups, final-latent "
                                    "cosine/relL2, per-frame PSNR/SSIM vs BF16.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="Hub id or local diffusers folder")
    src.add_argument("--speed-only", choices=["1.3B", "14B"],
                     help="the real Wan2.1 architecture with random weights (timings only; labelled so)")
    p.add_argument("--policies", type=_policy_list, default="wan_fast,fast,accurate")
    p.add_argument("--prompt", default=None, help="default: a fixed test prompt")
    p.add_argument("--negative-prompt", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--frames", type=_positive_int, default=81)
    p.add_argument("--steps", type=_positive_int, default=10)
    p.add_argument("--height", type=_positive_int, default=480)
    p.add_argument("--width", type=_positive_int, default=832)
    p.add_argument("--guidance", type=float, default=5.0)
    dec = p.add_mutually_exclusive_group()
    dec.add_argument("--decode", dest="decode", action="store_true", default=None,
                     help="decode the videos (default: yes with --model, no with --speed-only)")
    dec.add_argument("--no-decode", dest="decode", action="store_false", help="time the denoising only")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed 1-step warm-up before each run")
    p.add_argument("--save-videos", action="store_true", help="also write each run's MP4 to --out-dir")
    p.add_argument("--out-dir", default="out")
    p.add_argument("--name", default=None, help="default: wan_fidelity, or wan_speed with --speed-only")
    _add_runtime(p)

    # ---------------------------------------------------------------- calibrate
    pc = sub.add_parser("calibrate", formatter_class=_Formatter, help="calibrate a guard plan (which layers to guard)",
                        description="Run the model's exact attention on calibration inputs, record per-layer "
                                    "logit statistics and write a guard plan (JSON) for --guard-plan.")
    csub = pc.add_subparsers(dest="calib_kind", metavar="KIND")
    csub.required = True
    for kind, helptext in (("wan", "a Wan2.1 pipeline on prompts"), ("vit", "a ViT classifier on images"),
                           ("mae", "a ViTMAE on images")):
        p = csub.add_parser(kind, formatter_class=_Formatter, help=helptext)
        p.add_argument("--model", required=True, help="Hub id or local folder" + (
            " (vit: also timm:<name>; mae: also config:default)" if kind != "wan" else ""))
        p.add_argument("--policy", type=_policy, default="wan_fast" if kind == "wan" else "fast",
                       help="the Direct-P policy the plan protects")
        p.add_argument("--out", "-o", default="guard_plan.json", help="where to write the plan")
        p.add_argument("--threshold", type=float, default=None, help="guard when the statistic (log2 units) "
                                                                     "reaches this (default: 0.75 x the limit)")
        p.add_argument("--fraction", type=float, default=None, help="threshold as a fraction of the limit")
        p.add_argument("--seed", type=int, default=0)
        if kind == "wan":
            p.add_argument("--prompt", action="append", required=True, help="calibration prompt (repeatable)")
            p.add_argument("--frames", type=_positive_int, default=17)
            p.add_argument("--steps", type=_positive_int, default=4)
            p.add_argument("--height", type=_positive_int, default=480)
            p.add_argument("--width", type=_positive_int, default=832)
            p.add_argument("--guidance", type=float, default=5.0)
        else:
            p.add_argument("--data", required=True, help="ImageFolder root: ROOT/<class>/<image>")
            p.add_argument("--limit", type=_positive_int, default=16, help="calibration images")
            p.add_argument("--resolution", type=_positive_int, default=None)
            p.add_argument("--random-weights", action="store_true")
            if kind == "mae":
                p.add_argument("--decoder", action="store_true", help="also calibrate the decoder layers")
        p.add_argument("--device", default="auto")
        p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
        p.add_argument("--no-progress", action="store_true")
    _fill_help(parser)
    return parser


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("fp4vis")
    except Exception:
        return "unknown"


# ------------------------------------------------------------------------------------------------ commands


def cmd_info(args: argparse.Namespace) -> int:
    import torch

    from fp4vis.evals.report import gpu_info, package_versions

    try:
        from fp4vis.dispatch import available_backends

        backends = available_backends()
    except Exception as e:  # report, do not crash: `info` is what people run when things break
        backends = {"(dispatch)": f"{type(e).__name__}: {e}"}
    gpu = gpu_info()
    info = {"fp4vis": _version(), "torch": torch.__version__, "cuda": gpu, "backends": backends,
            "policies": sorted(POLICIES), "versions": package_versions()}
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    print(f"fp4vis {info['fp4vis']}  (torch {torch.__version__}, CUDA build {torch.version.cuda})")
    if gpu["devices"]:
        for d in gpu["devices"]:
            print(f"GPU {d['index']}: {d['name']} (sm_{d['capability'].replace('.', '')}, {d['memory_gib']} GiB)")
    else:
        print("GPU: none visible (torch.cuda.is_available() is False): CPU only, reference backend")
    print("Backends:")
    for name, reason in backends.items():
        print(f"  {name:<10} {'available' if reason is None else 'unavailable: ' + str(reason)}")
    print("Policies: " + ", ".join(info["policies"]))
    missing = [k for k, v in info["versions"].items() if v is None]
    if missing:
        print("Not installed: " + ", ".join(missing))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from fp4vis.evals import kernel_bench as kb
    from fp4vis.evals.common import UsageError, resolve_policies

    resolve_policies(args.policies)  # clear error for unknown names
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    if not args.quick and not torch_cuda_available():
        raise UsageError("the full kernel benchmark needs a CUDA GPU (none is visible here); "
                         "run `fp4vis bench --quick` for the CPU smoke test")
    name = args.name or ("kernel_bench_quick" if args.quick else "kernel_bench")
    out_dir = Path(args.out_dir)
    kwargs: dict[str, Any] = {"policies": policies, "quick": args.quick,
                              "log": None if args.no_progress else print}
    if not args.quick:
        shapes = {"d128": kb.GRID_D128, "d64": kb.GRID_D64, "all": None}[args.grid]
        if shapes is None:
            shapes = kb.as_shapes(kb.GRID_D128) + kb.as_shapes(kb.GRID_D64, d=64)
        kwargs["shapes"] = shapes
        kwargs["backends"] = tuple(b.strip() for b in args.backends.split(",")) if args.backends else BENCH_BACKENDS
    rows = kb.run_grid(**kwargs)
    json_path = kb.write_results(rows, out_dir / f"{name}.json",
                                 extra={"command": " ".join(sys.argv), "quick": args.quick})
    print(kb.summary_table(rows))
    print(f"json: {json_path}\nmarkdown: {json_path.with_suffix('.md')}")
    if not args.no_plot:
        from fp4vis.evals.plots import speed_error_plot

        try:
            where = "quick: reference on the CPU" if args.quick else "GPU"
            png = speed_error_plot({"rows": rows}, out_dir / f"{name}.png", title=f"fp4vis kernel benchmark ({where})")
            print(f"plot: {png}")
        except ImportError as e:
            print(f"fp4vis bench: plot skipped ({e}); pip install matplotlib", file=sys.stderr)
    return 0


def torch_cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def cmd_generate(args: argparse.Namespace) -> int:
    from fp4vis.pipelines.wan_video import run_generate

    out = run_generate(args.model, args.prompt, output=args.output, negative_prompt=args.negative_prompt,
                       image=args.image, policy=args.policy, guard_plan=args.guard_plan, seed=args.seed,
                       height=args.height, width=args.width, frames=args.frames, steps=args.steps,
                       guidance_scale=args.guidance, fps=args.fps, device=args.device, dtype=args.dtype,
                       backend=args.backend, exact_steps=args.exact_steps, progress=not args.no_progress)
    t = out["timings"]
    print(f"video: {out['video']}\nsidecar: {out['sidecar']}\n"
          f"timings: load {t['load_s']:.2f} s, text {t['text_encode_s']:.2f} s, denoise {t['denoise_s']:.2f} s, "
          f"decode {t['decode_s']:.2f} s")
    return 0


def _main_process() -> bool:
    """False in the non-zero ranks of a sharded run (accelerate launch / torchrun)."""
    return int(os.environ.get("RANK", "0")) == 0


def cmd_eval(args: argparse.Namespace) -> int:
    common = dict(device=args.device, dtype=args.dtype, backend=args.backend, guard_plan=args.guard_plan,
                  out_dir=args.out_dir, progress=not args.no_progress)
    if args.eval_command == "vit":
        from fp4vis.evals.vit_top1 import run_vit_eval

        r = run_vit_eval(args.model, args.data, policies=args.policies, resolution=args.resolution,
                         batch_size=args.batch_size, limit=args.limit, labels=args.labels,
                         random_weights=args.random_weights, per_layer=not args.no_per_layer, seed=args.seed,
                         num_workers=args.workers, name=args.name, **common)
        if not _main_process():
            return 0
        for pol, p in r["policies"].items():
            top1 = f"top-1 {p['top1']:.4f}, " if p["top1"] is not None else ""
            print(f"{pol}: {top1}agreement {p['agreement_with_bf16']:.4f}, logit cosine {p['logit_cosine_mean']:.5f}, "
                  f"relL2 {p['logit_rel_l2_mean']:.4f}")
    elif args.eval_command == "mae":
        from fp4vis.evals.mae_psnr import run_mae_eval

        r = run_mae_eval(args.model, args.data, policies=args.policies, resolution=args.resolution,
                         batch_size=args.batch_size, limit=args.limit, random_weights=args.random_weights,
                         mask_ratio=args.mask_ratio, seed=args.seed, decoder=args.decoder,
                         num_workers=args.workers, name=args.name, **common)
        if not _main_process():
            return 0
        for pol, p in r["policies"].items():
            d = p["masked_psnr_diff_vs_bf16"]
            print(f"{pol}: masked-patch PSNR {p['masked_psnr']['mean']:.3f} dB, FP4-BF16 {d['mean']:+.4f} dB, "
                  f"recon PSNR vs BF16 {p['recon_psnr_vs_bf16']['mean']:.2f} dB")
    else:
        from fp4vis.evals.wan_fidelity import DEFAULT_PROMPT, run_wan_eval

        r = run_wan_eval(args.model, speed_only=args.speed_only, policies=args.policies,
                         prompt=args.prompt or DEFAULT_PROMPT, negative_prompt=args.negative_prompt,
                         height=args.height, width=args.width, frames=args.frames, steps=args.steps,
                         guidance_scale=args.guidance, seed=args.seed, decode=args.decode,
                         warmup=not args.no_warmup, save_videos=args.save_videos, name=args.name, **common)
        for pol, run in r["runs"].items():
            if "error" in run:
                print(f"{pol}: FAILED {run['error']}")
                continue
            extra = (f", speedup {run['speedup_denoise']:.2f}x, latent cosine {run['latent_cosine']:.5f}"
                     if "speedup_denoise" in run else "")
            print(f"{pol}: denoise {run['timings']['denoise_s']:.3f} s{extra}")
    for kind, path in (r.get("files") or {}).items():
        print(f"{kind}: {path}")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    import torch

    from fp4vis.evals.common import resolve_device, resolve_dtype
    from fp4vis.guard import calibrate

    dev = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype)
    kw: dict[str, Any] = {"threshold": args.threshold, "fraction": args.fraction, "model_id": args.model}
    if args.calib_kind == "wan":
        from fp4vis.pipelines.wan_video import encode_prompt, initial_latents, load_wan_pipeline

        pipe = load_wan_pipeline(args.model, device=dev, dtype=dtype)
        pipe.set_progress_bar_config(disable=args.no_progress)
        inputs = []
        for i, prompt in enumerate(args.prompt):
            pe, npe, _ = encode_prompt(pipe, prompt, guidance_scale=args.guidance)
            lat = initial_latents(pipe, height=args.height, width=args.width, frames=args.frames, seed=args.seed + i)
            inputs.append(dict(prompt_embeds=pe, negative_prompt_embeds=npe, latents=lat.to(dev), height=args.height,
                               width=args.width, num_frames=args.frames, num_inference_steps=args.steps,
                               guidance_scale=args.guidance, output_type="latent"))
        target = pipe
    else:
        from torch.utils.data import Subset
        from torchvision.datasets import ImageFolder

        from fp4vis.evals.common import check_image_folder

        root = check_image_folder(args.data)
        if args.calib_kind == "vit":
            from fp4vis.evals.vit_top1 import build_transform, load_classifier

            clf = load_classifier(args.model, resolution=args.resolution, random_weights=args.random_weights,
                                  device=dev, dtype=dtype, seed=args.seed)
            ds = ImageFolder(str(root), transform=build_transform(clf))
            target = clf.model
            interp = clf.resolution != clf.native_resolution

            def item(x):
                x = x.unsqueeze(0).to(dev, dtype)
                return (x,) if clf.kind == "timm" else {"pixel_values": x, "interpolate_pos_encoding": interp}
        else:
            from torchvision import transforms as T

            from fp4vis.evals.mae_psnr import load_mae, masking_noise

            mae, mean, std, _ = load_mae(args.model, random_weights=args.random_weights, device=dev, dtype=dtype,
                                         seed=args.seed)
            kw["decoder"] = args.decoder
            native = int(mae.config.image_size if isinstance(mae.config.image_size, int) else mae.config.image_size[0])
            res = args.resolution or native
            n_patches = (res // int(mae.config.patch_size)) ** 2
            ds = ImageFolder(str(root), transform=T.Compose([T.Resize(res), T.CenterCrop(res), T.ToTensor(),
                                                             T.Normalize(mean, std)]))
            target = mae
            counter = iter(range(10**9))

            def item(x):
                noise = masking_noise(torch.tensor([next(counter)]), n_patches, args.seed).to(dev)
                return {"pixel_values": x.unsqueeze(0).to(dev, dtype), "noise": noise,
                        "interpolate_pos_encoding": res != native}
        ds = Subset(ds, list(range(min(args.limit, len(ds)))))
        inputs = [item(ds[i][0]) for i in range(len(ds))]
    plan = calibrate(target, inputs, policy=args.policy, **kw)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plan.save(out)
    print(plan.summary())
    print(f"guarded layers: {', '.join(plan.guarded) if plan.guarded else 'none'}")
    print(f"guard plan: {out}")
    return 0


COMMANDS = {"info": cmd_info, "bench": cmd_bench, "generate": cmd_generate, "eval": cmd_eval,
            "calibrate": cmd_calibrate}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    saved_tqdm = os.environ.get("TQDM_DISABLE")
    if getattr(args, "no_progress", False):
        os.environ["TQDM_DISABLE"] = "1"
    try:
        return _run(args)
    finally:
        if saved_tqdm is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = saved_tqdm


def _run(args: argparse.Namespace) -> int:
    from fp4vis.evals.common import UsageError

    try:
        from fp4vis.attention import RangeExceededError
    except ImportError:  # pragma: no cover
        RangeExceededError = FloatingPointError  # noqa: N806
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch_dtype.*is deprecated.*")
            return COMMANDS[args.command](args)
    except UsageError as e:
        print(f"fp4vis {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, NotImplementedError) as e:  # missing files; a model fp4vis cannot patch
        print(f"fp4vis {args.command}: error: {e}", file=sys.stderr)
        return 2
    except RangeExceededError as e:
        print(f"fp4vis {args.command}: error: {e}\nhint: calibrate a guard plan (`fp4vis calibrate ...`) and pass "
              "it with --guard-plan, or use --policy accurate", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
