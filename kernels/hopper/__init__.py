"""The Hopper (sm_90a) backend: ``config`` (static configuration), ``layout`` (the operand contract),
``prepass`` / ``prepass_launch`` / ``prepass_kernels`` / ``prepass_nvfp4`` / ``prepass_tuning`` / ``prepass_torch``
(q, k, v -> operands), ``ptx``, ``direct_p``, ``softmax_fp8`` and ``kernel`` (the CuTe DSL kernel and its two P
paths), ``launch`` (the launcher and the compiled-kernel cache), ``op`` (the custom op), ``backend`` (the
``Backend``), ``compile_check`` (CPU compile checks).
Importing this package imports none of them."""
