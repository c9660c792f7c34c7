"""megabake.generation's timing: ms/token over the whole answer and after the first host round trip.

The first call of a megakernel decoder captures its CUDA graphs (tens of ms), which dominates a short answer's
ms/token; ``Generation.steady_ms_per_token`` leaves that round trip out. Fake decoders with a slow first call
stand in for the GPU (the timing logic is host code); they advance a fake clock that ``megabake.generation`` reads
in place of ``time``, so the rates are exact and no machine load can move them."""

from __future__ import annotations

import pytest
import torch

import megabake.generation
from megabake.generation import generate

VOCAB = 11
FIRST_CALL_S = 0.25
LATER_CALL_S = 0.002


class FakeClock:
    """``time.perf_counter`` for megabake.generation: it moves only when a fake decoder works."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(megabake.generation, "time", fake)
    return fake


class SlowFirstStep:
    """Greedy decoder over a fixed logit table: token t -> t + 1; the first step takes FIRST_CALL_S."""

    batch, capacity = 1, 64

    def __init__(self, clock: FakeClock):
        self.clock = clock
        self.calls = 0

    def _logits(self, token: int) -> torch.Tensor:
        return torch.nn.functional.one_hot(torch.tensor([(token + 1) % VOCAB]), VOCAB).float()

    def prefill(self, prompt):
        return self._logits(int(prompt[0, -1]))

    def step(self, token, position):
        self.calls += 1
        self.clock.now += FIRST_CALL_S if self.calls == 1 else LATER_CALL_S
        return self._logits(int(token[0]))


class SlowFirstChunk(SlowFirstStep):
    """Adds ``greedy_tokens`` (n steps per host round trip, as the megakernel's GPU-side greedy loop)."""

    def greedy_tokens(self, token, position, n):
        self.calls += 1
        self.clock.now += FIRST_CALL_S if self.calls == 1 else LATER_CALL_S * n
        first = int(token[0]) + 1
        return torch.tensor([[(first + i) % VOCAB for i in range(n)]])


def test_steady_ms_per_token_leaves_out_the_first_step(clock):
    result = generate(SlowFirstStep(clock), torch.tensor([[3]]), max_new_tokens=9, eos_token_id=[])
    assert result.new_tokens.tolist() == [[4, 5, 6, 7, 8, 9, 10, 0, 1]]
    assert result.first_round_trip_steps == 1 and len(result.step_times_s) == 8
    # the overall rate carries the slow first call; the steady rate is the later steps' own
    assert result.ms_per_token == pytest.approx(1e3 * (FIRST_CALL_S + 7 * LATER_CALL_S) / 8)
    assert result.steady_ms_per_token == pytest.approx(1e3 * LATER_CALL_S)


def test_steady_ms_per_token_leaves_out_the_first_greedy_chunk(clock):
    result = generate(SlowFirstChunk(clock), torch.tensor([[3]]), max_new_tokens=20, eos_token_id=[],
                      sync_every=8)
    assert result.new_tokens.tolist()[0] == [(4 + i) % VOCAB for i in range(20)]
    assert result.first_round_trip_steps == 8 and len(result.step_times_s) == 19
    assert result.ms_per_token == pytest.approx(1e3 * (FIRST_CALL_S + 11 * LATER_CALL_S) / 19)
    assert result.steady_ms_per_token == pytest.approx(1e3 * LATER_CALL_S)


def test_no_steady_rate_without_steps_after_the_first_round_trip(clock):
    one_chunk = generate(SlowFirstChunk(clock), torch.tensor([[3]]), max_new_tokens=8, eos_token_id=[],
                         sync_every=8)
    assert one_chunk.first_round_trip_steps == 7 and one_chunk.steady_ms_per_token is None
    prefill_only = generate(SlowFirstStep(clock), torch.tensor([[3]]), max_new_tokens=1, eos_token_id=[])
    assert prefill_only.first_round_trip_steps == 0 and prefill_only.steady_ms_per_token is None
    assert prefill_only.ms_per_token is None


def test_run_reports_both_rates(capsys, clock):
    from megabake.runtime.commands import echo_stats

    echo_stats(generate(SlowFirstStep(clock), torch.tensor([[3]]), max_new_tokens=9, eos_token_id=[]), "cuda")
    err = capsys.readouterr().err
    assert "tokens/s over 8 decode steps; " in err
    assert "ms/token after the first host round trip (its 1 step includes one-time set-up" in err
    echo_stats(generate(SlowFirstStep(clock), torch.tensor([[3]]), max_new_tokens=2, eos_token_id=[]), "cuda")
    assert "after the first host round trip" not in capsys.readouterr().err  # one step: nothing after it
