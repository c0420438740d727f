"""The Hopper (sm_90a) backend: ``config`` (static configuration), ``layout`` (the operand contract),
``prepass`` / ``prepass_triton`` (q, k, v -> operands), ``ptx`` and ``kernel`` (the CuTe DSL Direct-P
kernel), ``backend`` (the custom op and the ``Backend``), ``compile_check`` (CPU compile checks).
Importing this package imports none of them."""
