"""CuTe DSL device bodies that generated megakernels call (inlined ``@cute.jit`` functions).

Contract: every body is a pure device routine over ``cute.Tensor`` views and compile-time sizes. They run
inside one persistent cooperative kernel: work is distributed as grid-stride loops over CTAs or global
warps, stages are separated by :func:`grid_barrier`, and shared-memory scratch is passed in by the caller.
All arithmetic is fp32; weights and the KV cache are bf16 and are read with 16-byte vector loads where the
layout allows. Bodies never allocate and never synchronise the grid themselves (except grid_barrier).
The CPU reference executor (``megabake.plan.reference``) mirrors each body; keep the two in step.

Files, in ``BODY_FILES`` order (the order code generation copies routines into a self-contained module.py;
``megabake.codegen.bodies_source()`` joins them into one text, each file's own imports dropped):
``common`` (imports, WARP/VEC), ``sync`` (grid barrier, L2 prefetch), ``staging`` (embedding gather, RMSNorm /
copy / gated activation into shared memory), ``gemv`` (the GEMV tilings), ``attention`` (unsplit decode
attention, attention preload), ``split_attention`` (split-KV flash decoding), ``mlp`` (gate/up and down in one
interval, ``generate(plan, fused_mlp=True)``), ``loader`` (the loader warp's streams and the ring GEMV that reads
them, ``generate(plan, loader_warp=True)``). Legacy module.py files import this
package and call ``bodies.<name>``: every routine is re-exported here. (The banner of a self-contained module.py
still names ``megabake/codegen/bodies/__init__.py``, as before the split, so module.py bytes did not change.)
"""

from __future__ import annotations

from .attention import *  # noqa: F401,F403
from .common import VEC, WARP  # noqa: F401
from .gemv import *  # noqa: F401,F403
from .loader import *  # noqa: F401,F403
from .mlp import *  # noqa: F401,F403
from .split_attention import *  # noqa: F401,F403
from .staging import *  # noqa: F401,F403
from .sync import *  # noqa: F401,F403

BODY_FILES = ("common.py", "sync.py", "staging.py", "gemv.py", "attention.py", "split_attention.py", "mlp.py",
              "loader.py")
