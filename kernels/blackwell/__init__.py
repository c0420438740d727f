"""Blackwell (sm_100a / sm_103a / sm_120a) Direct-P FP4 attention: one Triton source on the
block-scaled FP4 MMAs, verified on the H200 through its sm_90 build (docs/blackwell_kernel.md).

Modules: ``config`` (static configuration), ``prepass`` (q/k/v -> packed E2M1 codes + scales),
``kernel`` (the Triton kernel), ``cubin`` (ahead-of-time builds and their launcher), ``backend``
(the fp4vis backend and custom op; importing it registers ``"blackwell"``), ``selfcheck`` (the
first-use check), ``compile_check`` (CPU compile checks of the Blackwell builds).
Importing this package imports none of them (no Triton, no CUDA).
"""
