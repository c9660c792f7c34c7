"""Long contexts on the H200: real-weights numerics after long prompts, and step time by position.

Usage (on the H200, after ``source .cute/activate.sh``):

    python3 scripts/gpu_long_context.py real GGUF --out DIR     # issue 11/13 table: SmolLM2-135M-Instruct
    python3 scripts/gpu_long_context.py sweep PRESET... --out DIR [--baseline]

``real``: a capacity-2048 bucket of the GGUF's model; after prefills of 128, 1024, 1900 and 2040 tokens
(random token ids, teacher-forced), worst and median rel-L2 to fp32 and top-1 vs fp32 of the megakernel and of
eager bf16 over 30 steps (or all that fit); then greedy answers to chat prompts: the megakernel's, HF fp32's and
HF bf16's tokens, common-prefix lengths, and teacher-forced top-1 agreement with fp32 along fp32's answer.

``sweep``: GPU time per step (CUDA events over graph replays, median of 5 x 50) at positions 16, 1000, 2000,
4000 of a capacity-4096 bucket with a random KV cache, for split-KV attention and the unsplit kind; with
``--baseline`` also the hand-captured ``inductor-graph`` step at the same positions. Prints a table last and
writes ``DIR/*.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PREFILLS = (128, 1024, 1900, 2040)
POSITIONS = (16, 1000, 2000, 4000)


def real(gguf: Path, out: Path) -> None:
    from megabake.runtime import MegakernelDecoder, gpu_info
    from megabake.verification import run_numerics
    from tests.compiler_fixtures import compile_model
    from tests.real_weights import CHAT_PROMPTS, _fp32_model_and_tokenizer, chat_ids

    model, tokenizer = _fp32_model_and_tokenizer(str(gguf))
    compiled = compile_model(copy.deepcopy(model), capacity=2048, ctas=gpu_info().sm_count)
    decoder = MegakernelDecoder(compiled.plan, compiled.generated.source, copy.deepcopy(model), device="cuda")
    rows = []
    for prefill in PREFILLS:
        numerics = run_numerics(decoder, prefill=prefill, steps=min(30, 2048 - prefill), seed=prefill)
        rows.append({"prefill": prefill, "steps": numerics["steps"], "pass": numerics["pass"],
                     "failures": numerics["failures"][:3], **numerics["summary"]})
    chats = _chats(decoder, model, tokenizer, CHAT_PROMPTS, chat_ids)
    (out / "real_weights.json").write_text(json.dumps({"numerics": rows, "chats": chats}, indent=1))
    print("| prefill | steps | pass | worst rel-L2 MB / eager | median rel-L2 MB / eager | top-1 vs fp32 MB / eager |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['prefill']} | {r['steps']} | {r['pass']} | {r['max_rel_l2_vs_fp32']:.4f} / "
              f"{r['max_rel_l2_bf16_vs_fp32']:.4f} | {r['median_rel_l2_vs_fp32']:.4f} / "
              f"{r['median_rel_l2_bf16_vs_fp32']:.4f} | {r['top1_vs_fp32']:.2f} / {r['bf16_top1_vs_fp32']:.2f} |")
    print("| prompt | common prefix MB/fp32 | bf16/fp32 | fp32 tokens | teacher-forced top-1 MB / bf16 | megakernel text |")
    print("|---|---|---|---|---|---|")
    for c in chats:
        print(f"| {c['prompt']} | {c['common_megakernel']} | {c['common_bf16']} | {c['fp32_tokens']} | "
              f"{c['top1_megakernel']:.2f} / {c['top1_bf16']:.2f} | {c['megakernel_text']!r} |")


@torch.no_grad()
def _chats(decoder, model, tokenizer, prompts, chat_ids, new_tokens: int = 32) -> list[dict]:
    from megabake.rope import cast_model

    fp32 = copy.deepcopy(model).cuda().eval()
    bf16 = cast_model(copy.deepcopy(model), device="cuda", dtype=torch.bfloat16).eval()
    eos = tokenizer.eos_token_id
    results = []
    for prompt in prompts:
        ids = chat_ids(tokenizer, prompt)
        length = ids.shape[1]
        ours = decoder.generate(ids, max_new_tokens=new_tokens)[0, length:].tolist()
        ref = fp32.generate(ids.cuda(), max_new_tokens=new_tokens, do_sample=False)[0, length:].tolist()
        half = bf16.generate(ids.cuda(), max_new_tokens=new_tokens, do_sample=False)[0, length:].tolist()
        ours = ours[:ours.index(eos) + 1] if eos in ours else ours
        path = torch.tensor([ids[0].tolist() + ref])  # fp32's answer, teacher-forced
        want = fp32(path.cuda()).logits[0, length - 1:-1].argmax(-1).cpu()
        got_half = bf16(path.cuda()).logits[0, length - 1:-1].argmax(-1).cpu()
        got = [decoder.prefill(ids).argmax(-1).item()]
        for i, token in enumerate(ref[:-1]):
            got.append(decoder.step(torch.tensor([token]), length + i).argmax(-1).item())
        results.append({
            "prompt": prompt, "fp32_tokens": len(ref),
            "common_megakernel": _common(ours, ref), "common_bf16": _common(half, ref),
            "top1_megakernel": float((torch.tensor(got) == want).float().mean()),
            "top1_bf16": float((got_half == want).float().mean()),
            "megakernel_text": tokenizer.decode(ours), "fp32_text": tokenizer.decode(ref),
        })
    return results


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@dataclasses.dataclass(frozen=True)
class Kind:
    """One kernel variant of a sweep: split-KV or not, an extra GEMV tiling, other device bodies (e.g. an earlier
    tree's ``megabake/codegen/bodies``, to time a body change side by side), another split-KV minimum chunk."""
    label: str
    split: bool = True
    tiling: str | None = None
    bodies: Path | None = None
    min_chunk: int | None = None

    def plan_and_source(self, build):
        """``build()`` -> plan, and its module source, with this variant's bodies and minimum chunk patched in."""
        from unittest import mock

        from megabake import codegen
        from megabake.plan import attention

        with contextlib.ExitStack() as patches:
            if self.bodies:
                patches.enter_context(mock.patch.object(codegen, "BODIES_DIR", self.bodies))
            if self.min_chunk:
                patches.enter_context(mock.patch.object(attention, "SPLIT_KV_MIN_CHUNK", self.min_chunk))
            plan = build()
            return plan, codegen.generate(plan).source


def _kinds(tilings: list[str], unsplit: bool, before: Path | None = None,
           min_chunks: tuple[int, ...] = ()) -> list[Kind]:
    """The default split kernel, one per extra GEMV tiling, the ``before`` bodies, each other minimum chunk, unsplit."""
    kinds = [Kind("split")] + [Kind(f"split+{spec}", tiling=spec) for spec in tilings]
    kinds += [Kind("split-before", bodies=before)] if before else []
    kinds += [Kind(f"split-chunk{n}", min_chunk=n) for n in min_chunks]
    return kinds + ([Kind("unsplit", split=False)] if unsplit else [])


def sweep(presets: list[str], out: Path, baseline: bool, tilings: list[str] = (), unsplit: bool = True,
          batch: int = 1, capacity_limit: int = 4096, wanted: tuple[int, ...] = POSITIONS,
          before: Path | None = None, min_chunks: tuple[int, ...] = ()) -> None:
    from megabake.plan import build_plan
    from megabake.plan.rotary import recover_rotary
    from megabake.plan import GemvTuning
    from megabake.runtime import MegakernelDecoder, gpu_info
    from megabake.runtime.autotune import uniform_tuning
    from tests.compiler_fixtures import compile_preset

    from megabake.presets import get_preset

    table = []
    for name in presets:
        capacity = min(capacity_limit, get_preset(name).config.get("max_position_embeddings", capacity_limit))
        positions = sorted({p for p in wanted if p < capacity - 1} | {min(max(wanted), capacity - 1)})
        compiled = compile_preset(name, batch=batch, capacity=capacity, ctas=gpu_info().sm_count)
        inv_freq, scaling = recover_rotary(compiled.captured, compiled.ir)
        row = {"preset": name, "capacity": capacity, "positions": positions, "batch": batch}
        kinds = _kinds(list(tilings), unsplit, before, min_chunks)
        logits = {}
        for kind in kinds:
            label = kind.label
            tuning = uniform_tuning(GemvTuning.parse(kind.tiling)) if kind.tiling else None
            try:
                plan, source = kind.plan_and_source(lambda: build_plan(
                    compiled.ir, ctas=gpu_info().sm_count, inv_freq_buffer=inv_freq, rotary_scaling=scaling,
                    split_kv=kind.split, tuning=tuning))
            except Exception as exc:  # e.g. a ring that does not fit this bucket's shared memory
                print(f"[{name}] {label}: {type(exc).__name__}: {exc}", flush=True)
                continue
            decoder = MegakernelDecoder(plan, source, copy.deepcopy(compiled.model), device="cuda")
            _random_cache(decoder.buffers["k_cache"], decoder.buffers["v_cache"])
            step, ids = decoder.step, [7] * batch
            logits[label] = {p: step(ids, p).float().cpu() for p in positions}  # before the timing rewrites slot p
            row[label] = {p: _event_ms(lambda p=p: step(ids, p)) for p in positions}
            host = _sync_call_ms(lambda: step(ids, positions[0]))
            row.setdefault("sync_call_ms_at_first_position", {})[label] = host
            row.setdefault("host_ms_of_step_call", {})[label] = _host_ms(lambda: step(ids, positions[0]))
            kv_bytes = decoder.buffers["k_cache"][:, :, :, :1].numel() * 2 * 2  # K and V, one position, bf16
            del decoder
            torch.cuda.empty_cache()
        row["kv_bytes_per_position"] = kv_bytes
        row["max_rel_l2_vs_split"] = {label: max(_rel_l2(got[p], logits["split"][p]) for p in positions)
                                      for label, got in logits.items()}
        print(f"[{name}] logits rel-L2 to the default split kernel, worst position: {row['max_rel_l2_vs_split']}",
              flush=True)
        if baseline:
            row["inductor-graph"] = _baseline_ms(compiled.model, capacity, positions, batch)
        table.append(row)
        (out / f"sweep-{name}.json").write_text(json.dumps(row, indent=1))
    print(f"launch + sync floor (one tiny kernel in a graph): {launch_floor_ms():.4f} ms")
    for row in table:
        print(f"{row['preset']}: host ms inside step() {row.get('host_ms_of_step_call')}")
    print("| preset (capacity) | kind | GPU ms per step at positions | budget at the last position "
          "(pos-16 step + KV read at 3.5 TB/s, +15%) |")
    print("|---|---|---|---|")
    for row in table:
        last = row["positions"][-1]
        budget = (row["split"][16] + row["kv_bytes_per_position"] * last / 3.5e12 * 1e3) * 1.15  # ms
        for kind in [k.label for k in _kinds(list(tilings), unsplit, before, min_chunks)] + ["inductor-graph"]:
            if kind in row:
                cells = ", ".join(f"{p}: {row[kind][p]:.3f}" for p in row["positions"])
                host = row.get("sync_call_ms_at_first_position", {}).get(kind)
                extra = f" (sync call {host:.3f})" if host else ""
                print(f"| {row['preset']} ({row['capacity']}, b{batch}) | {kind} | {cells}{extra} | {budget:.3f} |")


def _rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def _random_cache(*caches) -> None:
    generator = torch.Generator(device="cuda").manual_seed(0)
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, generator=generator, device="cuda", dtype=torch.float32).to(cache.dtype))


def _event_ms(call, inner: int = 50, rounds: int = 5) -> float:
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            call()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / inner)
    return statistics.median(samples)


def _sync_call_ms(call, calls: int = 200) -> float:
    """Median ms of a complete synchronized call (host cost + GPU), as a user's decode loop sees it."""
    import time

    for _ in range(10):
        call()
    torch.cuda.synchronize()
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - started) * 1e3)
    return statistics.median(samples)


def _host_ms(call, calls: int = 200) -> float:
    """Median ms the host spends inside one call (the GPU idle before it, synchronized after it)."""
    import time

    samples = []
    for _ in range(calls):
        torch.cuda.synchronize()
        started = time.perf_counter()
        call()
        samples.append((time.perf_counter() - started) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(samples)


def launch_floor_ms() -> float:
    """Synchronized replay of a graph holding one tiny kernel: this machine's fixed launch + sync cost."""
    x = torch.zeros(8, device="cuda")
    x.add_(1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.add_(1)
    return _sync_call_ms(graph.replay)


@torch.no_grad()
def _baseline_ms(model, capacity: int, positions: list[int], batch: int = 1) -> dict:
    from megabake.rope import cast_model
    from megabake.verification.baselines import build_baseline

    gpu_model = cast_model(copy.deepcopy(model), device="cuda", dtype=torch.bfloat16).eval()
    prompt = torch.randint(1, model.config.vocab_size, (batch, 16), device="cuda")
    step = build_baseline("inductor-graph", gpu_model, prompt, capacity)
    ids = torch.full((batch,), 7, device="cuda")
    return {p: _event_ms(lambda p=p: step.call(ids, torch.tensor([p], device="cuda"))) for p in positions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("real", help="real-weights numerics after long prompts + greedy chat text")
    r.add_argument("gguf", type=Path)
    r.add_argument("--out", type=Path, required=True)
    s = sub.add_parser("sweep", help="GPU ms per step by position, split vs unsplit attention")
    s.add_argument("presets", nargs="+")
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--baseline", action="store_true", help="also time the inductor-graph step")
    s.add_argument("--tilings", nargs="*", default=[], help="extra GEMV tilings to time with split-KV attention "
                   "(e.g. 2x4+spread+preload+ring4)")
    s.add_argument("--no-unsplit", action="store_true", help="skip the unsplit attention kernel")
    s.add_argument("--batch", type=int, default=1)
    s.add_argument("--capacity", type=int, default=4096, help="bucket capacity (capped by the model's limit)")
    s.add_argument("--positions", nargs="+", type=int, default=list(POSITIONS))
    s.add_argument("--before", type=Path, help="also time the kernel built with these device bodies (a copy of an "
                   "earlier tree's megabake/codegen/bodies), labelled split-before")
    s.add_argument("--min-chunks", nargs="*", type=int, default=[], help="also time split-KV attention with these "
                   "minimum positions per split (default %d)" % 128)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.command == "real":
        real(args.gguf, args.out)
    else:
        sweep(args.presets, args.out, args.baseline, args.tilings, not args.no_unsplit, args.batch, args.capacity,
              tuple(args.positions), args.before, tuple(args.min_chunks))


if __name__ == "__main__":
    main()
