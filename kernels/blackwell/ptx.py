"""The inline PTX of both Blackwell kernels (``kernel.py``'s Triton source, ``gluon_ws.py``'s Gluon one), stated once
so that the two convert and multiply-add by the same instructions: (assembly, constraints) for
``inline_asm_elementwise``."""

# four pairs of float32 to four bytes of two E2M1 codes, relu(lo) in the low nibble and relu(hi) in the high one, by
# cvt.rn.satfinite.relu.e2m1x2.f32 (its first source goes to the upper nibble; it defines docs/numerics.md section
# 1's rounding), written straight into one 32-bit register: no byte permutes to build the uint8 operand (pack=4)
E2M1X2 = ("{ .reg .b8 t0, t1, t2, t3;\n"
          "cvt.rn.satfinite.relu.e2m1x2.f32 t0, $5, $1;\n"
          "cvt.rn.satfinite.relu.e2m1x2.f32 t1, $6, $2;\n"
          "cvt.rn.satfinite.relu.e2m1x2.f32 t2, $7, $3;\n"
          "cvt.rn.satfinite.relu.e2m1x2.f32 t3, $8, $4;\n"
          "mov.b32 $0, {t0, t1, t2, t3}; }",
          "=r,r,r,r,r,r,r,r,r")

# a·b + c two lanes per fma.rn.f32x2 (sm_100a on), each lane fma.rn.f32's one rounding (pack=2)
FMA_F32X2 = ("{ .reg .b64 a, b, c, d;\n"
             "mov.b64 a, {$2, $3};\n"
             "mov.b64 b, {$4, $5};\n"
             "mov.b64 c, {$6, $7};\n"
             "fma.rn.f32x2 d, a, b, c;\n"
             "mov.b64 {$0, $1}, d; }",
             "=r,=r,r,r,r,r,r,r")
