"""megabake.generation's timing: ms/token over the whole answer and after the first host round trip.

The first call of a megakernel decoder captures its CUDA graphs (tens of ms), which dominates a short answer's
ms/token; ``Generation.steady_ms_per_token`` leaves that round trip out. Fake decoders with a slow first call
stand in for the GPU (the timing logic is host code)."""

from __future__ import annotations

import time

import torch

from megabake.generation import generate

VOCAB = 11
FIRST_CALL_S = 0.25
LATER_CALL_S = 0.002


class SlowFirstStep:
    """Greedy decoder over a fixed logit table: token t -> t + 1; the first step sleeps FIRST_CALL_S."""

    batch, capacity = 1, 64

    def __init__(self):
        self.calls = 0

    def _logits(self, token: int) -> torch.Tensor:
        return torch.nn.functional.one_hot(torch.tensor([(token + 1) % VOCAB]), VOCAB).float()

    def prefill(self, prompt):
        return self._logits(int(prompt[0, -1]))

    def step(self, token, position):
        self.calls += 1
        time.sleep(FIRST_CALL_S if self.calls == 1 else LATER_CALL_S)
        return self._logits(int(token[0]))


class SlowFirstChunk(SlowFirstStep):
    """Adds ``greedy_tokens`` (n steps per host round trip, as the megakernel's GPU-side greedy loop)."""

    def greedy_tokens(self, token, position, n):
        self.calls += 1
        time.sleep(FIRST_CALL_S if self.calls == 1 else LATER_CALL_S * n)
        first = int(token[0]) + 1
        return torch.tensor([[(first + i) % VOCAB for i in range(n)]])


def test_steady_ms_per_token_leaves_out_the_first_step():
    result = generate(SlowFirstStep(), torch.tensor([[3]]), max_new_tokens=9, eos_token_id=[])
    assert result.new_tokens.tolist() == [[4, 5, 6, 7, 8, 9, 10, 0, 1]]
    assert result.first_round_trip_steps == 1 and len(result.step_times_s) == 8
    assert result.ms_per_token > 1e3 * FIRST_CALL_S / 8  # the overall rate carries the slow first call
    assert result.steady_ms_per_token < 1e3 * FIRST_CALL_S / 8 / 4


def test_steady_ms_per_token_leaves_out_the_first_greedy_chunk():
    result = generate(SlowFirstChunk(), torch.tensor([[3]]), max_new_tokens=20, eos_token_id=[], sync_every=8)
    assert result.new_tokens.tolist()[0] == [(4 + i) % VOCAB for i in range(20)]
    assert result.first_round_trip_steps == 8 and len(result.step_times_s) == 19
    assert result.steady_ms_per_token < 1e3 * FIRST_CALL_S / 19 / 4 < result.ms_per_token


def test_no_steady_rate_without_steps_after_the_first_round_trip():
    one_chunk = generate(SlowFirstChunk(), torch.tensor([[3]]), max_new_tokens=8, eos_token_id=[], sync_every=8)
    assert one_chunk.first_round_trip_steps == 7 and one_chunk.steady_ms_per_token is None
    prefill_only = generate(SlowFirstStep(), torch.tensor([[3]]), max_new_tokens=1, eos_token_id=[])
    assert prefill_only.first_round_trip_steps == 0 and prefill_only.steady_ms_per_token is None
    assert prefill_only.ms_per_token is None


def test_run_reports_both_rates(capsys):
    from megabake.runtime.commands import echo_stats

    echo_stats(generate(SlowFirstStep(), torch.tensor([[3]]), max_new_tokens=9, eos_token_id=[]), "cuda")
    err = capsys.readouterr().err
    assert "tokens/s over 8 decode steps; " in err
    assert "ms/token after the first host round trip (its 1 step includes one-time set-up" in err
    echo_stats(generate(SlowFirstStep(), torch.tensor([[3]]), max_new_tokens=2, eos_token_id=[]), "cuda")
    assert "after the first host round trip" not in capsys.readouterr().err  # one step: nothing after it
