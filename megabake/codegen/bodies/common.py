"""CuTe DSL device bodies that generated megakernels call (inlined ``@cute.jit`` functions).

Contract: every body is a pure device routine over ``cute.Tensor`` views and compile-time sizes. They run
inside one persistent cooperative kernel: work is distributed as grid-stride loops over CTAs or global
warps, stages are separated by :func:`grid_barrier`, and shared-memory scratch is passed in by the caller.
All arithmetic is fp32; weights and the KV cache are bf16 and are read with 16-byte vector loads where the
layout allows. Bodies never allocate and never synchronise the grid themselves (except grid_barrier).

The CPU reference executor (``megabake.plan.reference``) mirrors each body; keep the two in step.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.cute.nvgpu.cpasync as cpasync
from cutlass import Float32, Int32, Int64

WARP = 32
VEC = 8  # bf16 elements per 16-byte load
