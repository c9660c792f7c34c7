"""Integrations: run baked megakernels under the APIs people already call.

Contract:

* ``make_backend(fallback="inductor", other="inductor", capacity=None, check_first_call=True, model=None)`` ->
  :class:`MegaBakeBackend`, a ``torch.compile`` backend: ``torch.compile(model, backend=make_backend(),
  fullgraph=True)`` runs one-token static-cache decode calls on a megakernel baked (once per model and bucket,
  cached on the backend) for the model, and every other graph through Inductor; ``backend.report`` says which
  path served each graph and why (``megabake.integrations.backend``).
* ``serve_decode_steps(model, decoder, fallback="error")`` -> :class:`DecodeStepServer`, a context manager under
  which ``model.generate(...)`` of transformers prefills eagerly and runs every decode step on ``decoder``,
  token for token the greedy ids of ``decoder.generate`` (``megabake.integrations.dropin``).
* ``bake_decoder(model, batch=1, capacity=128)`` -> a bound :class:`~megabake.runtime.MegakernelDecoder`, baked
  in memory without writing a package (``megabake.integrations.bake``).
"""

from __future__ import annotations

from .backend import GraphRecord, MegaBakeBackend, make_backend
from .bake import bake_decoder
from .dropin import DecodeStepServer, DropInStats, serve_decode_steps

__all__ = ["make_backend", "MegaBakeBackend", "GraphRecord", "serve_decode_steps", "DecodeStepServer",
           "DropInStats", "bake_decoder"]
