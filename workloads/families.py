"""The workload families: parametric models of who sends what, as Mooncake-format records.

Each family is a session model: a session (a conversation, an agent task, one RAG question,
one long-document question) is a list of requests ``(arrival s, segments, output tokens,
turn)``; the prompt's segments become hash ids through a shared :class:`BlockSpace`, so equal
text shares blocks exactly as far as it is a common prefix. Sessions start on the arrival
process (:mod:`workloads.arrivals`) at ``rate / mean requests per session``, so the request
rate is the asked one; sessions start from a warm-up before 0 and only requests in
``[0, duration)`` are kept, so a run starts in steady state (a trace window, like a real trace's:
some conversations are already under way).

Every knob has a default from published statistics; ``docs/workloads.md`` cites each. Lengths
are log-normal (given by median and sigma; the mean is ``median * exp(sigma**2 / 2)``), counts
geometric, popularity Zipf.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar

from workloads.blocks import BlockSpace, Segment
from workloads.rng import Draws, cdf, zipf_cdf

# A request of a session: (arrival s, prompt segments, output tokens, turn).
Turn = tuple[float, list[Segment], int, int]


def _tokens(x: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(round(x))))


def _knob(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class Family:
    """Knobs common to every family (each family adds its own)."""

    name: ClassVar[str] = ""
    #: The family's default request rate (req/s) when ``--rate`` is not given.
    default_rate: ClassVar[float] = 2.0

    def mean_requests_per_session(self) -> float:
        return 1.0

    def warmup_s(self) -> float:
        """How long before 0 sessions start (long enough for the session length to settle)."""
        return 0.0

    def session(self, sid: int, t0: float, d: Draws, ns: Hashable) -> list[Turn]:
        raise NotImplementedError

    @classmethod
    def knobs(cls) -> dict[str, tuple[Any, str]]:
        """Knob name -> (default, description)."""
        return {f.name: (f.default, f.metadata.get("help", "")) for f in fields(cls)}

    def with_knobs(self, values: Mapping[str, str | float | int]) -> Family:
        known = {f.name: f for f in fields(self)}
        changes: dict[str, Any] = {}
        for k, v in values.items():
            if k not in known:
                raise ValueError(f"family {self.name!r} has no knob {k!r}; knobs: {', '.join(known)}")
            typ = type(known[k].default)
            try:
                changes[k] = typ(v) if typ is not bool else str(v).lower() in ("1", "true", "yes")
            except ValueError as e:
                raise ValueError(f"knob {k}={v!r}: expected {typ.__name__}") from e
        return replace(self, **changes)


@dataclass(frozen=True)
class Chat(Family):
    """Multi-turn conversations: each turn's prompt is the whole conversation so far (system
    prompt, earlier user messages and answers) plus a new user message."""

    name: ClassVar[str] = "chat"
    default_rate: ClassVar[float] = 4.0

    system_prompts: int = _knob(16, "distinct system prompts (shared across conversations)")
    system_prompt_zipf: float = _knob(1.0, "Zipf exponent of system prompt popularity")
    system_prompt_tokens: int = _knob(1000, "median system prompt length (log-normal, sigma 0.5, per prompt)")
    turns_mean: float = _knob(2.0, "mean turns per conversation (geometric)")
    user_tokens_median: float = _knob(70.0, "median user message tokens")
    user_tokens_sigma: float = _knob(1.2, "log-normal sigma of user message tokens")
    output_tokens_median: float = _knob(200.0, "median answer tokens")
    output_tokens_sigma: float = _knob(0.8, "log-normal sigma of answer tokens")
    max_output_tokens: int = _knob(4096, "answer length cap")
    think_s_median: float = _knob(30.0, "median seconds between a turn and the next (reading + typing)")
    think_s_sigma: float = _knob(1.0, "log-normal sigma of the think time")
    max_context_tokens: int = _knob(32768, "a conversation ends when its next prompt would exceed this")

    def mean_requests_per_session(self) -> float:
        return self.turns_mean

    def warmup_s(self) -> float:
        return 4 * self.turns_mean * self.think_s_median * math.exp(self.think_s_sigma ** 2 / 2)

    def session(self, sid: int, t0: float, d: Draws, ns: Hashable) -> list[Turn]:
        sp_cdf = zipf_cdf(self.system_prompts, self.system_prompt_zipf)
        sp = d.index(sp_cdf)
        sp_len = _tokens(Draws(ns, "system-prompt", sp).lognormal(self.system_prompt_tokens, 0.5), 1, 1 << 20)
        ctx: list[Segment] = [((ns, "sys", sp), sp_len)]
        n_turns = d.geometric(self.turns_mean)
        out: list[Turn] = []
        t = t0
        for k in range(n_turns):
            user = ((ns, sid, "u", k), _tokens(d.lognormal(self.user_tokens_median, self.user_tokens_sigma), 1, 1 << 20))
            osl = _tokens(d.lognormal(self.output_tokens_median, self.output_tokens_sigma), 1, self.max_output_tokens)
            prompt = [*ctx, user]
            if sum(n for _, n in prompt) > self.max_context_tokens:
                break
            out.append((t, prompt, osl, k))
            ctx = [*prompt, ((ns, sid, "a", k), osl)]
            t += d.lognormal(self.think_s_median, self.think_s_sigma)
        return out


@dataclass(frozen=True)
class Agentic(Family):
    """Tool-calling loops: every step's prompt is the task's context so far; the model answers
    with a tool call, the tool's output is appended, and the next step follows after the tool
    runs. Sometimes a step fans out into parallel sub-agents that share the parent's context
    as their prefix; their results are appended to the parent's context when all are done."""

    name: ClassVar[str] = "agentic"
    default_rate: ClassVar[float] = 4.0

    system_prompts: int = _knob(4, "distinct agent system prompts with their tool schemas")
    system_prompt_tokens: int = _knob(2500, "median system prompt + tool schema tokens (log-normal, sigma 0.3)")
    task_tokens_median: float = _knob(400.0, "median task description tokens")
    task_tokens_sigma: float = _knob(1.0, "log-normal sigma of the task description")
    steps_mean: float = _knob(6.0, "mean model calls per task (geometric)")
    output_tokens_median: float = _knob(120.0, "median tokens of a model call's output (a tool call)")
    output_tokens_sigma: float = _knob(0.9, "log-normal sigma of the output")
    max_output_tokens: int = _knob(4096, "output length cap")
    tool_tokens_median: float = _knob(450.0, "median tokens of a tool's output appended to the context")
    tool_tokens_sigma: float = _knob(1.0, "log-normal sigma of the tool output")
    pause_s_median: float = _knob(3.0, "median seconds between a step and the next (generation + tool run)")
    pause_s_sigma: float = _knob(0.8, "log-normal sigma of the pause")
    fanout_prob: float = _knob(0.1, "probability that a step spawns parallel sub-agents")
    fanout_width: int = _knob(3, "sub-agents per fan-out")
    sub_steps_mean: float = _knob(2.0, "mean steps of a sub-agent (geometric)")
    max_context_tokens: int = _knob(131072, "a task ends when its next prompt would exceed this")

    def mean_requests_per_session(self) -> float:
        # Each step may add fanout_width sub-agents of sub_steps_mean steps.
        return self.steps_mean * (1 + self.fanout_prob * self.fanout_width * self.sub_steps_mean)

    def warmup_s(self) -> float:
        return 4 * self.steps_mean * self.pause_s_median * math.exp(self.pause_s_sigma ** 2 / 2)

    def _pause(self, d: Draws) -> float:
        return d.lognormal(self.pause_s_median, self.pause_s_sigma)

    def _osl(self, d: Draws) -> int:
        return _tokens(d.lognormal(self.output_tokens_median, self.output_tokens_sigma), 1, self.max_output_tokens)

    def _tool(self, d: Draws) -> int:
        return _tokens(d.lognormal(self.tool_tokens_median, self.tool_tokens_sigma), 1, 1 << 20)

    def session(self, sid: int, t0: float, d: Draws, ns: Hashable) -> list[Turn]:
        sp = d.below(self.system_prompts)
        sp_len = _tokens(Draws(ns, "system-prompt", sp).lognormal(self.system_prompt_tokens, 0.3), 1, 1 << 20)
        ctx: list[Segment] = [((ns, "sys", sp), sp_len),
                              ((ns, sid, "task"), _tokens(d.lognormal(self.task_tokens_median, self.task_tokens_sigma), 1, 1 << 20))]
        out: list[Turn] = []
        t = t0
        turn = 0
        for k in range(d.geometric(self.steps_mean)):
            if sum(n for _, n in ctx) > self.max_context_tokens:
                break
            osl = self._osl(d)
            out.append((t, ctx, osl, turn))
            turn += 1
            ctx = [*ctx, ((ns, sid, "call", k), osl), ((ns, sid, "tool", k), self._tool(d))]
            t += self._pause(d)
            if d.uniform() < self.fanout_prob:
                end = t
                for j in range(self.fanout_width):
                    sub = [*ctx, ((ns, sid, "sub", k, j), _tokens(d.lognormal(self.task_tokens_median / 2, 0.5), 1, 1 << 20))]
                    ts = t
                    for m in range(d.geometric(self.sub_steps_mean)):
                        if sum(n for _, n in sub) > self.max_context_tokens:
                            break
                        osl = self._osl(d)
                        out.append((ts, sub, osl, turn))
                        turn += 1
                        sub = [*sub, ((ns, sid, "subcall", k, j, m), osl), ((ns, sid, "subtool", k, j, m), self._tool(d))]
                        ts += self._pause(d)
                    end = max(end, ts)
                    ctx = [*ctx, ((ns, sid, "subresult", k, j), self._osl(d))]
                t = end
        return out


@dataclass(frozen=True)
class Rag(Family):
    """Retrieval-augmented questions: a system prompt, then k documents retrieved from a corpus
    whose popularity is Zipf, in retrieval order, then the question. Prompts share blocks only
    as far as their documents agree from the first one on (a prefix cache's view)."""

    name: ClassVar[str] = "rag"
    default_rate: ClassVar[float] = 4.0

    system_prompt_tokens: int = _knob(300, "system prompt tokens (one, shared by all)")
    corpus_docs: int = _knob(10000, "documents in the corpus")
    doc_zipf: float = _knob(1.0, "Zipf exponent of document popularity")
    doc_tokens_median: float = _knob(500.0, "median document chunk tokens (log-normal, sigma 0.3, per document)")
    docs_per_request: int = _knob(5, "documents retrieved per question (k)")
    question_tokens_median: float = _knob(30.0, "median question tokens")
    question_tokens_sigma: float = _knob(0.6, "log-normal sigma of the question")
    output_tokens_median: float = _knob(150.0, "median answer tokens")
    output_tokens_sigma: float = _knob(0.7, "log-normal sigma of the answer")
    max_output_tokens: int = _knob(2048, "answer length cap")

    def session(self, sid: int, t0: float, d: Draws, ns: Hashable) -> list[Turn]:
        docs_cdf = _zipf_memo(self.corpus_docs, self.doc_zipf)
        picked: list[int] = []
        while len(picked) < min(self.docs_per_request, self.corpus_docs):
            doc = d.index(docs_cdf)
            if doc not in picked:
                picked.append(doc)
        segs: list[Segment] = [((ns, "sys"), self.system_prompt_tokens)]
        for doc in picked:
            segs.append(((ns, "doc", doc), _tokens(Draws(ns, "doc", doc).lognormal(self.doc_tokens_median, 0.3), 1, 1 << 20)))
        segs.append(((ns, sid, "q"), _tokens(d.lognormal(self.question_tokens_median, self.question_tokens_sigma), 1, 1 << 20)))
        osl = _tokens(d.lognormal(self.output_tokens_median, self.output_tokens_sigma), 1, self.max_output_tokens)
        return [(t0, segs, osl, 0)]


@dataclass(frozen=True)
class LongContext(Family):
    """Long documents with a heavy length tail and little sharing: a short system prompt, a
    document, a question; a few questions revisit a recent document (its blocks are shared)."""

    name: ClassVar[str] = "long-context"
    default_rate: ClassVar[float] = 1.0

    system_prompt_tokens: int = _knob(200, "system prompt tokens (one, shared by all)")
    doc_tokens_median: float = _knob(12000.0, "median document tokens")
    doc_tokens_sigma: float = _knob(1.0, "log-normal sigma of document tokens (p99 = median * e**(2.33 sigma))")
    max_input_tokens: int = _knob(200000, "prompt length cap")
    revisit_prob: float = _knob(0.1, "probability that a question is about one of the last recent_docs documents")
    recent_docs: int = _knob(50, "how many recent documents a revisit picks from")
    question_tokens_median: float = _knob(50.0, "median question tokens")
    output_tokens_median: float = _knob(200.0, "median answer tokens")
    output_tokens_sigma: float = _knob(0.8, "log-normal sigma of the answer")
    max_output_tokens: int = _knob(4096, "answer length cap")

    def session(self, sid: int, t0: float, d: Draws, ns: Hashable) -> list[Turn]:
        # A revisit names a document of an earlier session (by its session id), so the choice
        # depends only on this session's draws.
        doc = sid
        if sid > 0 and d.uniform() < self.revisit_prob:
            doc = sid - 1 - d.below(min(self.recent_docs, sid))
        q = _tokens(d.lognormal(self.question_tokens_median, 0.6), 1, 1 << 20)
        room = self.max_input_tokens - self.system_prompt_tokens - q
        doc_len = _tokens(Draws(ns, "doc", doc).lognormal(self.doc_tokens_median, self.doc_tokens_sigma), 1, max(room, 1))
        osl = _tokens(d.lognormal(self.output_tokens_median, self.output_tokens_sigma), 1, self.max_output_tokens)
        return [(t0, [((ns, "sys"), self.system_prompt_tokens), ((ns, "doc", doc), doc_len), ((ns, sid, "q"), q)], osl, 0)]


_ZIPF: dict[tuple[int, float], list[float]] = {}


def _zipf_memo(n: int, s: float) -> list[float]:
    got = _ZIPF.get((n, s))
    if got is None:
        got = _ZIPF[(n, s)] = zipf_cdf(n, s)
    return got


#: The single-model families by name (``mixed`` combines them: :mod:`workloads.generator`).
FAMILIES: dict[str, type[Family]] = {"chat": Chat, "agentic": Agentic, "rag": Rag, "long-context": LongContext}


@dataclass(frozen=True)
class Tenant:
    name: str
    family: str
    #: Share of the requests.
    weight: float
    #: 0 most urgent.
    priority: int


#: The ``mixed`` family's tenants (knob ``weights=chat:0.5,...`` changes the shares).
MIXED_TENANTS: tuple[Tenant, ...] = (
    Tenant("assistant", "chat", 0.5, 1),
    Tenant("agents", "agentic", 0.25, 2),
    Tenant("search", "rag", 0.15, 1),
    Tenant("documents", "long-context", 0.10, 3),
)
