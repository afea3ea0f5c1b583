"""How long one engine step takes, from what the step computes. Pure functions of a ``StepShape``.

A step is one forward pass over the scheduled batch: prefill chunks (prompt tokens, or tokens
recomputed after a preemption) and decode tokens (one per running request that already has its
context in the KV cache). The scheduler describes it as a :class:`StepShape`; a timing model maps
the shape to milliseconds. Two models:

* :class:`PolynomialTiming` is Dynamo's mocker ("AISimulate" baseline, ``perf_model.rs``)::

      prefill_ms = c2*T^2 + c1*T + c0              (T = prefill tokens of the step, batch-wide)
      decode_ms  = max(floor, d2*u^2 + d1*u + d0)  (u = decode context tokens / KV capacity tokens)
      step_ms    = prefill_ms [if T > 0] + decode_ms [if any request decodes]

  ``u`` counts, for every request that decodes in the step, its whole sequence (prompt plus
  generated tokens, including the one being fed). We measured that against the
  ``ai-dynamo-runtime`` 1.6.1 binary: a step with one decode at sequence length 6,759 next to a
  5,376-token prefill chunk lasts 110.2951 + 6.0871 = 116.3821 ms, which the mocker reports to
  the microsecond. A request's first token comes from its prefill step and adds no decode time.
  The model has no batch-size term: 1 or 200 decodes over the same context cost the same.

* :class:`RooflineTiming` is an analytic model of one dense decoder on one GPU: the step lasts
  as long as the slower of reading memory (weights once, plus every attended KV token) and
  computing (2 FLOPs per parameter per token, plus attention), each at a fraction of the
  datasheet peak, plus a fixed launch/scheduling overhead and a small per-sequence one. Decode
  time therefore grows with batch size (more KV to read, more FLOPs) and context length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one engine step computes; the only input of a timing model."""

    #: Tokens computed for prefill chunks (prompt, or recompute after preemption), batch-wide.
    prefill_tokens: int = 0
    #: Requests with a prefill chunk in the step.
    prefill_seqs: int = 0
    #: Query-key pairs of the prefill chunks: sum of ``new * (context_before + (new + 1) / 2)``.
    prefill_attention_pairs: float = 0.0
    #: KV tokens the prefill chunks touch: sum of ``context_before + new``.
    prefill_kv_tokens: int = 0
    #: Requests decoding one token in the step.
    decode_seqs: int = 0
    #: Sum of the decoding requests' sequence lengths (prompt + generated, incl. the fed token).
    decode_context_tokens: int = 0
    #: KV capacity of the worker in tokens (blocks * block size).
    kv_capacity_tokens: int = 1


class TimingModel(Protocol):
    """Maps a step to its duration in milliseconds. Must be pure and deterministic."""

    def step_ms(self, shape: StepShape) -> float: ...


@dataclass(frozen=True, slots=True)
class PolynomialTiming:
    """Dynamo mocker's polynomial model (see the module docstring for the formulas)."""

    #: prefill_ms = c0 + c1*T + c2*T^2
    prefill_c0: float = 16.50142
    prefill_c1: float = 1.518344e-2
    prefill_c2: float = 4.209989e-7
    #: decode_ms = max(decode_floor_ms, d0 + d1*u + d2*u^2)
    decode_d0: float = 5.74
    decode_d1: float = 54.01
    decode_d2: float = -25.74
    decode_floor_ms: float = 1.0

    def prefill_ms(self, tokens: int) -> float:
        t = float(tokens)
        return self.prefill_c2 * t * t + self.prefill_c1 * t + self.prefill_c0

    def decode_ms(self, utilization: float) -> float:
        u = utilization
        return max(self.decode_floor_ms, self.decode_d2 * u * u + self.decode_d1 * u + self.decode_d0)

    def step_ms(self, shape: StepShape) -> float:
        ms = 0.0
        if shape.prefill_tokens > 0:
            ms += self.prefill_ms(shape.prefill_tokens)
        if shape.decode_seqs > 0:
            ms += self.decode_ms(shape.decode_context_tokens / shape.kv_capacity_tokens)
        return ms

    def decode_run_starts(
        self, t0: float, t_limit: float, decode_seqs: int, context_tokens: int,
        kv_capacity_tokens: int, max_steps: int,
    ) -> list[float]:
        """Start times ``[t0, t0 + d0, t0 + d0 + d1, ...]`` of back-to-back decode-only steps of
        ``decode_seqs`` requests whose sequences add up to ``context_tokens`` in the first step
        (each later step: ``decode_seqs`` more), until a step would start at or after
        ``t_limit`` or ``max_steps`` steps: the list ends with the end of the last step taken.
        ``d_i`` is :meth:`step_ms` of step ``i``'s shape with the same float operations in the
        same order, and the sum is taken left to right like the simulator's clock, so every
        time is the same float the step-by-step loop computes."""
        out = [t0]
        append = out.append
        t = t0
        ctx = context_tokens
        floor, d0, d1, d2 = self.decode_floor_ms, self.decode_d0, self.decode_d1, self.decode_d2
        n = 0
        while n < max_steps and t < t_limit:
            u = ctx / kv_capacity_tokens
            v = d2 * u * u + d1 * u + d0
            t = t + (0.0 + (v if v > floor else floor))  # step_ms: 0.0 + max(floor, v)
            append(t)
            ctx += decode_seqs
            n += 1
        return out


@dataclass(frozen=True, slots=True)
class RooflineTiming:
    """One forward pass = max(memory time, compute time) + overheads.

    memory_bytes = weight_bytes + kv_bytes_per_token * (decode context + prefill KV tokens)
    flops        = 2 * params * (prefill tokens + decode tokens)
                   + attn_flops_per_pair * (prefill query-key pairs + decode context)
    step_ms      = fixed_overhead_ms + per_seq_overhead_ms * seqs
                   + max(memory_bytes / (bandwidth * mbu), flops / (peak_flops * mfu)) * 1e3
    """

    params: float
    weight_bytes: float
    kv_bytes_per_token: float
    #: 4 * layers * (query heads * head dim): QK^T and AV, 2 FLOPs per multiply-add each.
    attn_flops_per_pair: float
    peak_flops: float
    mem_bandwidth: float
    mfu: float
    mbu: float
    fixed_overhead_ms: float = 0.0
    per_seq_overhead_ms: float = 0.0

    def step_ms(self, shape: StepShape) -> float:
        tokens = shape.prefill_tokens + shape.decode_seqs
        if tokens == 0:
            return 0.0
        mem = self.weight_bytes + self.kv_bytes_per_token * (
            shape.decode_context_tokens + shape.prefill_kv_tokens
        )
        flops = 2.0 * self.params * tokens + self.attn_flops_per_pair * (
            shape.prefill_attention_pairs + shape.decode_context_tokens
        )
        t_mem = mem / (self.mem_bandwidth * self.mbu)
        t_flops = flops / (self.peak_flops * self.mfu)
        seqs = shape.prefill_seqs + shape.decode_seqs
        return self.fixed_overhead_ms + self.per_seq_overhead_ms * seqs + 1e3 * max(t_mem, t_flops)

    def decode_run_starts(
        self, t0: float, t_limit: float, decode_seqs: int, context_tokens: int,
        kv_capacity_tokens: int, max_steps: int,
    ) -> list[float]:
        """See :meth:`PolynomialTiming.decode_run_starts`; ``step_ms`` of a decode-only shape,
        term for term."""
        out = [t0]
        append = out.append
        t = t0
        ctx = context_tokens
        seqs = 0 + decode_seqs
        tokens = 0 + decode_seqs
        flops_tokens = 2.0 * self.params * tokens
        bw = self.mem_bandwidth * self.mbu
        peak = self.peak_flops * self.mfu
        overhead = self.fixed_overhead_ms + self.per_seq_overhead_ms * seqs
        n = 0
        while n < max_steps and t < t_limit:
            mem = self.weight_bytes + self.kv_bytes_per_token * (ctx + 0)
            flops = flops_tokens + self.attn_flops_per_pair * (0.0 + ctx)
            t = t + (overhead + 1e3 * max(mem / bw, flops / peak))
            append(t)
            ctx += decode_seqs
            n += 1
        return out


def decode_run_starts(
    model: TimingModel, t0: float, t_limit: float, decode_seqs: int, context_tokens: int,
    kv_capacity_tokens: int, max_steps: int,
) -> list[float]:
    """Start times of back-to-back decode-only steps (see
    :meth:`PolynomialTiming.decode_run_starts`), from the model's own loop when it has one,
    else from ``model.step_ms`` step by step."""
    fast = getattr(model, "decode_run_starts", None)
    if fast is not None:
        return fast(t0, t_limit, decode_seqs, context_tokens, kv_capacity_tokens, max_steps)
    out = [t0]
    t = t0
    ctx = context_tokens
    while len(out) <= max_steps and t < t_limit:
        t = t + model.step_ms(
            StepShape(decode_seqs=decode_seqs, decode_context_tokens=ctx, kv_capacity_tokens=kv_capacity_tokens)
        )
        out.append(t)
        ctx += decode_seqs
    return out
