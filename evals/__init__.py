"""The evals, one module per eval, each with its command-line module in ``fp4vis/cli/``:

=====================  ==========================  ==========================================================
eval                   module                      command (``fp4vis/cli/``)
=====================  ==========================  ==========================================================
ViT top-1              ``vit_top1``                ``fp4vis eval vit`` (``eval_vit.py``)
MAE PSNR               ``mae_psnr``                ``fp4vis eval mae`` (``eval_mae.py``)
any diffusers pipeline ``pipeline_eval``           ``fp4vis eval pipeline`` (``eval_pipeline.py``)
  its Wan2.1 config    ``wan_fidelity``            ``fp4vis eval wan`` (``eval_wan.py``)
published protocols    ``paper_protocols``         ``fp4vis eval vit|mae|wan --protocol paper`` (``eval_protocol.py``)
the demo               ``demo`` (``demo_video``,   ``fp4vis demo`` (``demo.py``)
                       ``demo_defaults``)
kernel benchmark       ``kernel_bench``            ``fp4vis bench`` (``bench.py``)
a plan for a target    ``plan_search`` (``plan_    ``fp4vis calibrate wan|pipeline --target`` (``calibrate.py``,
                       report``, ``attention_      ``calibrate_target.py``); ``fp4vis.plan``
                       time``)
=====================  ==========================  ==========================================================

The pipeline eval is one run loop, ``timed_runs.run_eval``, of which ``pipeline_eval`` (any diffusers pipeline, a
published denoiser with random weights) and ``wan_fidelity`` (Wan2.1: one prompt encoding, stages timed apart,
latents after some steps, operator error) are configurations: a ``DiffusionEvalConfig`` subclass and the
``EvalSubject`` it builds.

What the evals share: ``common`` (per-layer attention errors, per-sample metrics, datasets of images),
``baselines`` (the BF16 attention libraries timed against), ``datasets`` (the protocols' data layouts),
``published_configs`` (published denoiser architectures), ``report`` (JSON and Markdown reports), ``plots``.

A new diffusion pipeline with needs of its own is a configuration of the pipeline eval (as ``wan_fidelity``); a
new eval goes in a module of its own here (``<what it measures>.py``: a frozen ``...EvalConfig``, a
``run_..._eval(config, say=None) -> dict`` that writes NAME.json and NAME.md through ``report``), its command in
``fp4vis/cli/eval_<name>.py`` (``add_parser(esub)``, ``run(args, common)``) added to
``fp4vis.cli.evaluate.EVALS``, its tests in ``tests/apps/test_evals_<name>.py`` (tiny models:
``tests/apps/tiny_models.py``), and its command in docs/cli_and_evals.md. Test-only code stays in the tests."""

if __name__ == "evals":  # imported as top-level `evals` from the repository root: never hide the installed one
    from fp4vis.toplevel import yield_to_installed

    yield_to_installed(__name__)
