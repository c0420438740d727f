"""ViT top-1 eval: what FP4 attention costs an image classifier.

A timm or transformers classifier (Hub id, local directory, ``timm:<registry name>`` or a shipped
``fp4vis:<name>``, e.g. ``fp4vis:digits-vit``) runs on an
ImageFolder-style dataset, at its native resolution or another one (``resolution=1008`` gives a
ViT-B/16 about 4k tokens: timm resamples the position embeddings on load, transformers interpolates
them in the forward pass). For each image the model runs once with its own attention (the BF16
baseline) and once per FP4 policy (through ``fp4vis.patch``) and we report:

- top-1 (torchmetrics, micro average) when labels are known, for BF16 and every policy;
- agreement: the fraction of images whose FP4 top-1 class equals the BF16 one;
- logit cosine and relative L2 error against BF16 (``fp4vis.metrics``, per image, then the mean);
- per-layer attention error: each attention layer re-run in isolation on the inputs it saw in the
  BF16 pass, output compared with its BF16 output (no drift from earlier layers).

Work is sharded with accelerate (``accelerate launch -m fp4vis.cli eval vit ...`` on several GPUs);
it runs single-process on the CPU too.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fp4vis.evals.common import (
    AttentionRecorder,
    check_image_folder,
    error_metrics,
    image_list,
    images_markdown,
    per_sample,
)
from fp4vis.evals.datasets import open_images, sample_indices
from fp4vis.evals.report import markdown_table, paired_rate_difference_ci95, write_report
from fp4vis.services.console import WarningLog
from fp4vis.services.environment import environment
from fp4vis.services.guard_plans import guard_plan_summary, load_guard_plan, plan_for
from fp4vis.services.policies import backend_in_use, check_backend, policy_applied, resolve_policies
from fp4vis.services.runtime import resolve_device, resolve_dtype
from fp4vis.services.sources import check_model_source, display_source, hub_error, is_network_error
from fp4vis.services.timing import Timer
from fp4vis.services.usage import UsageError, require

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass
class Classifier:
    """A loaded classifier and what its preprocessing needs."""

    model: nn.Module
    kind: str  # "timm" | "transformers"
    source: str
    resolution: int
    native_resolution: int
    tokens: int
    num_classes: int
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    crop_pct: float = 0.875
    interpolation: str = "bicubic"
    label_names: list[str] | None = None  # class index -> name (synset or text)
    label_descriptions: list[str] | None = None
    random_weights: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "timm":
            return self.model(x)
        interp = self.resolution != self.native_resolution
        return self.model(pixel_values=x, interpolate_pos_encoding=interp).logits


def _timm_name(source: str, is_local: bool) -> str:
    if source.startswith("timm:"):
        return source[len("timm:"):]
    if source.startswith(("hf-hub:", "local-dir:")):
        return source
    return f"local-dir:{source}" if is_local else f"hf-hub:{source}"


def _is_timm_source(source: str, is_local: bool) -> bool:
    if source.startswith(("timm:", "hf-hub:", "local-dir:")):
        return True
    if is_local:
        cfg = Path(source) / "config.json"
        if not cfg.is_file():
            raise UsageError(f"model: {source!r} has no config.json (expected a timm folder written by "
                             "timm's save_for_hf / push_to_hf_hub, or a transformers save_pretrained folder)")
        return "architecture" in json.loads(cfg.read_text())
    return source.split("/")[0] == "timm"


def load_classifier(source: str, *, resolution: int | None = None, random_weights: bool = False,
                    device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
                    seed: int = 0) -> Classifier:
    """Load a classifier from a Hub id, a local directory or ``timm:<registry name>``.

    ``random_weights`` builds the architecture from its config with seeded random weights (nothing
    but the config is read; a ``timm:`` name needs nothing at all). ``fp4vis:<name>`` is a model
    fp4vis ships (``fp4vis.zoo``), read from its folder like any local one."""
    from fp4vis.zoo import resolve_source

    source = resolve_source(source)
    if not source.startswith(("timm:", "hf-hub:")):
        src = source[len("local-dir:"):] if source.startswith("local-dir:") else source
        src, is_local = check_model_source(src)
    else:
        src, is_local = source, False
    torch.manual_seed(seed)
    if _is_timm_source(src if not source.startswith("local-dir:") else source, is_local):
        import timm
        from timm.data import resolve_data_config

        name = _timm_name(src, is_local)
        kwargs: dict[str, Any] = {}
        if resolution is not None:
            kwargs["img_size"] = resolution  # timm resamples pos_embed when loading the checkpoint
        if source.startswith("timm:") and not timm.is_model(name):
            raise UsageError(f"model: {name!r} is not a timm architecture (see timm.list_models())")
        try:
            model = timm.create_model(name, pretrained=not random_weights, **kwargs)
        except Exception as e:
            if not is_local and is_network_error(e):
                raise hub_error(source, e) from e
            raise
        native = model.pretrained_cfg.get("input_size", (3, 224, 224))[-1]
        dc = resolve_data_config({}, model=model)
        res = resolution or (model.patch_embed.img_size[0] if hasattr(model, "patch_embed") else native)
        tokens = getattr(model.patch_embed, "num_patches", 0) + getattr(model, "num_prefix_tokens", 0)
        labels = model.pretrained_cfg.get("label_names")
        descriptions = None
        if labels is None and model.num_classes == 1000:
            from timm.data import ImageNetInfo

            info = ImageNetInfo()
            labels = [info.index_to_label_name(i) for i in range(1000)]
            descriptions = [info.index_to_description(i) for i in range(1000)]
        clf = Classifier(model=model, kind="timm", source=source, resolution=int(res), native_resolution=int(native),
                         tokens=int(tokens), num_classes=int(model.num_classes), mean=tuple(dc["mean"]),
                         std=tuple(dc["std"]), crop_pct=float(dc.get("crop_pct") or 0.875),
                         interpolation=str(dc.get("interpolation", "bicubic")),
                         label_names=list(labels) if labels is not None else None,
                         label_descriptions=descriptions, random_weights=random_weights)
    else:
        from transformers import AutoConfig, AutoModelForImageClassification

        try:
            if random_weights:
                config = AutoConfig.from_pretrained(src)
                model = AutoModelForImageClassification.from_config(config)
            else:
                model, info = AutoModelForImageClassification.from_pretrained(src, output_loading_info=True)
        except Exception as e:
            if not is_local and is_network_error(e):
                raise hub_error(source, e) from e
            raise
        # a headless checkpoint (an encoder, a feature extractor) loads with a newly initialised
        # classifier, which transformers only warns about: its top-1 would measure random guesses
        new = sorted(info["missing_keys"]) if not random_weights else []
        if new:
            raise UsageError(f"--model {source}: the checkpoint has no classification head ({', '.join(new[:4])} "
                             "would be newly initialised): give an image classifier, or --random-weights to "
                             "measure the architecture")
        cfg = model.config
        native = int(cfg.image_size if isinstance(cfg.image_size, int) else cfg.image_size[0])
        patch = int(cfg.patch_size if isinstance(cfg.patch_size, int) else cfg.patch_size[0])
        res = int(resolution or native)
        if res % patch:
            raise UsageError(f"resolution {res} is not a multiple of the patch size {patch}")
        mean, std = IMAGENET_MEAN, IMAGENET_STD
        try:
            from transformers import AutoImageProcessor

            proc = AutoImageProcessor.from_pretrained(src)
            mean, std = tuple(proc.image_mean), tuple(proc.image_std)
        except Exception:  # no processor saved with the model: ImageNet statistics
            pass
        id2label = getattr(cfg, "id2label", None) or {}
        labels = [str(id2label.get(i, id2label.get(str(i), i))) for i in range(cfg.num_labels)]
        clf = Classifier(model=model, kind="transformers", source=source, resolution=res, native_resolution=native,
                         tokens=(res // patch) ** 2 + 1, num_classes=int(cfg.num_labels), mean=mean, std=std,
                         label_names=labels, random_weights=random_weights)
    clf.model.eval().to(device=device, dtype=dtype)
    return clf


def build_transform(clf: Classifier):
    from torchvision import transforms as T

    interp = {"bicubic": T.InterpolationMode.BICUBIC, "bilinear": T.InterpolationMode.BILINEAR,
              "nearest": T.InterpolationMode.NEAREST}.get(clf.interpolation, T.InterpolationMode.BICUBIC)
    resize = int(math.floor(clf.resolution / clf.crop_pct))
    return T.Compose([T.Resize(resize, interpolation=interp), T.CenterCrop(clf.resolution), T.ToTensor(),
                      T.Normalize(clf.mean, clf.std)])


def calibration_inputs(clf: Classifier, data: str | os.PathLike, *, limit: int) -> list[Any]:
    """Model inputs for ``fp4vis.calibrate``: the first ``limit`` images of an ImageFolder, one per call,
    transformed as the eval transforms them."""
    ds = open_images(check_image_folder(data), transform=build_transform(clf))
    interp = clf.resolution != clf.native_resolution
    device, dtype = next(clf.model.parameters()).device, next(clf.model.parameters()).dtype
    inputs = []
    for i in range(min(limit, len(ds))):
        x = ds[i][0].unsqueeze(0).to(device, dtype)
        inputs.append((x,) if clf.kind == "timm" else {"pixel_values": x, "interpolate_pos_encoding": interp})
    return inputs


def _norm(s: str) -> str:
    return "".join(c for c in s.lower() if c.isalnum())


def label_mapping(class_names: list[str], clf: Classifier, mode: str = "auto") -> tuple[list[int] | None, str]:
    """Map ImageFolder class folders to model class indices.

    modes: ``index`` (folder names are class indices, ``0/`` .. ``<classes - 1>/``), ``names`` (folder names are the
    model's label names: a synset like ``n01440764`` or a text label), ``order`` (the sorted folder
    order is the class order: ImageFolder's own convention), ``none`` (no labels: agreement and logit
    error only), ``auto`` (index, then names, else none)."""
    if mode not in ("auto", "index", "names", "order", "none"):
        raise UsageError(f"labels: unknown mode {mode!r}; use auto, index, names, order or none")
    if mode == "none":
        return None, "none"
    if mode in ("auto", "index"):
        if all(c.isdigit() for c in class_names):
            idx = [int(c) for c in class_names]
            if max(idx) >= clf.num_classes:
                raise UsageError(f"labels: folder {max(idx)} is not a class index of a {clf.num_classes}-class model")
            return idx, "index"
        if mode == "index":
            raise UsageError(f"labels=index needs folders named by class index (0 .. {clf.num_classes - 1} for "
                             f"this {clf.num_classes}-class model)")
    if (mode in ("auto", "names") and clf.num_classes == 1000
            and all(len(c) == 9 and c[0] == "n" and c[1:].isdigit() for c in class_names)):
        # ImageNet-1k synset folders (n01440764, ...): the standard class order, whatever the label text
        from timm.data import ImageNetInfo

        info = ImageNetInfo()
        synsets = {info.index_to_label_name(i): i for i in range(1000)}
        if all(c in synsets for c in class_names):
            return [synsets[c] for c in class_names], "names"
    if mode in ("auto", "names") and clf.label_names:
        lookup: dict[str, int] = {}
        for i, name in enumerate(clf.label_names):
            lookup.setdefault(_norm(name), i)
            lookup.setdefault(_norm(name.split(",")[0]), i)
        for i, desc in enumerate(clf.label_descriptions or []):
            lookup.setdefault(_norm(desc), i)
            lookup.setdefault(_norm(desc.split(",")[0]), i)
        idx = [lookup.get(_norm(c), -1) for c in class_names]
        if all(i >= 0 for i in idx):
            return idx, "names"
        if mode == "names":
            missing = [c for c, i in zip(class_names, idx) if i < 0]
            raise UsageError(f"labels=names: folders {missing[:5]} match no label name of the model")
    if mode == "order":
        if len(class_names) > clf.num_classes:
            raise UsageError(f"labels=order: {len(class_names)} folders but the model has {clf.num_classes} classes")
        return list(range(len(class_names))), "order"
    return None, "none"


@dataclass(frozen=True)
class VitEvalConfig:
    """What ``run_vit_eval`` runs (the CLI builds it from ``fp4vis eval vit``'s options): the classifier
    ``model`` on the images of ``data`` (an ImageFolder root), BF16 and each of ``policies``. ``limit``
    images: the first ones, or drawn at random with ``sample_seed`` (the protocols' subsets); ``labels``: how
    class folders map to the model's classes (``label_mapping``); ``per_layer``: each attention layer's error
    too; ``out_dir``: where ``<name>.json`` / ``.md`` go (None: nothing written)."""

    model: str
    data: str | os.PathLike
    policies: str | list[str] = "fast,accurate"
    resolution: int | None = None
    batch_size: int = 8
    limit: int | None = None
    labels: str = "auto"
    random_weights: bool = False
    device: str = "auto"
    dtype: str = "bfloat16"
    backend: str = "auto"
    guard_plan: str | None = None
    per_layer: bool = True
    seed: int = 0
    num_workers: int = 0
    out_dir: str | os.PathLike | None = None
    name: str = "vit_top1"
    progress: bool = True
    sample_seed: int | None = None


def run_vit_eval(config: VitEvalConfig, *, say: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """Run the eval of ``config`` (``VitEvalConfig``); returns the result dict and, with ``config.out_dir``,
    writes ``<name>.json``/``.md``. ``say``: told what the eval runs, once the model and the images are
    loaded (the CLI's header)."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, Subset
    from torchmetrics.functional.classification import multiclass_accuracy
    from tqdm.auto import tqdm

    require("torchvision", what="the ViT eval")
    dev = resolve_device(config.device)
    check_backend(config.backend, dev)
    pols = resolve_policies(config.policies, allow_bf16=False) if config.policies else []
    if not pols:
        raise UsageError("policies: give at least one FP4 policy (bf16 is always the baseline)")
    root = check_image_folder(config.data)
    plan = load_guard_plan(config.guard_plan)
    acc = Accelerator(cpu=dev.type == "cpu")
    clf = load_classifier(config.model, resolution=config.resolution, random_weights=config.random_weights,
                          device=acc.device, dtype=resolve_dtype(config.dtype), seed=config.seed)
    dataset = open_images(root, transform=build_transform(clf))
    indices = sample_indices(len(dataset), config.limit, config.sample_seed)
    files = image_list(dataset, indices)
    mapping, label_mode = label_mapping(dataset.classes, clf, config.labels if dataset.classes else "none")
    if say is not None:
        say(f"eval vit: {config.model} at {clf.resolution} px ({clf.tokens} tokens), {len(indices)} images from {root} "
            f"(labels: {label_mode}); bf16 (the model's attention) and {', '.join(p.name for p in pols)} on the "
            f"{backend_in_use(config.backend, acc.device)} backend{' with a guard plan' if plan else ''}")
    if len(indices) < len(dataset):
        dataset = Subset(dataset, indices)
    loader = acc.prepare_data_loader(DataLoader(dataset, batch_size=config.batch_size, shuffle=False,
                                                num_workers=config.num_workers))
    cosine, rel_l2 = error_metrics()
    model_dtype = resolve_dtype(config.dtype)
    layer_names: list[str] = []

    rows: dict[str, list[torch.Tensor]] = {"target": [], "bf16_pred": []}
    for p in pols:
        for k in ("pred", "logit_cos", "logit_rel", "layer_cos", "layer_rel"):
            rows[f"{p.name}/{k}"] = []
    times = {"bf16": 0.0, **{p.name: 0.0 for p in pols}}

    with torch.no_grad(), WarningLog() as wlog:
        for x, y in tqdm(loader, desc="vit eval", disable=not (config.progress and acc.is_local_main_process)):
            x = x.to(acc.device, model_dtype)
            target = torch.tensor([mapping[int(c)] for c in y] if mapping else [-1] * len(y), device=acc.device)
            recorder = AttentionRecorder(clf.model)
            layer_names = [n for n, _ in recorder.modules]
            with Timer() as t, (recorder if config.per_layer else _null()):
                ref = clf(x).float()
            times["bf16"] += t.seconds
            batch: dict[str, torch.Tensor] = {"target": target, "bf16_pred": ref.argmax(-1)}
            for p in pols:
                with policy_applied(clf.model, p, guard=plan_for(plan, p), backend=config.backend):
                    with Timer() as t:
                        out = clf(x).float()
                    times[p.name] += t.seconds
                    layers = recorder.rerun() if config.per_layer else {}
                batch[f"{p.name}/pred"] = out.argmax(-1)
                batch[f"{p.name}/logit_cos"] = torch.tensor(per_sample(cosine, out, ref), device=acc.device)
                batch[f"{p.name}/logit_rel"] = torch.tensor(per_sample(rel_l2, out, ref), device=acc.device)
                lc = torch.zeros(x.shape[0], len(layer_names), device=acc.device)
                lr = torch.zeros_like(lc)
                for j, lname in enumerate(layer_names):
                    if lname in layers:
                        new, old = layers[lname]
                        lc[:, j] = torch.tensor(per_sample(cosine, new, old))
                        lr[:, j] = torch.tensor(per_sample(rel_l2, new, old))
                batch[f"{p.name}/layer_cos"] = lc
                batch[f"{p.name}/layer_rel"] = lr
            recorder.calls.clear()
            # gather per batch: accelerate drops the samples it duplicated to even out the last batch
            for k, v in acc.gather_for_metrics(batch).items():
                rows[k].append(v.cpu())

    gathered = {k: torch.cat(v) for k, v in rows.items()}
    n = int(gathered["target"].numel())
    has_labels = mapping is not None
    nc = clf.num_classes

    def top1(pred: torch.Tensor) -> float | None:
        if not has_labels:
            return None
        return float(multiclass_accuracy(pred, gathered["target"], num_classes=nc, average="micro",
                                         ignore_index=-1))

    result: dict[str, Any] = {
        "eval": "vit_top1", "model": display_source(config.model), "model_kind": clf.kind,
        "random_weights": config.random_weights,
        "data": display_source(str(root)), "images": n, "image_files": files, "labels": label_mode,
        "classes_in_data": len(mapping or []) or None,
        "resolution": clf.resolution, "native_resolution": clf.native_resolution, "tokens": clf.tokens,
        "dtype": str(model_dtype).replace("torch.", ""), "backend": config.backend, "batch_size": config.batch_size,
        "seed": config.seed, "num_processes": acc.num_processes, "guard_plan": guard_plan_summary(plan),
        "layers": layer_names, "bf16": {"top1": top1(gathered["bf16_pred"]), "forward_s": times["bf16"]},
        "policies": {},
    }
    for p in pols:
        lc, lr = gathered[f"{p.name}/layer_cos"], gathered[f"{p.name}/layer_rel"]
        result["policies"][p.name] = {
            "guard_plan_applied": plan_for(plan, p) is not None,
            "top1": top1(gathered[f"{p.name}/pred"]),
            "top1_delta_vs_bf16": (top1(gathered[f"{p.name}/pred"]) - result["bf16"]["top1"]) if has_labels else None,
            "top1_delta_vs_bf16_ci95": paired_top1_difference(gathered[f"{p.name}/pred"], gathered["bf16_pred"],
                                                              gathered["target"]) if has_labels else None,
            "agreement_with_bf16": float(multiclass_accuracy(gathered[f"{p.name}/pred"], gathered["bf16_pred"],
                                                             num_classes=nc, average="micro")),
            "logit_cosine_mean": float(gathered[f"{p.name}/logit_cos"].mean()),
            "logit_cosine_min": float(gathered[f"{p.name}/logit_cos"].min()),
            "logit_rel_l2_mean": float(gathered[f"{p.name}/logit_rel"].mean()),
            "logit_rel_l2_max": float(gathered[f"{p.name}/logit_rel"].max()),
            "per_layer": {"cosine_mean": lc.mean(0).tolist(), "rel_l2_mean": lr.mean(0).tolist(),
                          "cosine_min": lc.min(0).values.tolist() if config.per_layer else [],
                          "rel_l2_max": lr.max(0).values.tolist() if config.per_layer else []}
            if config.per_layer else None,
            "forward_s": times[p.name],
        }
    result["warnings"] = wlog.messages
    result["environment"] = environment()
    if config.out_dir is not None and acc.is_main_process:
        written = write_report(config.out_dir, config.name, result, vit_markdown(result))
        result["files"] = {k: str(v) for k, v in written.items()}
    return result


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def paired_top1_difference(pred: torch.Tensor, ref_pred: torch.Tensor, target: torch.Tensor) -> dict[str, Any]:
    """Top-1 under a policy minus top-1 under BF16 on the same labelled images, with its paired 95 %
    interval (``paired_rate_difference_ci95``): a difference of a few images is told apart from none."""
    labelled = target >= 0
    right, ref_right = pred[labelled] == target[labelled], ref_pred[labelled] == target[labelled]
    return paired_rate_difference_ci95(int((right & ~ref_right).sum()), int((ref_right & ~right).sum()),
                                       int(labelled.sum()))


def top1_delta_text(d: dict[str, Any] | None) -> str | None:
    """``-0.005 [-0.021, 0.011] (+1 / -2)``: the paired top-1 difference, its interval, the images behind it."""
    if d is None:
        return None
    return (f"{d['mean']:+.3f} [{d['ci95_low']:+.3f}, {d['ci95_high']:+.3f}] (+{d['gained']} / -{d['lost']})")


def vit_markdown(r: dict[str, Any]) -> str:
    warn = ("\n**Random weights**: the model was built from its configuration with seeded random "
            "weights (no pretrained checkpoint). Agreement and logit errors measure the numerics of FP4 "
            "attention on this architecture, not accuracy on a task.\n") if r["random_weights"] else ""
    lines = [f"# ViT top-1: {r['model']}", warn,
             f"{r['images']} images from `{r['data']}` at {r['resolution']} px ({r['tokens']} tokens; native "
             f"{r['native_resolution']} px), {r['dtype']} baseline (the model's own attention), backend "
             f"`{r['backend']}`, labels: {r['labels']}, {r['num_processes']} process(es)."
             + images_markdown(r.get("image_files")), ""]
    rows = [["bf16 (baseline)", r["bf16"]["top1"], None, 1.0, None, None, None]]
    for name, p in r["policies"].items():
        worst = min(p["per_layer"]["cosine_min"]) if p.get("per_layer") and p["per_layer"]["cosine_min"] else None
        rows.append([name, p["top1"], top1_delta_text(p.get("top1_delta_vs_bf16_ci95")), p["agreement_with_bf16"],
                     p["logit_cosine_mean"], p["logit_rel_l2_mean"], worst])
    lines.append(markdown_table(["policy", "top-1", "Δ top-1 [95 %] (gained / lost images)", "agreement with BF16",
                                 "logit cosine (mean)", "logit relL2 (mean)", "worst layer cosine"], rows))
    lines += ["", "top-1: torchmetrics multiclass accuracy, micro average, over the labelled images "
              "(n/a without labels). Δ top-1: the policy's top-1 minus BF16's on the same images, with the paired "
              "95 % interval of Agresti and Min (fp4vis.evals.report.paired_rate_difference_ci95). Agreement: fraction "
              "of images whose FP4 top-1 class equals the BF16 one. "
              "Logit cosine / relL2: fp4vis.metrics per image against the BF16 logits, then the mean. Per-layer: "
              "each attention layer re-run under the policy on the inputs it saw in the BF16 pass."]
    if any(p.get("per_layer") for p in r["policies"].values()) and r["layers"]:
        hdr = ["layer"] + [f"{n} cos / relL2" for n in r["policies"]]
        prow = []
        for j, lname in enumerate(r["layers"]):
            cells = [lname]
            for p in r["policies"].values():
                pl = p["per_layer"]
                cells.append(f"{pl['cosine_mean'][j]:.5f} / {pl['rel_l2_mean'][j]:.4f}")
            prow.append(cells)
        lines += ["", "## Per-layer attention error (mean over images)", "", markdown_table(hdr, prow)]
    return "\n".join(lines)
