"""What the apps (the CLI, pipelines, evals, benchmarks, scripts) share; nothing below the apps imports it.
One module per job, each imported where it is used (this package re-exports nothing):

- ``usage``: ``UsageError`` (the CLI prints it as one line, exit status 2) and ``require`` (an optional
  dependency, with its install hint);
- ``runtime``: devices, dtypes, seeds (``derived_seed``) and torch.compile's modes, as the user names them;
- ``policies``: policy and backend names from the user and what runs under them (``resolve_policies``,
  ``check_backend``, ``backend_in_use``, ``attention_label``, ``warn_reference_fallback``,
  ``policy_applied``);
- ``guard_plans``: guard-plan files (``load_guard_plan``, ``plan_for``, ``check_plan_policy``,
  ``guard_plan_summary``);
- ``sources``: model sources (``check_model_source``, ``display_source``, ``hub_error``);
- ``console``: the one filter of warnings (``WarningLog``, ``library_warnings``) and the libraries' loading
  bars (``loading_bars``);
- ``environment``: the environment record every result JSON carries (``environment()``, ``gpu_info``,
  ``package_versions``, ``fp4vis_version``);
- ``outputs``: output paths checked before any work (``check_output_file``, ``check_output_dir``) and
  ``write_json`` (atomic);
- ``timing``: ``Timer``, the benchmarks' timers (``time_cuda``, ``time_events``, ``time_host``, ``time_graph``,
  ``input_copies``) and their timed sections (``run_sections``).
"""
