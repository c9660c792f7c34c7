"""Shared memory per CTA: the kernel's scratch (GEMV input rows, reductions, attention) and its limit.

Contract: ``smem_floats(dims, batch, capacity, threads, split_kv)`` sizes the fp32 scratch regions;
``smem_bytes`` is their total in bytes (with alignment, without the GEMV ring, see ``megabake.plan.tuning``);
``check_shared_memory`` raises :class:`PlanError` when a bucket does not fit Hopper's per-CTA limit, naming the
largest batch or capacity that does.
"""

from __future__ import annotations

from ..errors import PlanError
from .model import WARP, ModelDims
from .tuning import HOPPER_SMEM_PER_BLOCK


def smem_floats(dims: ModelDims, batch: int, capacity: int, threads: int, split_kv: bool = False) -> dict[str, int]:
    """Shared-memory scratch in fp32 elements: GEMV input vectors, reductions, attention scratch (unsplit: one
    head's scores over the whole capacity; split-KV: the group's queries and per-warp partials, no capacity)."""
    warps = threads // WARP
    group = dims.n_heads // dims.n_kv_heads
    att = (group * dims.head_dim + 8 * ((group + 8) // 8) + 8 + (dims.head_dim + 2) * group * warps if split_kv
           else dims.head_dim + capacity + warps * dims.head_dim)
    return {
        "vec_width": max(dims.hidden, dims.q_rows, dims.intermediate),
        "red": warps * max(batch, 1),
        "att": att,
    }


def check_shared_memory(dims: ModelDims, batch: int, capacity: int, threads: int, split_kv: bool = False) -> None:
    """The kernel stages each GEMV input row (fp32) and the attention scores of one head in shared memory."""
    need = smem_bytes(dims, batch, capacity, threads, split_kv)
    if need <= HOPPER_SMEM_PER_BLOCK:
        return
    floats = smem_floats(dims, batch, capacity, threads, split_kv)
    spare = HOPPER_SMEM_PER_BLOCK - (need - 4 * capacity) if not split_kv else 0
    max_capacity = max(0, spare // 4)
    max_batch = max(0, (HOPPER_SMEM_PER_BLOCK - (need - 4 * batch * floats["vec_width"])) // (4 * floats["vec_width"]))
    fixes = [f"--batch {max_batch} or less at this capacity"] if max_batch >= 1 else []
    fixes += [f"--capacity {max_capacity} or less at this batch"] if max_capacity >= 1 else []
    fix = (" or ".join(fixes) if fixes
           else "a smaller --batch and --capacity (neither alone is enough)")
    raise PlanError(f"bucket batch={batch}, capacity={capacity} needs {need} bytes of shared memory per CTA, over "
                    f"Hopper's {HOPPER_SMEM_PER_BLOCK}: the kernel stages each sequence's {floats['vec_width']}-wide "
                    f"fp32 GEMV input and one head's attention scores on chip. For this model use {fix}")


def smem_bytes(dims: ModelDims, batch: int, capacity: int, threads: int, split_kv: bool = False) -> int:
    floats = smem_floats(dims, batch, capacity, threads, split_kv)
    return 4 * (batch * floats["vec_width"] + floats["red"] + floats["att"]) + 3 * 16
