"""Issue 12's scorecard, read from the stored benchmark results (no GPU, no network).

Contract: ``python3 benchmarks/status.py [--results benchmarks/results] [--out FILE.md]`` reads every benchmark
cell stored under ``--results``: the JSON lists that ``benchmarks/decode.py --positions ...`` writes
(``matrix.json``, ``<preset>-matrix.json``), one dict per (preset, batch, position) with ``status``, ``speedup``,
``megabake_ms``, ``megabake_gpu_ms`` and ``numerics``. Of each (preset, batch, position class) it keeps the newest
cell, by the date and session number in its folder's name (``2026-12-04-h200-session30``), and prints issue 12's
criteria against them as markdown:

- **speedup**: at least 1.5x over the strongest graphed Inductor of its run at ~16 / ~1000 / ~4000 positions (or
  the model's limit: ``POSITION_CLASSES``), with numerics passing;
- **growth**: the GPU time at the long end within (the GPU time at ~16 of the same run + the K/V bytes the long
  step reads at 3.5 TB/s) x 1.15; the K/V bytes count each layer's sliding window (:func:`kv_bytes`), as the
  kernel reads only the window (``plan.attn_window_table``);
- **short-context GPU targets** at batch 1 (``SHORT_TARGETS``), **batch 8 <= 1.5x batch 1** on Llama-3.2-1B, and the
  **host cost** (synchronized ms - GPU ms) within 15 us: back to back where a cell has ``megabake_block_ms`` (the
  timing harness's block of synchronized calls in a row, as a decode loop runs; cells since session 32), and in
  the benchmark's alternating rounds (``megabake_ms``), where the first call after the baseline's runs is slower;
- **profiled**: how many of the cells shown were timed after the harness's ``torch.profiler`` graph check (up to
  session 31; CUPTI stays attached after a profile and can slow what is timed after it);
- **re-bench first**: the rows that fail a criterion on cells measured before the default kernel of today that
  applies to them (:func:`default_since`), each with the device command that re-measures it;
- **missing**: the (preset, batch, position class) cells of every preset (not the tiny ones) at batches 1 / 4 / 8
  that no stored run has measured; buckets that no plan can hold (:func:`bucket_refusal`: the bake's shared-memory
  check) are listed apart with the bake's reason.

Issue 12 is judged on the H200: only runs whose folder names it (``-h200-``; a folder naming no GPU counts as
one) are scored. Cells of other GPUs (``2026-12-05-h100-session39``) are listed apart, with their own growth
rows, never mixed in.

It reports; it never fails on a criterion (exit status 0). Bad input (no such folder, a file that is not JSON,
a cell without its keys) is an error naming the folder or file (exit status 2).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

SPEEDUP_TARGET = 1.5
GROWTH_BANDWIDTH = 3.5e12  # bytes/s the issue reads the K/V cache at
GROWTH_MARGIN = 1.15
HOST_TARGET_US = 15.0
BATCH8_LIMIT = 1.5  # batch 8 / batch 1 GPU time per step, Llama-3.2-1B
SHORT_TARGETS = {"llama-3.2-1b": 0.75, "qwen2.5-0.5b": 0.45, "qwen3-0.6b": 0.50, "smollm-135m": 0.30}
BATCHES = (1, 4, 8)
POSITION_CLASSES = ("~16", "~1000", "~4000")  # ~4000: 1900 positions or more (SmolLM-135M's limit is 2048)
CELL_KEYS = ("preset", "batch", "position", "status")
# the timing harness profiled every candidate with torch.profiler (CUPTI, which stays attached) before timing it
# until session 31 (docs/PERF.md, "Session 31"); cells from a later session or date were timed without it
UNPROFILED_FROM = ("2026-12-04", 32)
FOLDER_DATE = re.compile(r"(\d{4}-\d{2}-\d{2})")
FOLDER_SESSION = re.compile(r"session(\d+)")
FOLDER_GPU = re.compile(r"\d{4}-\d{2}-\d{2}-(h\d+)(?:-|$)")
SCORED_GPU = "h200"  # issue 12's criteria are H200 numbers
# the sessions that changed the default kernel since every preset's K/V prefetch was capped (session 29,
# docs/PERF.md): 33 put split-KV items of 2-8 query heads of 64 / 128 dims on the tensor cores (GQA presets), 36
# fused attention and the O projection at batch 1's short contexts (those presets, ~16 only), 42 the same
# tensor-core items for heads of 256 dims (Gemma, mma_wide), 45 fused_split and fused_mlp at batch 1 (those
# presets, every context), 49 spare_warp and bulk_down (warp 0's ring fills after each wait: every preset's batch-1
# build fills rings, batch 4 / 8 builds do not), 55 the paced loader warp (LOADER_PRESETS at batch 1), 60 the O
# blocks' merge of up to 16 splits (GROUP_FOLD_PRESETS at batch 1), 64 the split cap (SPLIT_CAP_PRESETS at batch 1:
# the tensor-core schedule over at most 16 splits a KV group); a failing row measured before the change that applies
# to it is stale, and "Re-bench first" lists it (:func:`default_since`)
KV_PREFETCH_CAPPED, MMA_ATTENTION, MMA_WIDE, SPARE_WARP, LOADER_WARP, GROUP_FOLD, SPLIT_CAP = 29, 33, 42, 49, 55, 60, 64
# the presets whose batch-1 default builds the loader warp (megabake.codegen.loader.default_loader_warp; pinned by
# tests/test_loader_warp.py, which builds every preset)
LOADER_PRESETS = frozenset({"qwen3-0.6b", "qwen2.5-0.5b"})
# the presets whose batch-1 default module group_fold changes (megabake.codegen.default_group_fold: fused_split
# with more than 8 splits a KV group; pinned by tests/test_families.py, which builds every preset)
GROUP_FOLD_PRESETS = frozenset({"smollm-135m", "llama-3.2-1b", "qwen2.5-0.5b", "qwen3-0.6b", "granite-3.1-2b"})
# the presets whose batch-1 default module the split_cap feature changes (megabake.codegen.split_cap_fits_group: KV
# groups of 7+ query heads; pinned by tests/test_split_cap.py, which checks every preset)
SPLIT_CAP_PRESETS = frozenset({"qwen2.5-0.5b"})


@dataclass(frozen=True)
class Cell:
    """One stored benchmark cell and the run it came from (``run``: its file; ``order``: (date, session))."""

    preset: str
    batch: int
    position: int
    measured: bool
    speedup: float | None
    sync_ms: float | None
    gpu_ms: float | None
    block_ms: float | None
    numerics_pass: bool
    run: str
    order: tuple[str, int]
    gpu: str = SCORED_GPU

    @property
    def position_class(self) -> str | None:
        return position_class(self.position)

    @property
    def session(self) -> str:
        date, session = self.order
        return f"s{session}" if session else date

    @property
    def profiled(self) -> bool:
        """Timed after the harness's CUPTI profile of each candidate (before ``UNPROFILED_FROM``)."""
        date, session = self.order
        last_date, first_session = UNPROFILED_FROM
        return session < first_session and date <= last_date

    @property
    def passes(self) -> bool:
        return self.measured and self.numerics_pass and (self.speedup or 0.0) >= SPEEDUP_TARGET


def position_class(position: int) -> str | None:
    """``~16`` below 100 positions, ``~1000`` from 500 to 1899, ``~4000`` from 1900 on; None between."""
    if position < 100:
        return "~16"
    if 500 <= position < 1900:
        return "~1000"
    return "~4000" if position >= 1900 else None


def run_order(path: Path) -> tuple[str, int]:
    """(date, session number) of the results folder a file lies in: what "newest" means here."""
    text = str(path)
    dates = FOLDER_DATE.findall(text)
    sessions = FOLDER_SESSION.findall(text)
    return (dates[-1] if dates else "", int(sessions[-1]) if sessions else 0)


def run_gpu(path: Path) -> str:
    """The GPU a results folder names (``2026-12-05-h100-session39`` -> ``h100``); ``SCORED_GPU`` where it names
    none."""
    found = FOLDER_GPU.findall(str(path))
    return found[-1] if found else SCORED_GPU


def cells_of_file(path: Path, root: Path) -> list[Cell]:
    """The benchmark cells of one JSON file (none when it holds something else: tuning logs, reports)."""
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc}); restore it from git or remove it") from exc
    if not isinstance(data, list) or not data or not all(isinstance(c, dict) for c in data):
        return []
    if not all("position" in c and "speedup" in c for c in data):
        return []
    cells = []
    for raw in data:
        missing = [key for key in CELL_KEYS if key not in raw]
        if missing:
            raise ValueError(f"{path}: a benchmark cell lacks {', '.join(missing)}: {json.dumps(raw)[:200]}")
        relative = path.relative_to(root)
        cells.append(_cell(raw, relative.as_posix(), run_order(relative), run_gpu(relative)))
    return cells


def _cell(raw: dict, run: str, order: tuple[str, int], gpu: str = SCORED_GPU) -> Cell:
    numerics = raw.get("numerics") or {}
    return Cell(preset=raw["preset"], batch=int(raw["batch"]), position=int(raw["position"]),
                measured=raw["status"] == "measured", speedup=raw.get("speedup"), sync_ms=raw.get("megabake_ms"),
                gpu_ms=raw.get("megabake_gpu_ms"), block_ms=raw.get("megabake_block_ms"),
                numerics_pass=bool(numerics.get("pass")), run=run, order=order, gpu=gpu)


def load_cells(root: Path) -> list[Cell]:
    if not root.is_dir():
        raise ValueError(f"results folder {root} does not exist; pass --results with the folder that holds the "
                         "benchmark runs (benchmarks/results in this repository)")
    return [cell for path in sorted(root.rglob("*.json")) for cell in cells_of_file(path, root)]


def newest(cells: list[Cell]) -> dict[tuple[str, int, str], Cell]:
    """The newest cell of each (preset, batch, position class); a later file of the same run wins a tie."""
    best: dict[tuple[str, int, str], Cell] = {}
    for cell in sorted(cells, key=lambda c: (c.order, c.run)):
        if cell.position_class:
            best[(cell.preset, cell.batch, cell.position_class)] = cell
    return best


# ----------------------------------------------------------------------------------------- K/V bytes
def layer_windows(config) -> list[int | None]:
    """Each layer's sliding window (None: the whole cache), as the traced masks give it: ``layer_types``'
    ``sliding_attention`` layers where the config lists them, else every layer when ``sliding_window`` is set
    (and ``use_sliding_window`` is not False, as in Qwen2)."""
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return [None] * layers
    types = getattr(config, "layer_types", None)
    if types:
        return [window if kind == "sliding_attention" else None for kind in types]
    return [window] * layers


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_bytes(config, position: int, batch: int, element_bytes: int = 2) -> int:
    """Bytes of K and V that the decode step at ``position`` reads: its ``position + 1`` visible keys per
    layer (at most the layer's window), every KV head, every sequence of the batch."""
    head_dim = _head_dim(config)
    row = 2 * config.num_key_value_heads * head_dim * element_bytes
    visible = [position + 1 if window is None else min(position + 1, window) for window in layer_windows(config)]
    return sum(visible) * row * batch


def preset_config(name: str):
    from megabake.presets import get_preset

    return get_preset(name).make_config()


# --------------------------------------------------------------------------------------------- report
def speedup_table(best: dict) -> list[str]:
    rows = sorted({(preset, batch) for preset, batch, _ in best})
    lines = ["| preset | batch | " + " | ".join(POSITION_CLASSES) + " | all >= 1.5x, numerics pass |",
             "|---|---|" + "---|" * (len(POSITION_CLASSES) + 1)]
    for preset, batch in rows:
        cells = [best.get((preset, batch, cls)) for cls in POSITION_CLASSES]
        shown = [_speedup_text(cell) for cell in cells]
        verdict = "yes" if all(cell and cell.passes for cell in cells) else "**no**"
        lines.append(f"| {preset} | {batch} | " + " | ".join(shown) + f" | {verdict} |")
    return lines


def _speedup_text(cell: Cell | None) -> str:
    if cell is None:
        return "missing"
    if not cell.measured:
        return f"not measured ({cell.session})"
    text = f"{cell.speedup:.2f}x @{cell.position} ({cell.session})"
    if not cell.numerics_pass:
        text += ", numerics failed"
    return f"**{text}**" if cell.passes else text


@dataclass(frozen=True)
class Growth:
    preset: str
    batch: int
    short: Cell
    long: Cell
    kv_bytes: int

    @property
    def budget_ms(self) -> float:
        return (self.short.gpu_ms + self.kv_bytes / GROWTH_BANDWIDTH * 1e3) * GROWTH_MARGIN

    @property
    def within(self) -> bool:
        return self.long.gpu_ms <= self.budget_ms


def growth_rows(cells: list[Cell], config_of=preset_config) -> list[Growth]:
    """Per (preset, batch), the newest run holding GPU times at both ~16 and ~4000 (its longest position)."""
    runs: dict[tuple[str, int, str], list[Cell]] = {}
    for cell in cells:
        if cell.measured and cell.gpu_ms:
            runs.setdefault((cell.preset, cell.batch, cell.run), []).append(cell)
    chosen: dict[tuple[str, int], Growth] = {}
    for (preset, batch, _), run in sorted(runs.items(), key=lambda item: (item[1][0].order, item[0][2])):
        short = [c for c in run if c.position_class == "~16"]
        long = [c for c in run if c.position_class == "~4000"]
        if short and long:
            top = max(long, key=lambda c: c.position)
            chosen[(preset, batch)] = Growth(preset, batch, min(short, key=lambda c: c.position), top,
                                             kv_bytes(config_of(preset), top.position, batch))
    return [chosen[key] for key in sorted(chosen)]


def growth_table(growths: list[Growth]) -> list[str]:
    lines = ["| preset | batch | GPU ms @~16 | GPU ms @long | K/V read | budget ms | within | run |",
             "|---|---|---|---|---|---|---|---|"]
    for g in growths:
        lines.append(f"| {g.preset} | {g.batch} | {g.short.gpu_ms:.3f} @{g.short.position} | "
                     f"{g.long.gpu_ms:.3f} @{g.long.position} | {g.kv_bytes / 1e6:.0f} MB | {g.budget_ms:.3f} | "
                     f"{'yes' if g.within else '**no**'} | {g.long.session} |")
    return lines


def short_target_table(best: dict) -> list[str]:
    lines = ["| preset | GPU ms at ~16, batch 1 | target | met |", "|---|---|---|---|"]
    for preset, target in SHORT_TARGETS.items():
        cell = best.get((preset, 1, "~16"))
        if cell is None or not cell.gpu_ms:
            lines.append(f"| {preset} | missing | {target} | no |")
            continue
        met = "yes" if cell.gpu_ms <= target else "**no**"
        lines.append(f"| {preset} | {cell.gpu_ms:.3f} ({cell.session}) | {target} | {met} |")
    return lines


def batch8_line(cells: list[Cell], best: dict) -> str:
    """Llama-3.2-1B's batch-8 GPU time at ~16 over batch 1's: within the newest run that has both (same tree,
    same machine), and newest against newest (batch 1 may have been re-measured on a faster kernel since)."""
    def gpu16(batch: int, pool) -> Cell | None:
        found = [c for c in pool if c.preset == "llama-3.2-1b" and c.batch == batch and c.position_class == "~16"
                 and c.measured and c.gpu_ms]
        return max(found, key=lambda c: (c.order, c.run), default=None)

    parts = []
    paired = [(run, gpu16(1, group), gpu16(8, group)) for run, group in _by_run(cells).items()]
    paired = [(one, eight) for _, one, eight in paired if one and eight]
    if paired:
        one, eight = max(paired, key=lambda pair: pair[1].order)
        parts.append(_ratio_text("same run", one, eight))
    one, eight = best.get(("llama-3.2-1b", 1, "~16")), best.get(("llama-3.2-1b", 8, "~16"))
    if one and eight and one.gpu_ms and eight.gpu_ms and one.run != eight.run:
        parts.append(_ratio_text("newest of each", one, eight))
    if not parts:
        return "Batch 8 vs batch 1 (Llama-3.2-1B, ~16): missing."
    return f"Batch 8 vs batch 1 (Llama-3.2-1B, ~16, GPU ms, limit {BATCH8_LIMIT}x): " + "; ".join(parts) + "."


def _by_run(cells: list[Cell]) -> dict[str, list[Cell]]:
    runs: dict[str, list[Cell]] = {}
    for cell in cells:
        runs.setdefault(cell.run, []).append(cell)
    return runs


def _ratio_text(label: str, one: Cell, eight: Cell) -> str:
    ratio = eight.gpu_ms / one.gpu_ms
    verdict = "met" if ratio <= BATCH8_LIMIT else "**not met**"
    return (f"{label} {eight.gpu_ms:.3f} ({eight.session}) / {one.gpu_ms:.3f} ({one.session}) = {ratio:.2f}x, "
            f"{verdict}")


def profiled_line(best: dict) -> str:
    measured = [c for c in best.values() if c.measured]
    profiled = sum(c.profiled for c in measured)
    if not profiled:
        return "Every cell shown was timed without a profiler attached."
    return (f"{profiled} of {len(measured)} cells shown were timed after the harness had profiled each candidate with "
            "torch.profiler (sessions up to 31), which can leave CUPTI attached and slow later calls on both sides "
            "of the ratio (docs/PERF.md, \"Session 31\"): re-bench before trusting a ratio near the line.")


def _gap_summary(gaps: list[float]) -> str:
    gaps = sorted(gaps)
    within = sum(gap <= HOST_TARGET_US for gap in gaps)
    return (f"{gaps[0]:.0f}-{gaps[-1]:.0f} us, median {gaps[len(gaps) // 2]:.0f}; {within} of {len(gaps)} cells "
            f"within {HOST_TARGET_US:.0f} us")


def host_line(best: dict) -> str:
    """Synchronized minus GPU time of the newest cells: in the alternating rounds (every cell), and back to back
    (the cells that stored the harness's block median)."""
    timed = [c for c in best.values() if c.measured and c.sync_ms and c.gpu_ms]
    if not timed:
        return "Host cost: no cell has both times."
    line = (f"Host cost (synchronized ms - the GPU ms of calls queued back to back, newest cells), in the "
            f"alternating rounds: {_gap_summary([(c.sync_ms - c.gpu_ms) * 1e3 for c in timed])}.")
    blocks = [(c.block_ms - c.gpu_ms) * 1e3 for c in timed if c.block_ms]
    if blocks:
        line += f" Back to back (synchronized calls in a row, cells since session 32): {_gap_summary(blocks)}."
    return line


def default_since(config, batch: int, cls: str | None, preset: str = "") -> int:
    """The session since which a (preset, batch, position class) cell runs the default kernel of today: at batch 1,
    64 for :data:`SPLIT_CAP_PRESETS` (the capped tensor-core schedule), 60 for the other :data:`GROUP_FOLD_PRESETS`
    (the O blocks merge up to 16 splits), 55 for the other :data:`LOADER_PRESETS` (the paced loader warp), else 49
    (spare_warp on every preset's ring fills, bulk_down where fused_mlp applies); at batches 4 / 8, 33 where the
    model's KV groups are 2-8 query heads of 64 or 128 dims (the tensor-core attention,
    ``plan.attention.mma_attention_fits``), 42 where they are 2-8 query heads of 256 dims (Gemma: ``mma_wide``;
    every position class, though short contexts may deal one-head slices that it does not change, so this can
    call a row stale that did not change), else 29."""
    head_dim = _head_dim(config)
    group = config.num_attention_heads // config.num_key_value_heads
    if batch == 1:
        if preset in SPLIT_CAP_PRESETS:
            return SPLIT_CAP
        if preset in GROUP_FOLD_PRESETS:
            return GROUP_FOLD
        return LOADER_WARP if preset in LOADER_PRESETS else SPARE_WARP
    if 2 <= group <= 8 and head_dim == 256:
        return MMA_WIDE
    if not (2 <= group <= 8 and head_dim in (64, 128)):
        return KV_PREFETCH_CAPPED
    return MMA_ATTENTION


def _loader_only() -> str:
    """The re-bench note's clause for the loader presets that group_fold does not date later (none today)."""
    rest = sorted(LOADER_PRESETS - GROUP_FOLD_PRESETS)
    return f", {LOADER_WARP} for {', '.join(rest)}" if rest else ""


def _stale(cells: list[Cell], config) -> bool:
    """Whether any of ``cells`` was measured before the default kernel that applies to it (:func:`default_since`)."""
    return any(cell.order[1] < default_since(config, cell.batch, cell.position_class, cell.preset) for cell in cells)


def failing_rows(best: dict, growths: list[Growth]) -> dict[tuple[str, int], list[tuple[str, list[Cell]]]]:
    """Per (preset, batch), the criteria its newest cells fail, each with the cells behind the verdict: the 1.5x
    row (every class measured), growth with context, the short-context target (batch 1)."""
    failing: dict[tuple[str, int], list[tuple[str, list[Cell]]]] = {}
    for preset, batch in sorted({(p, b) for p, b, _ in best}):
        row = [best[(preset, batch, cls)] for cls in POSITION_CLASSES if (preset, batch, cls) in best]
        if len(row) == len(POSITION_CLASSES) and not all(cell.passes for cell in row):
            failing.setdefault((preset, batch), []).append(("speedup", row))
        short = best.get((preset, batch, "~16"))
        target = SHORT_TARGETS.get(preset)
        if batch == 1 and target and short and short.gpu_ms and short.gpu_ms > target:
            failing.setdefault((preset, batch), []).append(("short-context GPU time", [short]))
    for g in growths:
        if not g.within:
            failing.setdefault((g.preset, g.batch), []).append(("growth", [g.short, g.long]))
    return failing


def rebench_lines(best: dict, growths: list[Growth], config_of=preset_config) -> list[str]:
    """The failing rows measured before today's default kernel, each with the bench command that re-measures it
    (one preset and batch per device call)."""
    lines = []
    for (preset, batch), criteria in failing_rows(best, growths).items():
        config = config_of(preset)
        stale = [(name, cells) for name, cells in criteria if _stale(cells, config)]
        if not stale:
            continue
        since = max(default_since(config, batch, cls, preset) for cls in POSITION_CLASSES)
        longest = best.get((preset, batch, "~4000"))
        positions = f"16 1000 {longest.position if longest else 4000}"
        verdicts = ", ".join(f"{name} ({'/'.join(sorted({c.session for c in cells}))})" for name, cells in stale)
        lines.append(f"- {preset} batch {batch}: {verdicts}, before session {since}'s default: "
                     f"`BENCH_ARGS=\"--positions {positions} --batches {batch} --baselines inductor-graph "
                     f"inductor-default-graph\" PARTS=bench bash scripts/gpu_session.sh \"$OUT\" {preset}`")
    return lines


def expected_presets() -> list[str]:
    root = str(Path(__file__).resolve().parents[1])  # the repository, so the script runs without installing it
    if root not in sys.path:
        sys.path.insert(0, root)
    from megabake.presets import PRESETS

    return [name for name, preset in PRESETS.items() if not name.startswith("tiny-") and not preset.experimental]


def _bucket_check(config, batch: int, global_down: bool) -> str | None:
    """The bake's shared-memory check (``plan.memory.check_shared_memory``, bf16 staging, split-KV attention) of
    this model at ``batch``: its refusal, or None where the bucket fits."""
    from megabake.errors import PlanError
    from megabake.plan.memory import check_shared_memory
    from megabake.plan.model import ModelDims

    head_dim = _head_dim(config)
    dims = ModelDims(hidden=config.hidden_size, n_heads=config.num_attention_heads,
                     n_kv_heads=config.num_key_value_heads, head_dim=head_dim,
                     intermediate=config.intermediate_size, vocab=config.vocab_size, layers=config.num_hidden_layers,
                     eps=1e-6, norm_offset=0.0, attn_scale=1.0, act="silu")
    try:
        check_shared_memory(dims, batch, 4096, 256, split_kv=True, staging="bfloat16", global_down=global_down)
    except PlanError as exc:
        return str(exc)
    return None


def bucket_refusal(config, batch: int) -> str | None:
    """Why no plan of this model holds ``batch`` sequences even with the down projection's input read from global
    memory (the least the kernel stages, ``Plan.down_input``), or None where the bucket fits."""
    return _bucket_check(config, batch, global_down=True)


def missing_lines(best: dict, presets: list[str], config_of=preset_config) -> list[str]:
    """The cells no stored run has measured, per preset; buckets no plan can hold (:func:`bucket_refusal`) are
    named apart, with the reason, as nothing to measure."""
    lines, refused = [], []
    for preset in presets:
        holes, config = [], config_of(preset)
        for batch in BATCHES:
            absent = [cls for cls in POSITION_CLASSES if (preset, batch, cls) not in best]
            if not absent:
                continue
            why = bucket_refusal(config, batch)
            if why:
                refused.append(f"- {preset} batch {batch}: {why}")
                continue
            holes += [f"b{batch} {cls}" for cls in absent]
            if _bucket_check(config, batch, global_down=False):  # only a down_input="global" plan holds it
                holes[-1] += " (these read the down input from global memory)"
        if holes:
            lines.append(f"- {preset}: " + ", ".join(holes))
    return lines + (["", "Buckets no plan holds (the bake refuses them; nothing to measure):", "", *refused]
                    if refused else [])


def other_gpu_lines(others: list[Cell], config_of=preset_config) -> list[str]:
    """The cells of runs on other GPUs than ``SCORED_GPU``, one line each, then each GPU's growth rows under the
    same rule (not scored)."""
    if not others:
        return []
    lines = [f"## Other GPUs (not scored: issue 12 is judged on the {SCORED_GPU.upper()})", "",
             "| GPU | preset | batch | position | GPU ms | speedup | numerics | run |", "|---|---|---|---|---|---|---|---|"]
    for cell in sorted(others, key=lambda c: (c.gpu, c.preset, c.batch, c.position, c.order)):
        speedup = f"{cell.speedup:.2f}x" if cell.measured and cell.speedup else "not measured"
        gpu_ms = f"{cell.gpu_ms:.3f}" if cell.gpu_ms else "-"
        lines.append(f"| {cell.gpu.upper()} | {cell.preset} | {cell.batch} | {cell.position} | {gpu_ms} | {speedup} | "
                     f"{'pass' if cell.numerics_pass else 'fail'} | {cell.session} |")
    for gpu in sorted({cell.gpu for cell in others}):
        growths = growth_rows([cell for cell in others if cell.gpu == gpu], config_of)
        if growths:
            lines += ["", f"Growth with context on the {gpu.upper()} (the same rule, for comparison only):", "",
                      *growth_table(growths)]
    return ["", *lines]


def render(cells: list[Cell], presets: list[str], config_of=preset_config) -> str:
    others = [cell for cell in cells if cell.gpu != SCORED_GPU]
    cells = [cell for cell in cells if cell.gpu == SCORED_GPU]
    best = newest(cells)
    growths = growth_rows(cells, config_of)
    parts = ["# Issue 12 scorecard (from benchmarks/results)", "",
             f"{len(cells)} stored {SCORED_GPU.upper()} cells ({len(others)} of other GPUs listed last, not scored); "
             "the newest of each (preset, batch, position class) is shown with its session.",
             "", "## Speedup over the strongest graphed Inductor", "", *speedup_table(best), "", profiled_line(best),
             "", "## Growth with context", "",
             f"Budget: (GPU ms at ~16 + K/V bytes at {GROWTH_BANDWIDTH / 1e12:g} TB/s) x {GROWTH_MARGIN}, both from the "
             "same run; K/V bytes count sliding windows.", "", *growth_table(growths),
             "", "## Short-context GPU time", "", *short_target_table(best), "", batch8_line(cells, best), "",
             host_line(best), "", "## Re-bench first", "",
             f"Rows that fail a criterion on cells measured before today's default kernel (session {SPARE_WARP} at "
             f"batch 1, {SPLIT_CAP} for {', '.join(sorted(SPLIT_CAP_PRESETS))}, {GROUP_FOLD} for "
             f"{', '.join(sorted(GROUP_FOLD_PRESETS - SPLIT_CAP_PRESETS))}{_loader_only()}, {MMA_ATTENTION} "
             "at other batches for "
             f"KV groups of 2-8 heads of 64 / 128 dims, {MMA_WIDE} for groups of 2-8 heads of 256, else "
             f"{KV_PREFETCH_CAPPED}):", ""]
    parts.extend(rebench_lines(best, growths, config_of)
                 or ["None: every failing row was measured on the current default."])
    parts.extend(["", "## Not measured yet", ""])
    parts.extend(missing_lines(best, presets, config_of)
                 or ["Nothing: every preset has every batch and position class."])
    parts.extend(other_gpu_lines(others, config_of))
    return "\n".join(parts) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=Path(__file__).resolve().parent / "results",
                        help="folder of stored benchmark runs (default: benchmarks/results)")
    parser.add_argument("--out", type=Path, help="also write the scorecard to this markdown file")
    args = parser.parse_args(argv)
    try:
        text = render(load_cells(args.results), expected_presets())
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.out:
        args.out.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
