"""Does the hand-captured Inductor graph baseline compute the right logits? One case per subprocess (H200).

    source .cute/activate.sh && python3 scripts/gpu_diag_inductor_graph.py smollm-135m [case ...]

Each case builds baselines on the preset's random-weight model and prints rel-L2 of the first call's logits
against eager bf16 at the same state (a correct bf16 implementation lands near 1e-2).

What it found (H200, 2026-11-30, SmolLM, before ``BaselineStep.keep_alive``): the graph alone 0.013; after
any other GPU allocation (an eager step, the reduce-overhead call) 0.37-0.57, stable. The hand-captured
graph's StaticCache had been garbage-collected after capture and reused by the allocator.
"""
import json
import os
import subprocess
import sys
import time

DEVICE = os.environ.get("DIAG_DEVICE", "cuda")
COMPILE_OPTIONS = {"fullgraph": True, "mode": os.environ.get("DIAG_MODE", "max-autotune-no-cudagraphs")}
CASES = ("compiled-no-graph", "graph-alone", "graph-alone-default-mode", "ro-then-graph", "graph-steps",
         "ro-then-graph-detail")


def run_case(preset_name: str, case: str) -> dict:
    import torch

    sys.path.insert(0, ".")
    from megabake.presets import get_preset
    from megabake.verification.baselines import build_baseline, build_order, decode_ids, eager_reference_logits
    from megabake.verification.numerics import rel_l2, teacher_tokens
    from megabake.verification.reference import ReferenceDecoder

    model = get_preset(preset_name).build_model().to(DEVICE, torch.bfloat16).eval()
    ids = teacher_tokens(1, 20, model.config.vocab_size, seed=1).to(DEVICE)
    prompt, token = ids[:, :16], ids[:, 16].contiguous()
    pos = torch.tensor([16], device=DEVICE)
    ref = eager_reference_logits(model, prompt, token, 16, 128)
    out = {"case": case}
    with torch.no_grad():
        if case == "compiled-no-graph":
            runner = ReferenceDecoder(model, capacity=128)
            runner.prefill(prompt)
            compiled = torch.compile(runner.module, **COMPILE_OPTIONS)
            for _ in range(3):
                got = compiled(decode_ids(token), pos)
            out["rel_l2"] = rel_l2(got.float().cpu(), ref.cpu())
        elif case in ("graph-alone", "graph-alone-default-mode", "graph-then-step2"):
            kwargs = {"compile_kwargs": {"fullgraph": True}} if case.endswith("default-mode") else {}
            step = build_baseline("inductor-graph", model, prompt, 128, **kwargs)
            out["rel_l2"] = rel_l2(step.call(token, pos).float().cpu(), ref.cpu())
            if case == "graph-then-step2":  # does position advance? compare step 17 with eager
                tok2 = ids[:, 17].contiguous()
                runner = ReferenceDecoder(model, capacity=128)
                runner.prefill(prompt)
                runner.step(token, 16)
                ref2 = runner.step(tok2, 17)
                got2 = step.call(tok2, torch.tensor([17], device=DEVICE)).float().cpu()
                out["rel_l2_step17"] = rel_l2(got2, ref2.cpu())
        elif case == "graph-steps":  # eager reference decoder made first; positions 16..19 in order
            runner = ReferenceDecoder(model, capacity=128)
            runner.prefill(prompt)
            step = build_baseline("inductor-graph", model, prompt, 128)
            for p in range(16, 20):
                tok = ids[:, p].contiguous()
                want = runner.step(tok, p).cpu()
                got = step.call(tok, torch.tensor([p], device=DEVICE)).float().cpu()
                out[str(p)] = [rel_l2(got, want), bool(torch.isnan(got).any()), bool(torch.isnan(want).any())]
        elif case == "ro-then-graph-detail":  # which call corrupts the hand-captured graph?
            ro = build_baseline("inductor-reduce-overhead", model, prompt, 128)
            graph = build_baseline("inductor-graph", model, prompt, 128)
            out["graph-before-ro-call"] = rel_l2(graph.call(token, pos).float().cpu(), ref.cpu())
            out["ro"] = rel_l2(ro.call(token, pos).float().cpu(), ref.cpu())
            out["graph-after-ro-call"] = rel_l2(graph.call(token, pos).float().cpu(), ref.cpu())
        elif case == "ro-then-graph":
            built = {n: build_baseline(n, model, prompt, 128) for n in build_order(["inductor-reduce-overhead",
                                                                                   "inductor-graph"])}
            for n, step in built.items():
                out[n] = rel_l2(step.call(token, pos).float().cpu(), ref.cpu())
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return out


def main() -> None:
    if sys.argv[1] == "--case":
        print("RESULT " + json.dumps(run_case(sys.argv[2], sys.argv[3])), flush=True)
        return
    preset_name, cases = sys.argv[1], sys.argv[2:] or CASES
    for case in cases:
        start = time.time()
        proc = subprocess.run([sys.executable, __file__, "--case", preset_name, case], capture_output=True,
                              text=True, timeout=300)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        result = lines[-1][7:] if lines else f"rc={proc.returncode} {proc.stderr[-800:]}"
        print(f"{case} ({time.time() - start:.0f} s): {result}", flush=True)


if __name__ == "__main__":
    main()
