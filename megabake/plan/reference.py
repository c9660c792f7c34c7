"""Reference executor: runs a plan stage by stage, tile by tile, with torch ops on the CPU.

Contract: ``ReferenceExecutor(plan, weights, rope_cos, rope_sin)`` owns the plan's state and workspace
buffers (fp32 math, KV cache in the weights' dtype) and ``step(tokens, position) -> logits [B, V]`` performs
exactly what the generated kernel does: the same stages, the same tile -> (CTA, warp) assignment, the same
indexing into packed weights and the KV cache, and the same fused recomputation (RMSNorm per tile, RoPE and
KV append inside attention). It checks that every tile is owned by exactly one worker and every output row is
written by exactly one tile (on each stage's first run: the plan deals the same tiles at every step), so
partitioning bugs fail here, on a CPU, before any GPU run.

``mma_attention=True`` mirrors a build whose split-KV items of 2-8 query heads run on the tensor cores (the
default since session 33, ``codegen.default_mma_attention``; ``bodies._mma_softmax_chunk``): the query and the
probabilities that meet V are rounded to bf16, over the same 16-key steps and per-warp running maxima as the
kernel (:func:`_mma_partial`). Off (the default here) it is the plan's math in fp32, which the CPU checks
against eager PyTorch hold to fp32 rounding. ``fused_mma=True`` (with it) mirrors a ``fused_o`` build whose fused
steps score whole KV groups on the tensor cores (``FUSED_MMA``: the build ``codegen.FUSED_O_DEFAULT`` makes): a
step whose visible positions fit ``MIN_CHUNK`` is one item per group (``bodies.fused_attention_o``); the O
projection's sums are the plan's (the kernel's per-group partials differ by fp32 order only). ``mma_wide=True``
(with ``mma_attention``) mirrors an ``mma_wide`` build, whose tensor-core items also take heads of 256 dims.
"""

from __future__ import annotations

import dataclasses

import torch

from . import Plan, Stage, WARP
from .attention import MMA_ATT_KEYS, chunk_quantum, mma_attention_fits, split_schedule
from .packing import torch_dtype
from .stages import VectorInput, norm_slot, spec_of


class ReferenceExecutor:
    def __init__(self, plan: Plan, weights: dict[str, torch.Tensor], rope_cos: torch.Tensor,
                 rope_sin: torch.Tensor, *, lm_head: str = "embed", mma_attention: bool = False,
                 fused_mma: bool = False, mma_wide: bool = False, mma_slices: int = 0, dealt_splits: int = 0):
        self.plan = plan
        self.dealt_splits = dealt_splits  # a split_cap build's splits a KV group (module.py's KV_SPLITS; 0: the plan's)
        self.mma_attention = mma_attention
        self.mma_slices = mma_slices  # an mma_schedule build's dealing (module.py's MMA_SLICES; 0: the default's)
        self.mma_wide = mma_wide
        self.fused_mma = fused_mma
        self.w = {k: v.float() for k, v in weights.items()}
        self.cache_dtype = next(v.dtype for k, v in weights.items() if k == "w_qkv")
        self.cos, self.sin = rope_cos.float(), rope_sin.float()
        self.lm_head = "lm_head" if "lm_head" in weights else lm_head
        self.buffers: dict[str, torch.Tensor] = {}
        for buf in plan.buffers:
            if buf.role in ("state", "workspace", "output"):
                dtype = self.cache_dtype if buf.role == "state" else torch_dtype(buf.dtype)
                self.buffers[buf.name] = torch.zeros(buf.shape, dtype=dtype)
        self.tile_owners: dict[str, dict[int, tuple[int, int]]] = {}
        self._rows_checked: set[str] = set()

    # -------------------------------------------------------------------------------------------
    def step(self, tokens: torch.Tensor, position: int) -> torch.Tensor:
        tokens = tokens.reshape(-1).long()
        for stage in self.plan.stages:
            if stage.scope == "layer":
                continue
            if stage.scope == "prologue":
                self._run(stage, None, tokens, position)
        for layer in range(self.plan.dims.layers):
            for stage in self.plan.stages:
                if stage.scope == "layer":
                    self._run(stage, layer, tokens, position)
        for stage in self.plan.stages:
            if stage.scope == "epilogue":
                self._run(stage, None, tokens, position)
        return self.buffers["logits"].clone()

    def _run(self, stage: Stage, layer, tokens, position):
        if spec_of(stage, self.plan).gemv is not None:
            return self._stage_gemv(stage, layer)
        getattr(self, f"_stage_{stage.kind}")(stage, layer, tokens, position)

    # -- work assignment (mirrors the kernel) ------------------------------------------------------
    def _row_tiles(self, stage: Stage):
        """Yield (tile, rows) with tile t owned by warp index t % total_warps (a grid-stride loop); the index is
        ``cta * warps + warp`` (warp-major) or ``warp * ctas + cta`` (``tiling.spread``, CTA-major)."""
        total_warps = self.plan.ctas * self.plan.warps
        tiling = stage.tiling
        if stage.name not in self.tile_owners:
            owners = {}
            for warp in range(total_warps):
                for tile in range(warp, tiling.tiles, total_warps):
                    assert tile not in owners, f"tile {tile} of {stage.name} owned twice"
                    owners[tile] = ((warp % self.plan.ctas, warp // self.plan.ctas) if tiling.spread
                                    else (warp // self.plan.warps, warp % self.plan.warps))
            assert len(owners) == tiling.tiles, f"{stage.name}: {tiling.tiles - len(owners)} tiles have no owner"
            self.tile_owners[stage.name] = owners
        for tile in range(tiling.tiles):
            first = tile * tiling.per_tile
            yield tile, range(first, min(first + tiling.per_tile, tiling.units))

    def _gemv(self, stage: Stage, weight: torch.Tensor, vec: torch.Tensor, out: torch.Tensor, accumulate: bool,
              layer: int | None = None):
        product = vec @ weight.T  # [B, rows]; each tile's rows are taken from it exactly once
        bias = self.plan.bias_of(stage.name)
        if bias:
            product = product + self.w[bias][layer]
        self._check_rows_written_once(stage, out.shape[1])
        if accumulate:
            out += product
        else:
            out.copy_(product)

    def _check_rows_written_once(self, stage: Stage, width: int) -> None:
        """Every output row of ``stage`` in exactly one tile of exactly one worker: checked on the stage's first run
        (the plan deals the same tiles at every step and layer), so a step writes whole rows at once (tile by tile
        in Python, SmolLM2-135M's reference step took 2 s on a CPU)."""
        if stage.name in self._rows_checked:
            return
        written = torch.zeros(width, dtype=torch.int32)
        for _, rows in self._row_tiles(stage):
            written[rows.start:rows.stop] += 1
        assert bool((written == 1).all()), f"{stage.name}: some output rows written {int(written.max())}x or never"
        self._rows_checked.add(stage.name)

    def _gated_gemv(self, stage: Stage, weight: torch.Tensor, vec: torch.Tensor, out: torch.Tensor, layer: int):
        """A gated GEMV (``Gemv.gated``): its packed rows alternate blocks of gate and up rows (the packed weight's
        ``interleave``: 4 on the tensor cores, 1 on the plain tiling); it writes act(gate) * up into the first half
        of ``out`` (every tile's rows written once, checked by ``_gemv``)."""
        rows = torch.zeros_like(out)
        self._gemv(stage, weight, vec, rows, False, layer=layer)
        block = next(p.interleave for p in self.plan.packed if p.buffer == spec_of(stage, self.plan).gemv.weight)
        blocks = rows.view(rows.shape[0], -1, 2, block)
        gate, up = blocks[:, :, 0].reshape(rows.shape[0], -1), blocks[:, :, 1].reshape(rows.shape[0], -1)
        out[:, :gate.shape[1]] = _ACTIVATIONS[self.plan.dims.act](gate) * up

    def _rmsnorm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        inv = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.plan.dims.eps)
        return x * inv * weight

    # -- stages -------------------------------------------------------------------------------------
    def _stage_embed(self, stage, layer, tokens, position):
        vocab = self.plan.dims.vocab
        if int(tokens.max()) >= vocab or int(tokens.min()) < 0:
            raise IndexError(f"token id out of range [0, {vocab})")
        target, *pending = spec_of(stage, self.plan).writes  # post-norm layouts: x_mid, and down_out zeroed
        for name in pending:
            self.buffers[name].zero_()
        flat = self.buffers[target].view(-1)
        hidden = self.plan.dims.hidden
        for tile in range(stage.tiling.tiles):
            first = tile * stage.tiling.per_tile
            for i in range(first, min(first + stage.tiling.per_tile, stage.tiling.units)):
                b, h = divmod(i, hidden)
                flat[i] = self.w["embed"][tokens[b], h] * self.plan.dims.embed_scale

    def _vector(self, vector: VectorInput, layer: int | None) -> torch.Tensor:
        """A GEMV stage's input rows, as the kernel computes them before staging them in shared memory."""
        source = self.buffers[vector.source]
        if vector.kind in ("rmsnorm", "residual_norm"):
            if vector.kind == "residual_norm":
                source = self._residual(vector, layer)
                if not vector.norm_role:  # post-norm layout (OLMo-2): the projections read the residual itself
                    return source.clone()
            weight = (self.w["final_norm"] if vector.norm_role == "final_norm"
                      else self.w["norms"][layer, norm_slot(vector.norm_role, self.plan)])
            return self._rmsnorm(source, weight)
        if vector.kind == "copy":  # the first ``width`` columns (a gated GEMV's act(gate) * up: half of gate_up)
            return source[:, :getattr(self.plan.dims, vector.width)].clone()
        inter = self.plan.dims.intermediate
        return _ACTIVATIONS[self.plan.dims.act](source[:, :inter]) * source[:, inter:]

    def _residual(self, vector: VectorInput, layer: int | None) -> torch.Tensor:
        """source + rmsnorm(delta) by the post-norm weight of the same, previous (clamped at 0: delta is zero
        there) or last layer; stored into ``write_back`` when the layout keeps it."""
        index = {"same": layer, "previous": max((layer or 0) - 1, 0), "last": self.plan.dims.layers - 1}
        post = self.w["norms"][index[vector.delta_layer], norm_slot(vector.delta_norm_role, self.plan)]
        residual = self.buffers[vector.source] + self._rmsnorm(self.buffers[vector.delta], post)
        if vector.write_back:
            self.buffers[vector.write_back].copy_(residual)
        return residual

    def _stage_gemv(self, stage: Stage, layer: int | None):
        spec = spec_of(stage, self.plan)
        gemv = spec.gemv
        weight = self.w[self.lm_head if gemv.weight == "lm_head" else gemv.weight]
        weight = weight[layer] if spec.per_layer else weight
        vector = self._vector(spec.vector, layer)
        if self.plan.staging_dtype == "bfloat16":  # the kernel stages the rows in bf16 (rounded to nearest even)
            vector = vector.to(torch.bfloat16).float()
        if gemv.gated:
            self._gated_gemv(stage, weight, vector, self.buffers[gemv.out], layer)
        else:
            self._gemv(stage, weight, vector, self.buffers[gemv.out], gemv.accumulate, layer=layer)
        cap = self.plan.dims.final_softcap
        if spec.scope == "epilogue" and cap:
            self.buffers[gemv.out].copy_(cap * torch.tanh(self.buffers[gemv.out] / cap))

    def _stage_attention(self, stage, layer, tokens, position):
        if not 0 <= position < self.plan.capacity:
            raise IndexError(f"position {position} outside the KV capacity {self.plan.capacity}")
        if stage.tiling.kind == "kv_splits":
            return self._split_kv_attention(stage, layer, position)
        d = self.plan.dims
        qkv, attn = self.buffers["qkv"], self.buffers["attn"]
        kc, vc = self.buffers["k_cache"][layer], self.buffers["v_cache"][layer]
        group = d.n_heads // d.n_kv_heads
        cos, sin = self._rope_rows(layer, position)
        owners = {}
        for tile in range(stage.tiling.tiles):
            cta = tile % self.plan.ctas
            owners[tile] = (cta, 0)
            b, head = divmod(tile, d.n_heads)
            kv_head = head // group
            k_off = d.q_rows + kv_head * d.head_dim
            v_off = d.q_rows + d.kv_rows + kv_head * d.head_dim
            q_raw = qkv[b, head * d.head_dim:(head + 1) * d.head_dim]
            k_raw = qkv[b, k_off:k_off + d.head_dim]
            if self.plan.has_head_norms:  # Qwen3: RMSNorm over each head's q and k, then RoPE
                q_raw = self._head_norm(q_raw, layer, b, 0, head * d.head_dim)
                k_raw = self._head_norm(k_raw, layer, b, 1, k_off)
            q = _rope(q_raw, cos, sin, d.rotated)
            k_new = _rope(k_raw, cos, sin, d.rotated).to(self.cache_dtype)
            v_new = qkv[b, v_off:v_off + d.head_dim].to(self.cache_dtype)
            # every CTA of a KV group writes the same bytes into slot `position` (as the kernel does)
            kc[b, kv_head, position] = k_new
            vc[b, kv_head, position] = v_new
            keys = torch.cat([kc[b, kv_head, :position].float(), k_new.float()[None]])
            values = torch.cat([vc[b, kv_head, :position].float(), v_new.float()[None]])
            scores = (keys @ q) * d.attn_scale
            probs = torch.softmax(scores, dim=0)
            attn[b, head * d.head_dim:(head + 1) * d.head_dim] = probs @ values
        self.tile_owners[stage.name] = owners


    def _head_norm(self, x: torch.Tensor, layer: int, b: int, which: int, offset: int) -> torch.Tensor:
        """q (which 0) or k (1) of one head at ``offset`` in the qkv row, RMS-normalised per head (Qwen3) or over
        the whole q or k projection (OLMo-2: that RMS, the weights at the same offset)."""
        d = self.plan.dims
        if not d.whole_qk_norm:
            return self._rmsnorm(x, self.w["qk_norms"][layer, which])
        qkv = self.buffers["qkv"][b]
        whole = qkv[:d.q_rows] if which == 0 else qkv[d.q_rows:d.q_rows + d.kv_rows]
        inv = torch.rsqrt(whole.pow(2).mean() + d.eps)
        return x * inv * self.w["qk_norms"][layer, offset:offset + d.head_dim]

    def _rope_rows(self, layer, position):
        """cos, sin of ``position`` in the rotary table ``layer`` uses."""
        if self.cos.ndim == 3:  # several tables (Gemma 3): the layer's own
            table = self.plan.layers[layer].rope_table
            return self.cos[table, position], self.sin[table, position]
        return self.cos[position], self.sin[position]

    def _roped_group(self, layer, b, kvh, position):
        """The group's roped queries [G, D] (scaled by attn_scale, as the kernel folds it) and the new k, v."""
        d, qkv = self.plan.dims, self.buffers["qkv"]
        group = d.n_heads // d.n_kv_heads
        cos, sin = self._rope_rows(layer, position)
        queries = []
        for h in range(group):
            q = qkv[b, (kvh * group + h) * d.head_dim:(kvh * group + h + 1) * d.head_dim]
            if self.plan.has_head_norms:
                q = self._head_norm(q, layer, b, 0, (kvh * group + h) * d.head_dim)
            queries.append(_rope(q, cos, sin, d.rotated) * d.attn_scale)
        k_off, v_off = d.q_rows + kvh * d.head_dim, d.q_rows + d.kv_rows + kvh * d.head_dim
        k = qkv[b, k_off:k_off + d.head_dim]
        if self.plan.has_head_norms:
            k = self._head_norm(k, layer, b, 1, k_off)
        return torch.stack(queries), _rope(k, cos, sin, d.rotated), qkv[b, v_off:v_off + d.head_dim]

    def _split_kv_attention(self, stage, layer, position):
        """Mirror of ``bodies.split_kv_attention``: (split, batch, KV head, head slice) items over CTAs, each a
        partial softmax (max, sum, accumulator) over its chunk for the query heads of its slice of the group (all
        of them where ``split_schedule`` deals one slice), merged exactly per (group, slice). The chunks cover the
        visible keys: [0, position], or the layer's sliding window (position - window, position]."""
        d, plan = self.plan.dims, self.plan
        groups, splits = stage.tiling.units, stage.tiling.tiles // stage.tiling.units
        group = d.n_heads // d.n_kv_heads
        n = position + 1
        first_key = max(n - plan.attn_window_table()[layer], 0) if plan.has_windows else 0  # sliding window
        dealt = split_schedule(stage.tiling, n - first_key, quantum=chunk_quantum(plan), mma_slices=self.mma_slices,
                               splits=self.dealt_splits or None)
        if self.fused_mma and n - first_key <= stage.tiling.per_tile:  # bodies.fused_o_step: whole groups
            dealt = dataclasses.replace(dealt, active=1, slices=1)
        chunk, active, slices = dealt.chunk, dealt.active, dealt.slices
        heads = group // slices
        owners, partials, roped = {}, {}, {}
        for item in range(groups * splits):
            split, virtual = divmod(item, groups * slices)
            owners[item] = (item % plan.ctas, 0)
            if split >= active:
                continue
            g, slice_ = divmod(virtual, slices)
            b, kvh = divmod(g, d.n_kv_heads)
            start = first_key + split * chunk
            end = min(start + chunk, n)
            if (b, kvh) not in roped:  # the same for every split and slice of the group: rope it once
                roped[(b, kvh)] = self._roped_group(layer, b, kvh, position)
            queries, k_new, v_new = roped[(b, kvh)]
            queries = queries[slice_ * heads:(slice_ + 1) * heads]
            kc, vc = self.buffers["k_cache"][layer, b, kvh], self.buffers["v_cache"][layer, b, kvh]
            if end == n:  # every slice of the split holding `position` appends this step's key and value
                kc[position], vc[position] = k_new.to(self.cache_dtype), v_new.to(self.cache_dtype)
            if self.mma_attention and mma_attention_fits(heads, d.head_dim, self.mma_wide):
                partials[(virtual, split)] = _mma_partial(queries, kc[start:end], vc[start:end], plan.warps)
                continue
            scores = queries @ kc[start:end].float().T  # [heads, chunk]
            top = scores.max(dim=1).values
            weights = torch.exp(scores - top[:, None])
            partials[(virtual, split)] = (top, weights.sum(dim=1), weights @ vc[start:end].float())
        attn = self.buffers["attn"]
        for virtual in range(groups * slices):
            g, slice_ = divmod(virtual, slices)
            b, kvh = divmod(g, d.n_kv_heads)
            parts = [partials[(virtual, s)] for s in range(active)]
            top = torch.stack([p[0] for p in parts]).max(dim=0).values
            scale = [torch.exp(p[0] - top) for p in parts]
            total = sum(p[1] * c for p, c in zip(parts, scale))
            out = sum(p[2] * c[:, None] for p, c in zip(parts, scale)) / total[:, None]
            first = (kvh * group + slice_ * heads) * d.head_dim
            attn[b, first:first + heads * d.head_dim] = out.reshape(-1)
        self.tile_owners[stage.name] = owners


_ACTIVATIONS = {  # the model's activation in act(gate) * up (megabake.plan.stages.ACTIVATIONS)
    "silu": torch.nn.functional.silu,
    "gelu_tanh": lambda g: torch.nn.functional.gelu(g, approximate="tanh"),
    "gelu": torch.nn.functional.gelu,
}


def _mma_partial(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, warps: int,
                 rounded: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One tensor-core item's partial softmax (max [H], sum [H], accumulator [H, D]) over its chunk's keys [L, D]
    and values, as ``bodies._mma_softmax_chunk`` computes it: the queries [H, D] (scaled) rounded to bf16; warp
    ``w`` takes the 16-key steps w, w + warps, ...; per head it keeps a running max over its steps, sums the fp32
    probabilities exp(score - running max) and feeds them, rounded to bf16, to P.V, rescaling what it holds when
    the max rises; the warps' partials then merge as the kernel's do. ``rounded=False`` leaves out both roundings
    (then this is the plain softmax partial, up to fp32 summation order: a CPU test holds it to that)."""
    as_mma = (lambda x: x.to(torch.bfloat16).float()) if rounded else (lambda x: x)
    keys_total, head_dim = keys.shape
    steps = -(-keys_total // MMA_ATT_KEYS)
    rounds = -(-steps // warps)
    padded = rounds * warps * MMA_ATT_KEYS
    scores = torch.full((queries.shape[0], padded), float("-inf"))
    scores[:, :keys_total] = as_mma(queries) @ keys.float().T
    scores = scores.view(-1, rounds, warps, MMA_ATT_KEYS)  # step s = round x warps + warp
    running = torch.cummax(scores.amax(dim=3), dim=1).values  # [H, rounds, warps]: each warp's max after a step
    probs = torch.exp(scores - running[..., None]).nan_to_num(0.0)  # steps past the chunk: -inf - -inf
    v = torch.zeros(padded, head_dim)
    v[:keys_total] = values.float()
    step_out = torch.einsum("hrwk,rwkd->hrwd", as_mma(probs), v.view(rounds, warps, MMA_ATT_KEYS, head_dim))
    last = running[:, -1:, :]  # [H, 1, warps]: a warp's max after its last step (-inf: it had none)
    rescale = torch.exp(running - last).nan_to_num(0.0)
    warp_top = last[:, 0, :]
    warp_sum = (probs.sum(dim=3) * rescale).sum(dim=1)
    warp_acc = (step_out * rescale[..., None]).sum(dim=1)
    top = warp_top.max(dim=1).values
    weight = torch.exp(warp_top - top[:, None])  # 0 for warps without steps
    return top, (warp_sum * weight).sum(dim=1), (warp_acc * weight[..., None]).sum(dim=1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotated: int) -> torch.Tensor:
    """As the kernel: feature d pairs with d +- rotated / 2; past ``rotated`` (partial rotary) the table holds
    cos 1, sin 0, so those features pass unchanged."""
    half = rotated // 2
    partners = torch.cat([-x[half:2 * half], x[:x.shape[-1] - half]])
    return x * cos + partners * sin


def reference_executor_from_buffers(plan: Plan, buffers: dict[str, torch.Tensor], *,
                                    mma_attention: bool = False, fused_mma: bool = False,
                                    mma_wide: bool = False, mma_slices: int = 0,
                                    dealt_splits: int = 0) -> ReferenceExecutor:
    """A reference executor on a decoder's own packed weights and rotary tables (``buffers`` as a
    ``MegakernelDecoder`` holds them, on any device; copied to the CPU): what a GPU check compares the kernel
    with, the same bf16 weights in fp32 math; ``mma_attention``, ``fused_mma``, ``mma_wide`` and ``mma_slices``:
    the decoder's (``MegakernelDecoder.mma_attention`` / ``.fused_mma`` / ``.mma_wide`` / ``.mma_slices``), so its
    dealing and its tensor-core items' bf16 rounding are mirrored; ``dealt_splits``: a ``split_cap`` build's
    (``MegakernelDecoder.dealt_splits``)."""
    weights = {spec.buffer: buffers[spec.buffer].cpu() for spec in plan.packed}
    return ReferenceExecutor(plan, weights, buffers["rope_cos"].cpu(), buffers["rope_sin"].cpu(),
                             mma_attention=mma_attention, fused_mma=fused_mma, mma_wide=mma_wide,
                             mma_slices=mma_slices, dealt_splits=dealt_splits)


def reference_executor_for(plan: Plan, model, *, dtype=torch.float32) -> ReferenceExecutor:
    """Build a reference executor bound to an HF model's parameters (packed in ``dtype``)."""
    from .packing import pack_weights, plan_inv_freqs, rotary_tables

    weights = pack_weights(plan, model.get_parameter, dtype=dtype)
    cos, sin = rotary_tables(plan, plan_inv_freqs(plan, model))
    return ReferenceExecutor(plan, weights, cos, sin)


__all__ = ["ReferenceExecutor", "reference_executor_for", "reference_executor_from_buffers", "WARP"]
