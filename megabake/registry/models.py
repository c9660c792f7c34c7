"""``docs/MODELS.md``: which architectures MegaBake bakes, generated (never hand-written).

Contract:

* ``FAMILIES`` is the declarative list of architecture families users ask for, each a :class:`Family` with a tiny
  config (a few hundred hidden units, 2 layers) and the bucket it is tried at.
* ``model_rows(packages_root, table_dir, families=FAMILIES, presets=PRESETS)`` -> one :class:`ModelRow` per
  built-in preset (from the newest report of that preset's packages under ``packages_root``: its ``status``, GPU
  and, when verified, the numbers the leaderboard shows) and one per family (a CPU try of its tiny config through
  :func:`megabake.compiler.compile_step`: capture -> IR -> plan -> module.py, no GPU). A try that raises a
  :class:`~megabake.errors.MegaBakeError` is ``refused`` with the exception class and the first sentence of its
  message; any other exception is ``error`` (a crash, not a refusal). Nothing is hard-coded: the status is what
  the compiler and the reports say today. Presets are grouped under the family that claims them (a family's
  ``claims`` predicate, else the first family of the same HF class); a preset no family claims gets a group of
  its own, named after its class. Report links are relative to ``table_dir`` (where the table is written).
* ``preset_rows(...)`` / ``family_rows(...)`` are the two halves (the leaderboard rebuilds the cheap preset half
  from the packages it indexes; only the family half needs the CPU).
* ``render_markdown(rows)`` -> the page. It ends with the rows as JSON lines inside an HTML comment, so
  ``read_table(path)`` gives back exactly the rows the Markdown shows (the leaderboard's Models section renders
  them). Output depends only on the inputs: no clock, no addresses, fixed order (families in list order, presets
  by name within a family, then the family's CPU try; unclaimed presets last, by class).
* ``stale_rows(old, new)`` -> one line per row that differs (what ``megabake registry models --check`` prints).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterable

from megabake.errors import MegaBakeError
from megabake.presets import PRESETS, Preset

MODELS_FILE = Path("docs") / "MODELS.md"
ROWS_BEGIN = "<!-- megabake-models-rows (generated; read by `megabake registry build`)"
ROWS_END = "-->"

# status -> what it means (the legend of the table, in this order)
STATUSES = {
    "verified": "baked, and verified on a GPU by `megabake verify` (numerics and timings in the report)",
    "bakes-cpu": "bakes on the CPU (capture → IR → plan → module.py) but not yet verified on a GPU",
    "failed": "baked, but failed its GPU verification (the report says why)",
    "refused": "the compiler refuses it (the error says which node or layout, and where)",
    "error": "the compiler crashed on it (an unexpected exception, not a refusal: a bug to report)",
    "no-package": "built-in preset with no package under packages/ yet",
}
MEASURE_SHORT = {"sync_call": "synchronized call", "pipelined": "pipelined calls", "gpu_event": "GPU events"}


# ------------------------------------------------------------------------------------------------ families


@dataclass(frozen=True)
class Family:
    """An architecture family users ask for, with a tiny config the generator tries to compile on the CPU."""

    key: str
    name: str
    architecture: str
    config: dict[str, Any] = field(hash=False)
    batch: int = 1
    capacity: int = 128
    note: str = ""  # what the tiny config exercises, shown with the CPU try
    claims: Callable[[Preset], bool] | None = field(default=None, hash=False, compare=False)

    def tiny_preset(self) -> Preset:
        return Preset(name=f"family-{self.key}", model_id=f"tiny/{self.key}", architecture=self.architecture,
                      config=self.config)

    def describe(self) -> str:
        c = self.config
        hidden, heads = c.get("hidden_size"), c.get("num_attention_heads")
        kv = c.get("num_key_value_heads") or heads
        head_dim = c.get("head_dim") or (hidden // heads if hidden and heads else None)
        text = (f"hidden {hidden}, {c.get('num_hidden_layers')} layers, {heads}/{kv} heads × {head_dim}, "
                f"vocab {c.get('vocab_size')}")
        return text + (f", {self.note}" if self.note else "")


_TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=512)


def _smollm(preset: Preset) -> bool:
    return preset.model_id.startswith("HuggingFaceTB/SmolLM")


def _mistral(sliding: bool) -> Callable[[Preset], bool]:
    return lambda p: p.architecture == "MistralForCausalLM" and bool(p.config.get("sliding_window")) is sliding


def _partial_rotary(partial: bool) -> Callable[[Preset], bool]:
    def claims(p: Preset) -> bool:
        factor = (p.config.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)
        return p.architecture == "Phi3ForCausalLM" and (factor < 1.0) is partial
    return claims


FAMILIES: tuple[Family, ...] = (
    Family("llama", "Llama", "LlamaForCausalLM", dict(_TINY, hidden_act="silu", rms_norm_eps=1e-5)),
    Family("smollm", "SmolLM (Llama shape)", "LlamaForCausalLM",
           dict(_TINY, hidden_size=192, num_attention_heads=3, num_key_value_heads=1, tie_word_embeddings=True),
           note="tied embeddings", claims=_smollm),
    Family("mistral", "Mistral (no sliding window)", "MistralForCausalLM", dict(_TINY, sliding_window=None),
           note="sliding_window None", claims=_mistral(False)),
    Family("mistral-swa", "Mistral (sliding window < KV)", "MistralForCausalLM", dict(_TINY, sliding_window=32),
           capacity=64, note="sliding_window 32 < KV 64", claims=_mistral(True)),
    Family("qwen2", "Qwen2 / Qwen2.5", "Qwen2ForCausalLM", dict(_TINY, use_sliding_window=False,
                                                                 tie_word_embeddings=True),
           note="q/k/v biases"),
    Family("qwen3", "Qwen3", "Qwen3ForCausalLM", dict(_TINY, use_sliding_window=False, tie_word_embeddings=True),
           note="per-head q/k RMSNorm"),
    Family("gemma", "Gemma", "GemmaForCausalLM",
           dict(_TINY, num_key_value_heads=1, hidden_activation="gelu_pytorch_tanh"), note="GELU-tanh MLP"),
    Family("gemma2", "Gemma 2", "Gemma2ForCausalLM", dict(_TINY, sliding_window=64),
           note="soft-capping, pre/post norms, sliding window 64 < KV on even layers"),
    Family("gemma3-text", "Gemma 3 (text)", "Gemma3ForCausalLM", dict(_TINY, num_hidden_layers=6, sliding_window=64),
           note="q/k norm, 5 local : 1 global layers (RoPE base 10k / 1M), sliding window 64 < KV"),
    Family("phi3", "Phi-3", "Phi3ForCausalLM",
           dict(hidden_size=384, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, vocab_size=512, pad_token_id=0, bos_token_id=1, eos_token_id=2),
           note="fused qkv and gate/up, head_dim 96", claims=_partial_rotary(False)),
    Family("phi4-mini", "Phi-4-mini", "Phi3ForCausalLM",
           dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                max_position_embeddings=1024, original_max_position_embeddings=128,
                rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                 "original_max_position_embeddings": 128, "factor": 8.0,
                                 "short_factor": [1.0 + i / 12 for i in range(24)],
                                 "long_factor": [1.0 + i for i in range(24)]}),
           capacity=256, note="fused projections, partial rotary (48 of 64), long-RoPE past its original range "
                              "128 < KV 256", claims=_partial_rotary(True)),
    Family("olmo2", "OLMo-2", "Olmo2ForCausalLM",
           dict(_TINY, pad_token_id=0, bos_token_id=1, eos_token_id=2),
           note="post-norms only, q/k RMSNorm over the whole projection"),
    Family("granite", "Granite", "GraniteForCausalLM",
           dict(_TINY, embedding_multiplier=12.0, attention_multiplier=0.015625, residual_multiplier=0.22,
                logits_scaling=8.0, tie_word_embeddings=True),
           note="embedding, attention, residual and logit multipliers (folded into the plan), tied"),
    Family("gpt-neox", "GPT-NeoX", "GPTNeoXForCausalLM",
           dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                vocab_size=512), note="LayerNorm, parallel residual, partial RoPE, GELU"),
    Family("qwen3.5", "Qwen3.5 (hybrid linear attention)", "Qwen3_5ForCausalLM",
           dict(_TINY, num_hidden_layers=4, tie_word_embeddings=True),
           note="3 Gated DeltaNet layers : 1 full attention"),
)

# What the refused families need, in the order that unlocks the most (written down, not generated).
NEXT_STEPS = (
    "**Attention soft-capping (Gemma 2).** transformers' SDPA path leaves `attn_logit_softcapping` out of the "
    "exported graph, so neither the HF model as exported nor the megakernel applies it (final logit soft-capping "
    "is baked); eager-attention Gemma 2 is refused (eager attention).",
    "**Qwen3.5 / Qwen3-Next (hybrid).** Three of every four layers are Gated DeltaNet linear attention with a "
    "per-sequence recurrent state [heads, d_k, d_v] and a short causal convolution state beside the KV cache: a "
    "decode step updates the state with a rank-1 delta rule (gated decay, beta) and reads it with the query. In "
    "the megakernel that is a new stage kind (a per-head state update + readout, parallel over heads and d_v "
    "columns), two new state buffers in the plan, and the capture of `linear_attention` cache layers; the full "
    "attention layers are today's. Refused at capture, naming the layer types.",
    "**GPT-NeoX-style models.** LayerNorm (mean-centred, with bias), parallel attention + MLP residual, partial "
    "rotary and an ungated GELU MLP: each a new stage or staging kind.",
)


def get_families(keys: str | Iterable[str] | None = None, families: Iterable[Family] | None = None
                 ) -> tuple[Family, ...]:
    """``keys`` (comma-separated or a list; None or "all" = every family) picked from ``families``."""
    families = tuple(FAMILIES if families is None else families)
    if keys is None or keys == "all":
        return families
    wanted = [k.strip() for k in (keys.split(",") if isinstance(keys, str) else keys) if k.strip()]
    by_key = {f.key: f for f in families}
    unknown = [k for k in wanted if k not in by_key]
    if unknown:
        from megabake.errors import InputError

        raise InputError(f"unknown family {', '.join(map(repr, unknown))}; families are: {', '.join(by_key)}")
    return tuple(by_key[k] for k in wanted)


# ----------------------------------------------------------------------------------------------------- rows


@dataclass
class ModelRow:
    """One row of the table. ``source``: ``package`` (a preset's report), ``none`` (a preset without a package)
    or ``cpu-try`` (a family's tiny config compiled on the CPU)."""

    family: str
    family_key: str
    architecture: str
    preset: str | None
    source: str
    status: str
    label: str  # the status as shown ("verified on NVIDIA H200", "refused", ...)
    details: str  # numbers, the refusal, or why not verified: plain text
    bucket: str  # b<batch>-c<capacity>
    evidence: str  # what the row rests on, as text ("report.json", "CPU try: hidden 256, ...")
    report: str | None = None  # href of the report.json, relative to the table's folder
    gpu: str | None = None
    megabake_ms: float | None = None
    baseline_ms: float | None = None
    baseline: str | None = None
    baseline_graphed: bool | None = None
    measure: str | None = None
    speedup: float | None = None
    speedup_ci: list[float] | None = None
    error_class: str | None = None
    error: str | None = None  # first sentence of the error message

    @property
    def key(self) -> tuple[str, str]:
        """("preset", name) for a preset's row, ("family", key) for a family's CPU try."""
        return ("preset", self.preset) if self.preset else ("family", self.family_key)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ModelRow":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z`'\"(\[])")
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")


def first_sentence(message: str) -> str:
    """The first sentence of an error message, on one line, without memory addresses (for a stable table)."""
    text = _ADDRESS.sub("0x…", " ".join(str(message).split()))
    return _SENTENCE_END.split(text, maxsplit=1)[0]


@contextlib.contextmanager
def _quiet():
    """Silence warnings and transformers' logging while a tiny config is built and compiled."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers is a dependency
        hf_logging = None
    level = hf_logging.get_verbosity() if hf_logging else None
    # the table states the default behaviour: an opt-in to unverified layouts in this shell does not count
    opt_in = os.environ.pop("MEGABAKE_EXPERIMENTAL_LAYOUTS", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if hf_logging:
            hf_logging.set_verbosity_error()
        try:
            yield
        finally:
            if hf_logging:
                hf_logging.set_verbosity(level)
            if opt_in is not None:
                os.environ["MEGABAKE_EXPERIMENTAL_LAYOUTS"] = opt_in


def _no_package_yet(preset: Preset) -> str:
    if preset.experimental:
        return (f"no package of this preset yet: `MEGABAKE_EXPERIMENTAL_LAYOUTS={preset.experimental} megabake bake "
                f"--model {preset.name}` bakes one (its kernel has not run on a GPU yet)")
    return f"no package of this preset yet: `megabake bake --model {preset.name}` bakes one"


def try_family(family: Family) -> ModelRow:
    """Build ``family``'s tiny config (seeded random weights) and compile one decode step on the CPU."""
    from megabake.compiler import compile_step

    bucket = f"b{family.batch}-c{family.capacity}"
    row = ModelRow(family=family.name, family_key=family.key, architecture=family.architecture, preset=None,
                   source="cpu-try", status="bakes-cpu", label="bakes (CPU)", details="", bucket=bucket,
                   evidence=f"CPU try: {family.describe()}")
    try:
        with _quiet():
            model = family.tiny_preset().build_model()
            compile_step(model, batch=family.batch, capacity=family.capacity)
    except MegaBakeError as exc:
        row.status, row.label = "refused", "refused"
        row.error_class, row.error = type(exc).__name__, first_sentence(str(exc))
        row.details = f"{row.error_class}: {row.error}"
    except Exception as exc:  # noqa: BLE001 - a crash is reported as such, not hidden
        row.status, row.label = "error", "crashed"
        row.error_class, row.error = type(exc).__name__, first_sentence(str(exc))
        row.details = f"{row.error_class} (not a MegaBake refusal): {row.error}"
    else:
        row.details = (f"capture → IR → plan → module.py succeed on the CPU at batch {family.batch} · "
                       f"KV {family.capacity}; not run on a GPU")
    return row


def family_rows(families: Iterable[Family] = FAMILIES,
                progress: Callable[[ModelRow], None] = lambda row: None) -> list[ModelRow]:
    rows = []
    for family in families:
        rows.append(try_family(family))
        progress(rows[-1])
    return rows


def _family_of(preset: Preset, families: tuple[Family, ...]) -> tuple[str, str]:
    for family in families:
        if family.claims is not None and family.claims(preset):
            return family.key, family.name
    for family in families:
        if family.claims is None and family.architecture == preset.architecture:
            return family.key, family.name
    name = preset.architecture.removesuffix("ForCausalLM") or preset.architecture
    return name.lower(), name


def _href(target: Path, table_dir: Path) -> str:
    from urllib.parse import quote

    return quote(Path(os.path.relpath(target.resolve(), Path(table_dir).resolve())).as_posix())


def _preset_of(package) -> str | None:
    model = package.report.get("model") or {}
    if model.get("preset"):
        return model["preset"]
    for preset in PRESETS.values():  # reports written before the preset field existed
        if model.get("weights") == "random" and model.get("id") == preset.model_id:
            return preset.name
    return None


def _ms(value: float) -> str:
    from megabake.registry.leaderboard import _ms as leaderboard_ms

    return leaderboard_ms(value)


def _package_row(preset: Preset, package, family: tuple[str, str], table_dir: Path) -> ModelRow:
    from megabake.package.registry import registry_entry
    from megabake.registry.leaderboard import row_for

    report = package.report
    entry = registry_entry(package)
    lb = row_for(package, entry, table_dir)  # the leaderboard's reading of the report: same numbers, same rules
    gpu = lb.gpu_name or ((report.get("environment") or {}).get("gpu_class")) or None
    row = ModelRow(family=family[1], family_key=family[0], architecture=report["model"]["architecture"],
                   preset=preset.name, source="package", status="bakes-cpu", label="baked, not verified on a GPU",
                   details="", bucket=f"b{lb.batch}-c{lb.capacity}", evidence="report.json",
                   report=_href(package.path / "report.json", table_dir), gpu=gpu)
    if lb.verified:
        row.status, row.label = "verified", f"verified on {gpu or lb.gpu_class}"
        row.megabake_ms, row.baseline_ms, row.speedup = lb.megabake_ms, lb.baseline_ms, lb.speedup
        row.baseline, row.baseline_graphed, row.measure = lb.baseline, lb.baseline_graphed, lb.measure
        row.speedup_ci = list(lb.speedup_ci) if lb.speedup_ci else None
        base = "graphed Inductor" if lb.baseline_graphed else f"{lb.baseline} (not CUDA-graphed)"
        ci = f" (95% CI {lb.speedup_ci[0]:.2f}–{lb.speedup_ci[1]:.2f}×)" if lb.speedup_ci else ""
        row.details = (f"{_ms(lb.megabake_ms)} ms/token vs {_ms(lb.baseline_ms)} ms/token {base}: "
                       f"{lb.speedup:.2f}×{ci}; {MEASURE_SHORT.get(lb.measure, lb.measure)}, "
                       f"batch {lb.batch} · KV {lb.capacity}{_timed_position(report)}")
    elif report["status"] in ("failed", "fallback"):
        row.status = "failed"
        row.label = f"{report['status']} on {gpu}" if gpu else report["status"]
        row.details = lb.reason or ""
    else:
        row.details = lb.reason or ""
    if report["model"].get("config_hash") != preset.config_hash():
        row.details += " (this report was baked from an older config of the preset: re-bake it)"
    return row


def _timed_position(report: dict) -> str:
    """' · from position P' when the report says where its timed calls started (reports since session 11)."""
    prefill = ((report.get("timings") or {}).get("method") or {}).get("prefill")
    return f" · from position {prefill}" if prefill is not None else ""


def preset_rows(packages_root: str | Path, table_dir: str | Path, families: Iterable[Family] = FAMILIES,
                presets: dict[str, Preset] | None = None, packages: Iterable | None = None) -> list[ModelRow]:
    """One row per preset, from the newest report (by created_at, then path) of its packages, batch-1 packages first
    (a row's "ms/token" is one sequence's; a batched package's step serves several)."""
    from megabake.package import find_packages, read_package

    families = tuple(families)
    presets = PRESETS if presets is None else presets
    if packages is None:
        root = Path(packages_root)
        packages = [read_package(p) for p in find_packages(root)] if root.is_dir() else []
    newest: dict[str, Any] = {}
    for package in packages:
        name = _preset_of(package)
        if name not in presets:
            continue
        key = ((package.report.get("bucket") or {}).get("batch", 1) == 1, package.report.get("created_at") or "",
               package.repo_path)
        if name not in newest or key > newest[name][0]:
            newest[name] = (key, package)
    rows = []
    for name in sorted(presets):
        preset = presets[name]
        family = _family_of(preset, families)
        if name in newest:
            rows.append(_package_row(preset, newest[name][1], family, Path(table_dir)))
        else:
            rows.append(ModelRow(family=family[1], family_key=family[0], architecture=preset.architecture,
                                 preset=name, source="none", status="no-package", label="no package",
                                 details=_no_package_yet(preset),
                                 bucket="", evidence=""))
    return rows


def order_rows(rows: Iterable[ModelRow], families: Iterable[Family] = FAMILIES) -> list[ModelRow]:
    """Families in list order (presets by name, then the CPU try), then unclaimed groups by class."""
    position = {f.key: i for i, f in enumerate(families)}
    source_rank = {"package": 0, "none": 0, "cpu-try": 1}
    return sorted(rows, key=lambda r: (position.get(r.family_key, len(position)), r.family_key,
                                       source_rank.get(r.source, 2), r.preset or ""))


def model_rows(packages_root: str | Path = "packages", table_dir: str | Path = "docs",
               families: Iterable[Family] = FAMILIES, presets: dict[str, Preset] | None = None,
               progress: Callable[[ModelRow], None] = lambda row: None) -> list[ModelRow]:
    """Every row of the table (module doc): presets from their reports, families from a CPU try."""
    families = tuple(families)
    rows = preset_rows(packages_root, table_dir, families, presets)
    rows += family_rows(families, progress)
    return order_rows(rows, families)


# -------------------------------------------------------------------------------------------------- render


def _md(text: Any) -> str:
    """Plain text inside a Markdown table cell (pipes, HTML and emphasis markers escaped; code spans kept)."""
    text = " ".join(str(text).split())
    text = text.replace("\\", "\\\\").replace("|", "\\|").replace("*", "\\*")
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _md_status(row: ModelRow) -> str:
    return f"**{_md(row.label)}**" if row.status == "verified" else _md(row.label)


def family_summary(rows: list[ModelRow]) -> dict[str, list[str]]:
    """Family name -> ``verified`` / ``bakes-cpu`` / ``refused`` ... by the best row of each family."""
    rank = ["verified", "bakes-cpu", "failed", "no-package", "refused", "error"]
    best: dict[str, str] = {}
    for row in rows:
        if row.family not in best or rank.index(row.status) < rank.index(best[row.family]):
            best[row.family] = row.status
    out: dict[str, list[str]] = {}
    for family, status in best.items():
        out.setdefault(status, []).append(family)
    return out


def render_markdown(rows: list[ModelRow], packages: str = "packages/") -> str:
    summary = family_summary(rows)
    lines = [
        "# Model architectures: what MegaBake bakes today",
        "",
        "<!-- GENERATED by `megabake registry models`: do not edit by hand. Regenerate with "
        "`megabake registry models`; `megabake registry models --check` fails when this file is stale. -->",
        "",
        "Generated from the built-in presets (`megabake/presets.py`) with the newest report of each preset's "
        f"packages under `{packages}`, and from the family list in `megabake/registry/models.py`, whose tiny "
        "configs (2 layers, random weights) are compiled on the CPU through the bake's own chain "
        "(capture → IR → plan → module.py). Nothing here is written by hand: a status changes when the compiler "
        "or a report does.",
        "",
    ]
    for status, text in (("verified", "Verified on a GPU"), ("bakes-cpu", "Bakes on the CPU, not yet verified"),
                         ("failed", "Failed GPU verification"), ("refused", "Refused"),
                         ("error", "Crashed"), ("no-package", "Preset not baked yet")):
        if summary.get(status):
            lines.append(f"* **{text}:** {', '.join(_md(f) for f in summary[status])}")
    lines += [
        "",
        "| Family | HF class | Preset | Status | Details | Evidence |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        preset = f"`{row.preset}`" if row.preset else "tiny config"
        evidence = f"[report.json]({row.report})" if row.report else _md(row.evidence)
        lines.append(f"| {_md(row.family)} | `{row.architecture}` | {preset} | {_md_status(row)} | "
                     f"{_md(row.details)} | {evidence} |")
    lines += ["", "Status:", ""]
    lines += [f"* `{status}`: {text}" for status, text in STATUSES.items()]
    lines += ["", "## What the refused families need", ""]
    lines += [f"* {text}" for text in NEXT_STEPS]
    lines += [
        "",
        "Numbers are shown only for a report whose status is `verified`: the median ms/token of the MegaBake "
        "megakernel and of the CUDA-graphed Inductor baseline, with the speedup's 95% CI, exactly as on the "
        "[leaderboard](../registry/leaderboard.html). A refusal is the exception class and the first sentence "
        "of the compiler's message; `megabake bake` prints the whole message (node, HF module, source line).",
        "",
        ROWS_BEGIN,
    ]
    # one JSON object per row; '>' escaped so no message can close the comment
    lines += [json.dumps(row.to_json(), sort_keys=True, ensure_ascii=False).replace(">", "\\u003e")
              for row in rows]
    lines += [ROWS_END, ""]
    return "\n".join(lines)


def write_table(rows: list[ModelRow], path: str | Path, packages: str = "packages/") -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(render_markdown(rows, packages), encoding="utf-8")
    tmp.replace(path)
    return path


def parse_table(text: str, source: str = "docs/MODELS.md") -> list[ModelRow]:
    """The rows recorded in a generated table (see :func:`render_markdown`)."""
    from megabake.errors import InputError

    start = text.find(ROWS_BEGIN)
    end = text.find("\n" + ROWS_END, start + 1) if start >= 0 else -1
    if start < 0 or end < 0:
        raise InputError(f"{source} holds no rows block: it was not generated by `megabake registry models` "
                         "(regenerate it with that command)")
    rows = []
    for line in text[start + len(ROWS_BEGIN):end].splitlines():
        if line.strip():
            try:
                rows.append(ModelRow.from_json(json.loads(line)))
            except (ValueError, TypeError) as exc:
                raise InputError(f"{source}: a row of its rows block is not valid ({exc}); regenerate it with "
                                 "`megabake registry models`") from None
    return rows


def read_table(path: str | Path) -> list[ModelRow]:
    path = Path(path)
    return parse_table(path.read_text(encoding="utf-8"), source=str(path))


def stale_rows(old: list[ModelRow], new: list[ModelRow], ignore: Iterable[str] = ()) -> list[str]:
    """What changed between two sets of rows, one line per row (empty when they agree); ``ignore`` names
    fields not to compare (the leaderboard ignores which family a preset is grouped under)."""
    ignore = set(ignore)
    before, after = {r.key: r for r in old}, {r.key: r for r in new}

    def same(a: ModelRow, b: ModelRow) -> bool:
        return ({k: v for k, v in a.to_json().items() if k not in ignore}
                == {k: v for k, v in b.to_json().items() if k not in ignore})

    out = []
    for key in list(after) + [k for k in before if k not in after]:
        a, b = before.get(key), after.get(key)
        name = f"{(b or a).family} / {key[1]}"
        if a is None:
            out.append(f"{name}: new row ({b.label})")
        elif b is None:
            out.append(f"{name}: row no longer produced")
        elif not same(a, b):
            change = f"{a.label} -> {b.label}" if a.label != b.label else "details changed"
            out.append(f"{name}: {change}")
    return out
