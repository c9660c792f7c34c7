"""Shared memory per CTA: the kernel's scratch (GEMV input rows, reductions, attention) and its limit.

Contract: ``smem_floats(dims, batch, capacity, threads, split_kv)`` sizes the scratch regions in elements;
``smem_bytes(..., staging)`` is their total in bytes (with alignment, without the GEMV ring, see
``megabake.plan.tuning``), the GEMV input rows taking 4 bytes per element when staged in fp32 and 2 in bf16
(``staging``: "float32" | "bfloat16"). ``staging_dtype`` picks fp32 when it fits and bf16 otherwise (large
batches: eight 8192-wide rows are 256 KiB in fp32); ``check_shared_memory`` raises :class:`PlanError` when a
bucket does not fit Hopper's per-CTA limit even so, naming the largest batch or capacity that does. With
``global_down`` (``Plan.down_input == "global"``: the tensor-core down projection reads its bf16 input rows from
global memory) the intermediate-wide rows are not staged, so the widest staged row is the hidden or query width.
"""

from __future__ import annotations

from ..errors import PlanError
from .model import WARP, ModelDims
from .tuning import HOPPER_SMEM_PER_BLOCK

STAGING_BYTES = {"float32": 4, "bfloat16": 2}  # bytes per staged GEMV input element


def smem_floats(dims: ModelDims, batch: int, capacity: int, threads: int, split_kv: bool = False,
                global_down: bool = False) -> dict[str, int]:
    """Shared-memory scratch in elements: GEMV input vectors (``vec_width`` per sequence, in the staging dtype;
    the intermediate width only where the down projection stages its input, not ``global_down``), reductions and
    attention scratch (fp32; unsplit: one head's scores over the whole capacity; split-KV: the group's queries and
    per-warp partials, no capacity)."""
    warps = threads // WARP
    group = dims.n_heads // dims.n_kv_heads
    att = (group * dims.head_dim + 8 * ((group + 8) // 8) + 8 + (dims.head_dim + 2) * group * warps if split_kv
           else dims.head_dim + capacity + warps * dims.head_dim)
    return {
        "vec_width": max(dims.hidden, dims.q_rows, 0 if global_down else dims.intermediate),
        "red": warps * max(batch, 1),
        "att": att,
    }


def smem_bytes(dims: ModelDims, batch: int, capacity: int, threads: int, split_kv: bool = False,
               staging: str = "float32", global_down: bool = False) -> int:
    floats = smem_floats(dims, batch, capacity, threads, split_kv, global_down)
    staged = STAGING_BYTES[staging] * batch * floats["vec_width"]
    return _aligned(staged) + 4 * (floats["red"] + floats["att"]) + 3 * 16


def _aligned(nbytes: int) -> int:
    """fp32 staging is a whole number of 16-byte vectors already; bf16 rows are padded like the allocator does."""
    return (nbytes + 15) // 16 * 16


def staging_dtype(dims: ModelDims, batch: int, capacity: int, threads: int, split_kv: bool = False) -> str:
    """fp32 GEMV input rows when they fit on chip, else bf16 (what eager bf16 PyTorch feeds its GEMVs)."""
    if smem_bytes(dims, batch, capacity, threads, split_kv, "float32") <= HOPPER_SMEM_PER_BLOCK:
        return "float32"
    return "bfloat16"


def check_shared_memory(dims: ModelDims, batch: int, capacity: int, threads: int, split_kv: bool = False,
                        staging: str = "float32", global_down: bool = False) -> None:
    """The kernel stages each GEMV input row and the attention scratch of one head in shared memory."""
    need = smem_bytes(dims, batch, capacity, threads, split_kv, staging, global_down)
    if need <= HOPPER_SMEM_PER_BLOCK:
        return
    floats = smem_floats(dims, batch, capacity, threads, split_kv, global_down)
    row = STAGING_BYTES[staging] * floats["vec_width"]
    spare = HOPPER_SMEM_PER_BLOCK - (need - 4 * capacity) if not split_kv else 0
    max_capacity = max(0, spare // 4)
    max_batch = max(0, (HOPPER_SMEM_PER_BLOCK - (need - batch * row)) // row)
    fixes = [f"--batch {max_batch} or less at this capacity"] if max_batch >= 1 else []
    fixes += [f"--capacity {max_capacity} or less at this batch"] if max_capacity >= 1 else []
    fix = (" or ".join(fixes) if fixes
           else "a smaller --batch and --capacity (neither alone is enough)")
    raise PlanError(f"bucket batch={batch}, capacity={capacity} needs {need} bytes of shared memory per CTA, over "
                    f"Hopper's {HOPPER_SMEM_PER_BLOCK}: the kernel stages each sequence's {floats['vec_width']}-wide "
                    f"{'bf16' if staging == 'bfloat16' else 'fp32'} GEMV input and one head's attention scores on "
                    f"chip. For this model use {fix}")
