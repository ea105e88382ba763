"""The twin's model replicas: carpool's own policy objects, with passes priced by a profile.

A replica here owns no model. Every decision a real replica takes is taken by the object the
real replica uses: an encoder replica is a ``carpool.server.BatchedModelServer`` (admission
through its ``admitted()`` block, the ``LengthAwareExecutor``'s planning of the next pass,
the ``PassCostModel`` learning from each pass), and a generator replica plans each engine
step with ``carpool.generation.scheduler.Scheduler`` and admits with
``carpool.admission.slot_refusal``. What a pass costs comes from a cost profile entry
(``carpool_twin.profile.predict_ms``), times ``scale``.

Time is the simulation's clock in seconds; nothing here sleeps or reads a wall clock except
where carpool's own code does for deadlines, which the twin does not set.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from carpool.admission import RequestControls, SlotQueue, slot_refusal
from carpool.batching import Job, PassRecord
from carpool.config import BatchingConfig
from carpool.errors import RequestError
from carpool.generation.scheduler import Scheduler, SchedulerLimits
from carpool.server import BatchedModelServer
from carpool_twin.profile import predict_ms


@dataclass(eq=False)
class SimRequest:
    """One request as the twin sees it: its shape, not its text.

    Encoders (``embed``, ``rank``): ``lengths``, tokens per item (a rank item is one
    query-document pair). Generators: ``prompt_tokens``, ``max_tokens`` and
    ``output_tokens`` (what the model really produces; ``max_tokens`` when unknown).
    ``model`` picks a generator (``small``, ``large``, or ``auto`` through the router).
    ``small_mean_logprob``: what a cascade would read in the small model's answer.
    """

    kind: str
    _: KW_ONLY  # every other field by name: a prompt length must never land in ``lengths``
    lengths: tuple[int, ...] = ()
    prompt_tokens: int = 0
    max_tokens: int = 0
    output_tokens: int | None = None
    model: str = "small"
    text: str = ""
    priority: str = "interactive"
    small_mean_logprob: float = 0.0
    # Tokens until a client sees the first text: the stream holds a token back while its text
    # may still change (a partial character, a newline the next token may merge into), so a
    # first token that decodes to held text arrives with the second. A property of the prompt
    # and model, measured (benchmarks/twin_measure_gen.py: first_delta_tokens).
    first_visible: int = 1

    @property
    def items(self) -> int:
        return len(self.lengths) if self.kind != "generate" else 1

    @property
    def produced(self) -> int:
        out = self.max_tokens if self.output_tokens is None else self.output_tokens
        return max(1, min(out, self.max_tokens or out))


class PointsCurve:
    """A pass's cost by padded tokens, straight through the profile's measured points.

    A fitted line is least squares in milliseconds, so the largest passes decide it, and a
    small pass's fixed cost (kernel launches, pooling, Python) reads as nearly free. The
    measured points carry that cost; between them the twin interpolates linearly (the median
    of the shapes measured at one size), and past the ends it extends the nearest segment.
    """

    def __init__(self, points: list[Mapping[str, Any]], feature: str = "padded_tokens") -> None:
        by_size: dict[float, list[float]] = {}
        for p in points:
            by_size.setdefault(float(p[feature]), []).append(float(p["ms"]))
        if len(by_size) < 2:
            raise ValueError(f"interpolation needs points at two {feature} sizes at least")
        self.xs = sorted(by_size)
        self.ys = [sorted(by_size[x])[len(by_size[x]) // 2] for x in self.xs]
        self.feature = feature

    def __call__(self, features: Mapping[str, float]) -> float:
        x, xs, ys = float(features[self.feature]), self.xs, self.ys
        i = 1
        while i < len(xs) - 1 and x > xs[i]:
            i += 1
        slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
        return max(0.0, ys[i - 1] + slope * (x - xs[i - 1]))


class DecodeCurve:
    """A decode step's cost by batch, through the profile's measured points, plus its KV term.

    The decode fit is a least-squares plane in ``batch`` and ``kv_tokens``; the large batches
    decide it, and at small batches it is off by 10-15% either way (SmolLM2 on this machine:
    batch 1 measured 52.9 ms, the fit 45.8; batch 4 measured 48.5, the fit 55.7). A
    1-client calibration then books the batch-1 gap as per-step overhead, which every larger
    step pays again. Here a step costs ``kv_ms x kv_tokens`` plus a curve in ``batch``
    straight through the points (each less its KV term; the median where a batch was
    measured at several contexts), interpolated linearly between batches, the nearest
    segment extended past the ends. ``kv_ms`` is the KV slope the points themselves show
    (the median, over batches measured at two contexts or more, of their ms per KV token
    between the shortest and longest), or the fit's ``kv_tokens`` coefficient without such
    pairs.
    """

    def __init__(self, section: Mapping[str, Any]) -> None:
        points = list(section.get("points") or [])
        by_batch: dict[int, list[Mapping[str, Any]]] = {}
        for p in points:
            by_batch.setdefault(int(p["batch"]), []).append(p)
        slopes = []
        for ps in by_batch.values():
            lo = min(ps, key=lambda p: p["kv_tokens"])
            hi = max(ps, key=lambda p: p["kv_tokens"])
            if hi["kv_tokens"] > lo["kv_tokens"]:
                slopes.append((hi["ms"] - lo["ms"]) / (hi["kv_tokens"] - lo["kv_tokens"]))
        if slopes:
            self.kv_ms = max(0.0, sorted(slopes)[len(slopes) // 2])
        else:
            fit = section["fits"][section["use"]]["coef"]
            self.kv_ms = float(fit.get("kv_tokens", 0.0))
        self.curve = PointsCurve(
            [{"batch": p["batch"], "ms": p["ms"] - self.kv_ms * p["kv_tokens"]} for p in points],
            feature="batch",
        )

    def __call__(self, features: Mapping[str, float]) -> float:
        return self.kv_ms * float(features["kv_tokens"]) + self.curve(features)


def decode_cost(section: Mapping[str, Any], curve: str) -> Any:
    """``features -> ms`` for a generator's decode section: ``points`` (``DecodeCurve``) when
    the section has points at two batch sizes or more, else its chosen fit."""
    batches = {int(p["batch"]) for p in section.get("points") or [] if "kv_tokens" in p}
    if curve == "points" and len(batches) >= 2:
        return DecodeCurve(section)
    return lambda features: predict_ms(section, features)


def section_cost(section: Mapping[str, Any], curve: str) -> Any:
    """``features -> ms`` for a profile section: its chosen fit, or ``points``."""
    if curve == "points" and len(section.get("points") or []) >= 2:
        return PointsCurve(section["points"])
    return lambda features: predict_ms(section, features)


class _Future:
    """Stands in for a job's asyncio future: the executor only asks whether it is done."""

    def __init__(self) -> None:
        self._done = False

    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return False

    def set_exception(self, exc: BaseException) -> None:
        self._done = True

    def set_result(self, value: Any) -> None:
        self._done = True


class _Server(BatchedModelServer[Any, Any]):
    """A batched model server with no model: the twin runs its passes."""

    def __init__(self, batching: BatchingConfig) -> None:
        self._init_batching(lambda payloads: payloads, batching)
        # The heap trimmer returns memory to the OS on a wall-clock timer: not the twin's.
        self.executor.listeners = [
            x for x in self.executor.listeners if type(x).__name__ != "_HeapTrimmer"
        ]


@dataclass
class Work:
    """A pass (or engine step) a replica started: when it ends and what it carries."""

    ends: float
    payload: Any


class EncoderReplica:
    """An embedder or ranker replica: admission, length-aware planning, one pass at a time."""

    def __init__(
        self,
        name: str,
        batching: BatchingConfig,
        entry: Mapping[str, Any],
        scale: float = 1.0,
        request_ms: float = 0.0,
        curve: str = "points",
    ) -> None:
        self.name = name
        self.server = _Server(batching)
        self.cost = section_cost(entry["pass"], curve)
        self.scale = scale
        # Replica-side work per request outside the forward pass (tokenizing, answering):
        # it holds the replica's compute like a pass does.
        self.request_ms = request_ms
        self.busy = False
        self.ongoing = 0
        # @serve.batch: the first request of a batch waits this long for company when the
        # model is idle (arrivals during a pass merge into the next plan anyway).
        self.collect_s = batching.batch_wait_timeout_s
        self.collecting = False
        self._pending_ms = 0.0
        self._tickets: dict[int, Any] = {}

    def pass_ms(self, lengths: list[int]) -> float:
        rows, length = len(lengths), max(lengths)
        features = {
            "rows": rows,
            "length": length,
            "padded_tokens": rows * length,
            "attention": rows * length * length,
        }
        return self.scale * self.cost(features)

    def offer(self, now: float, req: SimRequest, tag: Any) -> RequestError | None:
        """Admission as the replica takes it; an admitted request joins the executor.

        ``tag`` identifies this submission; ``finish`` hands it back when it is answered.
        """
        lengths = list(req.lengths)
        block = self.server.admitted(len(lengths), sum(lengths), RequestControls())
        try:
            block.__enter__()
        except RequestError as refusal:
            return refusal
        job: Job[Any, Any] = self.server.make_job([None] * len(lengths), lengths)
        job.created = now  # the executor's urgency is relative to arrival: the twin's clock
        job.future = _Future()  # type: ignore[assignment]
        job.controls = tag
        self._tickets[id(job)] = block
        self.server.executor._waiting.append(job)
        self._pending_ms += self.request_ms
        self.ongoing += 1
        return None

    def start(self, now: float, slowdown: float = 1.0) -> Work | None:
        """The next pass, planned by carpool's executor, or None when nothing waits.

        ``slowdown``: the pass takes this many times its profile cost (a host CPU shared
        with other work, ``Overheads.host_cores``); the replica's cost model sees it so."""
        if self.busy or not self.server.executor._waiting:
            return None
        taken, planned = self.server.executor._plan()
        if not taken:
            return None
        lengths = [job.lengths[i] for job, i in taken]
        ms = self.pass_ms(lengths) * slowdown
        overhead, self._pending_ms = self._pending_ms, 0.0
        self.busy = True
        self.server.executor.stats.steps += 1
        return Work(now + (ms + overhead) / 1000, (taken, planned, ms, now))

    def finish(self, now: float, work: Work) -> list[Any]:
        """Ends a pass; returns the tags of the requests it completed."""
        taken, planned, ms, started = work.payload
        lengths = [job.lengths[i] for job, i in taken]
        record = PassRecord(
            items=len(taken),
            real_tokens=sum(lengths),
            padded_tokens=len(taken) * max(lengths),
            forward_ms=ms,
            queue_wait_ms=[(started - job.created) * 1000 for job, _ in taken],
            step_items=planned,
        )
        for listener in self.server.executor.listeners:
            listener.on_pass(record)  # the replica's own cost model learns from the pass
        done: list[Any] = []
        for job, _ in taken:
            job.remaining -= 1
            if job.remaining == 0:
                self._tickets.pop(id(job)).__exit__(None, None, None)
                self.ongoing -= 1
                done.append(job.controls)
        self.busy = False
        return done


# carpool/generation/config.py: batch_wait_timeout_s, when a generator's config sets none.
DEFAULT_GEN_COLLECT_S = 0.005


@dataclass(eq=False)
class _Seq:
    """A generator sequence as the scheduler reads it."""

    req: SimRequest
    tag: Any
    num_prompt_tokens: int
    arrived: float
    num_computed: int = 0
    generated: int = 0
    admitted_at: float = 0.0
    rank: int = 0


@dataclass
class GenEvents:
    """What one engine step produced: first tokens and finished sequences (their tags)."""

    first: list[Any] = field(default_factory=list)
    done: list[Any] = field(default_factory=list)
    tokens: int = 0


class GeneratorReplica:
    """A continuous-batching generator replica: carpool's step scheduler, profile costs.

    One engine step is a decode pass over the decoding sequences plus one prefill pass over
    prompt chunks, as ``carpool.generation.native`` runs it; the first token comes out of the
    step that completes a prompt. ``mode: vllm`` replicas are priced by the same step model
    (vLLM's scheduler has the same two bounds); their costs are only vLLM's when the profile
    entry measured vLLM.
    """

    def __init__(
        self,
        name: str,
        knobs: Mapping[str, Any],
        entry: Mapping[str, Any],
        scale: float = 1.0,
        max_kv_tokens: int | None = None,
        step_overhead_ms: float = 0.0,
        curve: str = "points",
        seq_overhead_ms: float = 0.0,
    ) -> None:
        self.name = name
        # Engine work per step outside the forward passes (scheduling, sampling,
        # detokenizing, handing events to the streams): the profile times passes only. Part
        # of it is per step, part per sequence in the step (its sampling, its text, its
        # event to its stream).
        self.step_overhead_ms = step_overhead_ms
        self.seq_overhead_ms = seq_overhead_ms
        self.limits = SchedulerLimits(
            int(knobs.get("max_num_seqs", 16)), int(knobs.get("max_step_tokens", 512))
        )
        self.scheduler: Scheduler[_Seq] = Scheduler(self.limits, "priority")
        self.max_waiting = int(knobs.get("max_waiting", 256))
        self.max_queue_delay_ms = float(knobs.get("max_queue_delay_ms", 60_000))
        self.batch_tier_share = float(knobs.get("batch_tier_share", 0.5))
        self.prefill = entry["prefill"]
        # Decode steps through the measured points (``DecodeCurve``; ``curve="fit"``: the
        # section's fit, as before 2026-11-26 08:00 UTC); prefill keeps its fit.
        self.decode = decode_cost(entry["decode"], curve)
        self.scale = scale
        # Sequences beyond what the KV cache holds at full length wait, as the engine's
        # slot cache bounds them (tokens = max_kv_cache_mb / kv_bytes_per_token).
        self.max_kv_tokens = max_kv_tokens
        self.decoding: list[_Seq] = []
        self.prefilling: list[_Seq] = []
        # Arrivals reach the engine in batches: ``@serve.batch`` (``ArrivalCollector``
        # without Serve) holds the first arrival ``batch_wait_timeout_s`` for company and
        # submits everything that came meanwhile at once, engine busy or not. Until then
        # the engine cannot see them (``arriving``); ``collecting``: a window is open.
        self.collect_s = float(knobs.get("batch_wait_timeout_s", DEFAULT_GEN_COLLECT_S))
        self.arriving: list[_Seq] = []
        self.collecting = False
        self.busy = False
        self.ongoing = 0
        self._slot_s = 0.0  # mean time a sequence holds its slot (0 until one finished)
        self._finished = 0

    def offer(self, now: float, req: SimRequest, tag: Any) -> RequestError | None:
        """Admission as the batch handler takes it (the calls of one batch queue behind each
        other); an admitted request waits in ``arriving`` until ``collect`` when the
        replica collects arrivals, else joins the scheduler at once."""
        waiting = len(self.scheduler.waiting) + len(self.arriving)
        queue = SlotQueue(waiting, self._slot_s, self.limits.max_num_seqs)
        refusal = slot_refusal(
            self.name,
            queue,
            RequestControls(priority=req.priority),  # type: ignore[arg-type]
            self.max_waiting,
            self.max_queue_delay_ms,
            self.batch_tier_share,
        )
        if refusal is not None:
            return refusal
        seq = _Seq(req, tag, max(1, req.prompt_tokens), now, rank=int(req.priority == "batch"))
        if self.collect_s > 0:
            self.arriving.append(seq)
        else:
            self.scheduler.add(seq)
        self.ongoing += 1
        return None

    def collect(self) -> None:
        """The collection window closes: its arrivals reach the engine together."""
        arrived, self.arriving = self.arriving, []
        for seq in arrived:
            self.scheduler.add(seq)
        self.collecting = False

    def step_ms(self, decode: list[_Seq], prefill: list[tuple[_Seq, int]]) -> float:
        """What a step costs, in the features the profile measured them by. carpool's
        ``SlotRunner`` computes padded passes: a prefill's chunks are left-padded to the
        longest (``rows x width`` tokens) and every row attends to the longest row's context
        (the slot view ``[0, view_len)``); a decode step likewise. The profile's points have
        equal rows, where padded and real coincide."""
        ms = 0.0
        if decode:
            view = max(s.num_computed for s in decode) + 1
            ms += self.decode({"batch": len(decode), "kv_tokens": len(decode) * view})
        if prefill:
            width = max(n for _, n in prefill)
            view = max(s.num_computed + n for s, n in prefill)
            ms += predict_ms(
                self.prefill,
                {
                    "tokens": len(prefill) * width,
                    "rows": len(prefill),
                    "attention": len(prefill) * width * view,
                },
            )
        seqs = len(decode) + len(prefill)
        return self.scale * ms + self.step_overhead_ms + self.seq_overhead_ms * seqs

    def _kv_room(self) -> bool:
        if self.max_kv_tokens is None:
            return True
        held = sum(s.num_prompt_tokens + s.req.produced for s in self.decoding + self.prefilling)
        nxt = self.scheduler.waiting.peek() if len(self.scheduler.waiting) else None
        need = 0 if nxt is None else nxt.num_prompt_tokens + nxt.req.produced
        return held + need <= self.max_kv_tokens

    def start(self, now: float, slowdown: float = 1.0) -> Work | None:
        """The next engine step, or None when nothing runs (``slowdown`` as an encoder's)."""
        if self.busy:
            return None
        if not self._kv_room():
            # No room for the next sequence: the scheduler plans without admitting anyone.
            waiting, self.scheduler.waiting = self.scheduler.waiting, type(self.scheduler.waiting)()
            plan = self.scheduler.schedule(self.decoding, self.prefilling)
            self.scheduler.waiting = waiting
        else:
            plan = self.scheduler.schedule(self.decoding, self.prefilling)
        if not plan:
            return None
        for seq in plan.admitted:
            seq.admitted_at = now
        self.prefilling.extend(plan.admitted)
        self.busy = True
        return Work(now + slowdown * self.step_ms(plan.decode, plan.prefill) / 1000, plan)

    def finish(self, now: float, work: Work) -> GenEvents:
        plan = work.payload
        events = GenEvents()
        ended: list[_Seq] = []
        for seq in plan.decode:
            seq.num_computed += 1
            seq.generated += 1
            events.tokens += 1
            if seq.generated == seq.req.first_visible:
                events.first.append(seq.tag)
            if seq.generated >= seq.req.produced:
                ended.append(seq)
        for seq, n in plan.prefill:
            seq.num_computed += n
            if seq.num_computed >= seq.num_prompt_tokens:
                self.prefilling.remove(seq)
                self.decoding.append(seq)
                seq.generated = 1  # the prompt's last position samples the first token
                events.tokens += 1
                if seq.req.first_visible <= 1:
                    events.first.append(seq.tag)
                if seq.generated >= seq.req.produced:
                    ended.append(seq)
        for seq in ended:
            if seq.generated < seq.req.first_visible:
                events.first.append(seq.tag)  # the end flushes whatever text was held
            self.decoding.remove(seq)
            self.ongoing -= 1
            self._finished += 1
            held = now - seq.admitted_at
            # A running mean, as the replica's admission reads a slot's holding time.
            self._slot_s += (held - self._slot_s) / min(self._finished, 100)
            events.done.append(seq.tag)
        self.busy = False
        return events
